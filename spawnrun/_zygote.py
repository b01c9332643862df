"""The zygote: a template process that imports once, then forks one child per test.

Runs in the template, which the parent starts with the spawn method (it is never
forked from the parent), and in the children it forks. The template imports the
modules of ini ``spawn_preload``, configures pytest as the parent did, collects what
the parent collected (importing conftests and test modules), and then serves fork
requests. Before every fork it checks that no device runtime is initialized in itself:
forking a CUDA context is the bug this project exists to avoid. If one is, it refuses,
says who initialized it, and the parent spawns instead from then on.

A forked child makes itself the test's own process (session, output, stacks), gets a
fresh base temp dir and fresh capture buffers, finds its test among the template's
collected items, and runs it like a spawned child, reporting over its own pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
import traceback
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest

from spawnrun import _child
from spawnrun import _cudawatch
from spawnrun import _protocol as proto


def main(spec: proto.ZygoteSpec, conn: Connection) -> None:
    _child.ACTIVE = True
    os.setsid()
    fd = os.open(spec.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(spec.invocation_dir)
    server = _Server(conn)
    try:
        for name in spec.preload:
            importlib.import_module(name)
        _cudawatch.watch()
        config = pytest.Config.fromdictargs(spec.option_dict, [*spec.plugin_args, *spec.args])
        config.pluginmanager.register(server, "spawnrun-zygote")
        config.hook.pytest_cmdline_main(config=config)
    except BaseException:  # noqa: BLE001 - the parent must hear why, then spawns
        if not server.ready:
            with contextlib.suppress(OSError):
                conn.send(proto.ZygoteReady(os.getpid(), traceback.format_exc()))


def device_state() -> str:
    """Name a device runtime initialized in this process ("" if none): forking it is unsafe."""
    runtime = _child.device_runtime()
    if runtime:
        return f"{runtime} is initialized"
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    with contextlib.suppress(Exception):
        if cuda is not None and cuda._is_in_bad_fork():
            return "torch.cuda is in a bad-fork state"
    if _cuda_driver_initialized():
        return "the CUDA driver is initialized (cuInit was called)"
    return ""


#: cuDeviceGetCount's answer before cuInit: the driver is loaded but not initialized.
_CUDA_ERROR_NOT_INITIALIZED = 3


def _cuda_driver_initialized() -> bool:
    """Whether cuInit ran in this process, asked of the driver without initializing it.

    ``import torch`` (CUDA builds) maps libcuda.so without initializing it, and forking
    then is safe; what is not safe is forking after cuInit. cuDeviceGetCount answers
    CUDA_ERROR_NOT_INITIALIZED until cuInit has run, and has no side effect. The library
    is only looked up if it is already mapped (RTLD_NOLOAD): spawnrun never loads it.
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcuda.so" in line}
    except OSError:
        return False
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED:
                return True
        except (OSError, AttributeError):
            return True  # mapped but cannot be asked: assume the worst
    return False


class _Server:
    """Template-side pytest plugin: after collection, serve fork requests until EOF."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.ready = False
        self.refusal = ""
        #: pidfd -> pid of each forked child still running: its exit wakes us at once.
        self.children: dict[int, int] = {}

    @pytest.hookimpl
    def pytest_collectstart(self) -> None:
        _cudawatch.watch()  # a test module may import torch: see who initializes CUDA

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        self.conn.send(proto.ZygoteReady(os.getpid()))
        self.ready = True
        while True:
            ready = wait([self.conn, *self.children])
            for fd in [r for r in ready if r in self.children]:
                self._reap(fd)
            if self.conn not in ready:
                continue
            try:
                request = self.conn.recv()
            except (EOFError, OSError):
                return True  # the parent is done with us
            if isinstance(request, proto.ForkRequest):
                self._fork(request, reduction.recv_handle(self.conn), session)

    def _reap(self, pidfd: int) -> None:
        pid = self.children.pop(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        self.conn.send(proto.Exited(pid, os.waitstatus_to_exitcode(status)))

    def _fork(self, request: proto.ForkRequest, fd: int, session: pytest.Session) -> None:
        if not self.refusal:
            state = device_state() or _fork_unsafe_by_plugins(session.config)
            if state:
                self.refusal = state + _cudawatch.origin_text()
        if self.refusal:
            os.close(fd)
            self.conn.send(proto.Refused(self.refusal))
            return
        pid = os.fork()
        if pid == 0:
            _forked_child(request, fd, session, self.conn, list(self.children))
        os.close(fd)
        self.children[os.pidfd_open(pid)] = pid
        self.conn.send(proto.Forked(pid))


def _fork_unsafe_by_plugins(config: pytest.Config) -> str:
    result = config.hook.pytest_spawnrun_device_state(config=config)
    return str(result) if result else ""


def _forked_child(
    request: proto.ForkRequest,
    fd: int,
    session: pytest.Session,
    zygote: Connection,
    inherited: list[int],
) -> None:
    code = 0
    try:
        zygote.close()
        for pidfd in inherited:  # the template's watches on its other children
            os.close(pidfd)
        os.environ.update(request.env)
        relay = _child.isolate(request.spec, Connection(fd))
        config = session.config
        _fresh_buffers(config, request.spec)
        relay.late = True
        config.pluginmanager.register(relay, "spawnrun-child")
        os.chdir(request.spec.invocation_dir)
        try:
            relay.serve(session)
        except BaseException:  # noqa: BLE001 - Exit / KeyboardInterrupt were reported
            if not relay.interrupted:
                relay.notes.append("error in the forked child:\n" + traceback.format_exc())
        relay.finish()
    except BaseException:  # noqa: BLE001
        code = 70
    finally:
        # Never run the template's atexit handlers or return into its loop.
        os._exit(code)


def _fresh_buffers(config: pytest.Config, spec: proto.ChildSpec) -> None:
    """Own capture buffers and base temp dir: the template's are shared with its forks.

    pytest exposes neither the session's capture buffers nor its base temp dir, so two
    private attributes are reset here, in the forked child only.
    """
    capman: Any = config.pluginmanager.getplugin("capturemanager")
    if capman is not None and capman.is_globally_capturing():
        capman.stop_global_capturing()
        capman.start_global_capturing()
        capman.suspend_global_capture()
    factory: Any = getattr(config, "_tmp_path_factory", None)
    basetemp = spec.option_dict.get("basetemp")
    if factory is not None and basetemp:
        factory._given_basetemp = Path(os.path.abspath(basetemp))
        factory._basetemp = None
