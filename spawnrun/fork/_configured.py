"""Configured templates: pytest configured once, each test's child forked from there.

Runs in the zygote (``Pool``) and in the processes it forks for it (``main``), whose own
forks are the tests' children. A child forked from the zygote configures pytest itself
(half of a trivial test's cost on the CPU: pytest builds its plugin manager, parses,
reads the ini file, imports the conftests). A configured template does that once: the
zygote forks it with its first test's environment (devices), it configures
pytest with the parent's own arguments (the conftests the parent loaded, as in-process),
starts the session, and stops where the session would collect. Each fork of it then
takes the test's spec (output, stacks, base temp, environment) and collects the test's
own file, as a child of its own would; its tests never see another test file.

One template per environment and configuration: a test whose environment or options
differ (other devices) gets one of its own, at most ``LIMIT`` at once, started at its
kind's first test. A budget is not part of a kind (a learned one is a test's own, to the
byte): the template runs with none, as in-process pytest does, and each fork takes its
test's budget before any of its code runs (``_budget.install``). A
template that is not ready yet, or that its conftests left unsafe to fork (a thread, a
device runtime: ``_forksafe``), leaves the test to the zygote, as before. The zygote
relays what a template says of its forks (``Forked``, ``Exited``): the parent sees one
template.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import pickle
import time
from collections.abc import Callable
from multiprocessing import Pipe
from multiprocessing import reduction
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from typing import Any
from typing import NoReturn

import pytest

from spawnrun.child import _child
from spawnrun.child import _environ
from spawnrun.child._budget import PER_TEST_ENV
from spawnrun.child._forksafe import unsafe_state
from spawnrun.child._leave import leave
from spawnrun.proc import _fresh
from spawnrun.proc import _probe
from spawnrun.wire import _forking

#: Configured templates alive at once in a zygote (other kinds fork from the zygote).
LIMIT = 8
#: How long the zygote waits for a ready template's answer to a fork request.
ANSWER_LIMIT = 10.0
#: Variables of a test's environment that change from test to test and that no
#: conftest reads at import: a template keeps serving when only they differ. It runs
#: with the parent's own values of them; each fork takes its test's.
_PER_TEST = frozenset({"PYTEST_CURRENT_TEST", *PER_TEST_ENV})


def take_environment(request: _forking.ForkRequest) -> None:
    """The parent's environment as it was at the request, with the child's devices and
    marks: what a fork of the zygote or of a template has before any suite code runs."""
    for name in request.unset:
        os.environ.pop(name, None)
    # Only what differs: each value set is a putenv, and the fork's own copy of pages.
    environ = os.environ
    environ.update({k: v for k, v in request.env.items() if environ.get(k) != v})


def _kind(request: _forking.ForkRequest) -> bytes | None:
    """What a template must share with the test it forks for (None: none may fork it)."""
    spec = request.spec
    if not spec.run_args or not spec.nodeid or spec.coverage:
        return None
    shared = (
        spec.run_args,
        spec.plugin_args,
        {k: v for k, v in spec.option_dict.items() if k != "basetemp"},
        spec.invocation_dir,
        spec.workerinput,
        spec.late_options,
        spec.junit_family,
        spec.cuda_available,
        spec.torch_config,
        sorted((k, v) for k, v in request.env.items() if k not in _PER_TEST),
        sorted(request.unset),
        request.live,
    )
    try:
        return pickle.dumps(shared)
    except Exception:  # noqa: BLE001 - an option of the suite's own that does not pickle
        return None


class _Template:
    """The zygote's end of one configured template."""

    def __init__(self, kind: bytes, pid: int, conn: Connection) -> None:
        self.kind = kind
        self.pid = pid
        self.conn = conn
        self.pidfd = os.pidfd_open(pid)
        self.ready = False
        #: Why it does not fork ("": it may, once ready).
        self.refusal = ""
        self.retired = False
        #: Started ahead of its kind's first test (``Pool.prime``): that test waits
        #: for it once, rather than configuring pytest again beside it.
        self.primed = False


class Pool:
    """A zygote's configured templates: started on a kind's first test, used from then on."""

    def __init__(self) -> None:
        self.templates: list[_Template] = []
        #: Exit notices of tests' children, for the zygote to send on to the parent.
        self.exits: list[_forking.Exited] = []
        #: Kinds whose template refused or ended unasked: never started again.
        self.refused: set[bytes] = set()

    def watched(self) -> list[Any]:
        """What the zygote's loop waits on for the pool: templates' words and exits."""
        return [w for t in self.templates for w in (t.conn, t.pidfd)]

    def fork(
        self,
        request: _forking.ForkRequest,
        handles: list[int],
        start: Callable[[_forking.ForkRequest], tuple[int, Connection] | None],
    ) -> int | None:
        """The pid of the test's child, forked by a ready template of its kind; None:
        the zygote forks it (and a template of its kind is started, if none is)."""
        kind = _kind(request)
        if kind is None or kind in self.refused:
            return None
        template = self._serving(kind)
        if template is None:
            self._start(kind, request, start)
            return None
        if template.primed:
            self._await_ready(template)
        if not template.ready or template.refusal:
            return None
        try:
            template.conn.send(request)
            for handle in handles:
                reduction.send_handle(template.conn, handle, template.pid)
            return self._answer(template)
        except (OSError, EOFError):
            template.refusal = "it stopped answering"
            return None

    def prime(
        self,
        request: _forking.ForkRequest,
        start: Callable[[_forking.ForkRequest], tuple[int, Connection] | None],
        wait: bool,
    ) -> None:
        """Start a template of ``request``'s kind now, if none serves it (``Prime``);
        ``wait``: its kind's first test waits for it."""
        kind = _kind(request)
        if kind is not None and kind not in self.refused and self._serving(kind) is None:
            template = self._start(kind, request, start)
            if template is not None:
                template.primed = wait

    def _await_ready(self, template: _Template) -> None:
        """Wait, once, for a primed template to be configured. The test's own child
        would configure pytest just as it does, beside it: where the cores are few, the
        first tests of a run forked that way cost several times a fork of the template."""
        template.primed = False
        end = time.monotonic() + ANSWER_LIMIT
        try:
            while not template.ready and template.conn.poll(max(0.0, end - time.monotonic())):
                self._take(template, template.conn.recv())
        except (OSError, EOFError):
            template.refusal = "it ended before it was configured"

    def _serving(self, kind: bytes) -> _Template | None:
        return next((t for t in self.templates if t.kind == kind and not t.retired), None)

    def _start(
        self,
        kind: bytes,
        request: _forking.ForkRequest,
        start: Callable[[_forking.ForkRequest], tuple[int, Connection] | None],
    ) -> _Template | None:
        live = [t for t in self.templates if not t.retired]
        if len(live) >= LIMIT:
            self._retire(live[0])
        started = start(request)
        if started is None:
            return None
        template = _Template(kind, *started)
        self.templates.append(template)
        return template

    def _answer(self, template: _Template) -> int | None:
        while template.conn.poll(ANSWER_LIMIT):
            msg = template.conn.recv()
            if isinstance(msg, _forking.Forked):
                return msg.pid
            if isinstance(msg, _forking.Refused):
                template.refusal = msg.reason
                return None
            self._take(template, msg)
        template.refusal = "it did not answer a fork request"
        return None

    def on_ready(self, ready: list[Any]) -> None:
        """File what the templates among ``ready`` said, and reap those that ended."""
        for template in list(self.templates):
            ended = template.pidfd in ready
            if template.conn in ready or ended:
                try:
                    while template.conn.poll():
                        self._take(template, template.conn.recv())
                except (OSError, EOFError):
                    ended = True
            if not ended:
                continue
            self.templates.remove(template)
            if template.refusal or not template.retired:
                self.refused.add(template.kind)
            os.close(template.pidfd)
            template.conn.close()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(template.pid, 0)

    def _take(self, template: _Template, msg: Any) -> None:
        if isinstance(msg, _forking.Configured):
            template.ready = True
            template.refusal = msg.refusal
        elif isinstance(msg, _forking.Exited):
            self.exits.append(msg)

    def retire(self) -> None:
        """Every template forks no more (the zygote imported more, or its path changed)."""
        for template in self.templates:
            self._retire(template)

    def _retire(self, template: _Template) -> None:
        template.retired = True
        with contextlib.suppress(OSError):
            template.conn.send(_forking.Retire())

    def close_in_child(self) -> None:
        """In a process the zygote forked: none of the templates' ends are its own."""
        for template in self.templates:
            template.conn.close()
            os.close(template.pidfd)


def _reads_per_test() -> str:
    """Why the configuration's code may not be shared by tests ("": it may): it read a
    variable that each test has its own value of (its budget), which a spawned child's
    conftests would see as the test's."""
    read = sorted(_environ.BOOT & _PER_TEST)
    if not read:
        return ""
    return f"the conftests read {', '.join(read)} while pytest was configured"


def main(request: _forking.ForkRequest, conn: Connection, zygote: int) -> NoReturn:
    """The configured template (forked from the zygote). Never returns: it leaves when
    retired or when the zygote is gone; its forks leave at the end of their session."""
    serving = _Serving(conn)
    try:
        _probe.die_with_parent(zygote)
        # The zygote's values of a test's own variables (the parent's, as it started):
        # where a conftest reads one at import, it sees what it sees in-process.
        own = {k: v for k, v in request.env.items() if k not in _PER_TEST}
        take_environment(dataclasses.replace(request, env=own))
        _child.configured(request.spec, serving)
    except BaseException as exc:  # noqa: BLE001 - the zygote must hear why; it forks itself
        if serving.forked:
            raise
        with contextlib.suppress(OSError):
            conn.send(_forking.Configured(os.getpid(), f"configuring pytest failed: {exc!r}"))
    leave(0)


class _Serving:
    """The template's plugin: where the session would collect, it forks the tests.

    One fork is made ahead (the spare): a request is handed to it at once, and the next
    spare is forked once the answer is sent, so the parent, which waits for the answer,
    never waits for a fork.
    """

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.forked = False
        #: pidfd -> pid of each test's child still running.
        self.children: dict[int, int] = {}
        #: The fork made ahead: its pid and our end of its pipe.
        self.spare: tuple[int, Connection] | None = None

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_collection(self, session: Any) -> Any:
        # Each fork captures into files of its own (``take_over``): the template's
        # capture, which they would all share, ends here once, not in each fork.
        capture = session.config.pluginmanager.get_plugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()
        request, fd, streams = self._serve()  # returns only in a fork, for its test
        self.forked = True
        _child.take_over(session.config, request.spec, Connection(fd), os.getppid(), streams)
        return (yield)

    def _serve(self) -> tuple[_forking.ForkRequest, int, list[int]]:
        refusal = unsafe_state() or _reads_per_test()
        # What the configuration made lives as long as the template: the collector
        # neither scans it in each fork nor copies its pages by touching them.
        gc.freeze()
        self.conn.send(_forking.Configured(os.getpid(), refusal))
        retired = bool(refusal)
        while not (retired and not self.children):
            if not retired and self.spare is None:
                taken = self._fork_spare()
                if taken is not None:
                    return taken
            ready = wait([self.conn, *self.children])
            for pidfd in [r for r in ready if r in self.children]:
                pid = self.children.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                self.conn.send(_forking.Exited(pid, os.waitstatus_to_exitcode(status)))
            if self.conn not in ready:
                continue
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break  # the zygote is gone, and our forks with us
            if isinstance(msg, _forking.Retire):
                retired = True
                self._drop_spare()
            elif isinstance(msg, _forking.ForkRequest):
                self._hand_over(msg)
        self._drop_spare()
        leave(0)

    def _hand_over(self, request: _forking.ForkRequest) -> None:
        """Give the request, and its pipe ends, to the spare; it is the test's child."""
        handles = [
            _fresh.kept(reduction.recv_handle(self.conn)) for _ in range(3 if request.live else 1)
        ]
        assert self.spare is not None
        pid, pipe = self.spare
        self.spare = None
        try:
            pipe.send(request)
            for handle in handles:
                reduction.send_handle(pipe, handle, pid)
        except OSError as exc:
            self.conn.send(_forking.Refused(f"its fork is gone ({exc!r})"))
            pipe.close()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        finally:
            for handle in handles:
                os.close(handle)
        pipe.close()
        self.children[os.pidfd_open(pid)] = pid
        self.conn.send(_forking.Forked(pid))

    def _fork_spare(self) -> tuple[_forking.ForkRequest, int, list[int]] | None:
        ours, theirs = Pipe(duplex=True)
        pid = os.fork()
        if pid == 0:
            ours.close()
            self.conn.close()
            for pidfd in self.children:
                os.close(pidfd)
            try:
                request = theirs.recv()
                fd = _fresh.kept(reduction.recv_handle(theirs))
                streams = [
                    _fresh.kept(reduction.recv_handle(theirs))
                    for _ in range(2 if request.live else 0)
                ]
            except (EOFError, OSError):
                os._exit(0)  # retired before a test came
            theirs.close()
            take_environment(request)
            return request, fd, streams
        theirs.close()
        self.spare = (pid, ours)
        return None

    def _drop_spare(self) -> None:
        if self.spare is not None:
            pid, pipe = self.spare
            self.spare = None
            pipe.close()  # it leaves at once
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
