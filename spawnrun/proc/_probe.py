"""Questions a process asks about itself (is a device runtime up, which threads run),
and the one thing every child arranges for itself (to die with its parent).

Runs in the parent, in children (test children and ``spawnrun.call``'s) and in the
zygote's template. Imports nothing from spawnrun and never imports torch or loads a
driver: it only looks at what is already loaded (``sys.modules``, the dynamic loader's
libraries, ``/proc/self/task``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from spawnrun.proc import _fresh

#: prctl's option: the signal this process gets when its parent ends (Linux).
_PR_SET_PDEATHSIG = 1
#: cuDeviceGetCount's answer before cuInit: the driver is loaded but not initialized.
_CUDA_ERROR_NOT_INITIALIZED = 3


#: Why nothing here can be asked when ``/proc`` is not mounted (a bare container).
NO_PROC = (
    "/proc is not mounted, so neither the threads of a process nor whether the CUDA driver "
    "is initialized in it can be seen"
)


def proc_mounted() -> bool:
    """Whether this process sees ``/proc`` (threads, mappings, other processes)."""
    return os.path.exists("/proc/self/stat")


def device_runtime() -> str:
    """Name a device runtime initialized in this process ("" if none).

    torch's own state first (initialized, or poisoned by a fork), then the CUDA driver
    itself: ``torch.cuda.is_available()`` and ``device_count()`` run ``cuInit`` without
    making torch "initialized", and so does any library that talks to the driver.
    """
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None:
        with contextlib.suppress(Exception):
            if cuda.is_initialized():
                return "torch.cuda is initialized"
        with contextlib.suppress(Exception):
            if cuda._is_in_bad_fork():
                return "torch.cuda is in a bad-fork state"
    if cuda_driver_initialized():
        return "the CUDA driver is initialized (cuInit was called)"
    return ""


def _torch_cuda() -> Any:
    """``torch.cuda`` if this process imported torch and initialized CUDA, else None.

    Never imports torch or initializes anything.
    """
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        return cuda if cuda is not None and cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a torch that cannot tell is not in use here
        return None


def _each_device(name: str) -> list[Any] | None:
    """``torch.cuda.<name>(i)`` for each device of this process (None: no CUDA in use)."""
    cuda = _torch_cuda()
    if cuda is None:
        return None
    try:
        return [getattr(cuda, name)(i) for i in range(cuda.device_count())]
    except Exception:  # noqa: BLE001 - a figure is never worth a failure
        return None


def reserved_peaks() -> list[int] | None:
    """torch's peak reserved memory on each device of this process, in bytes.

    None where no CUDA is in use: asked of torch only if the process already imported it
    and initialized CUDA. The figures are torch's caching allocator's (reserved memory),
    without the CUDA context.
    """
    peaks = _each_device("max_memory_reserved")
    return None if peaks is None else [int(p) for p in peaks]


def jax_peak() -> int | None:
    """JAX's own peak on the fullest accelerator of this process (``peak_bytes_in_use``
    of its device memory statistics), in bytes: what its arrays needed, where NVML
    counts the whole pool it preallocated (75% of the device by default).

    None where JAX has started no accelerator backend in this process: asked only of
    backends already started (``xla_bridge``'s), never starting one.
    """
    bridge = sys.modules.get("jax._src.xla_bridge")
    backends = getattr(bridge, "_backends", None)
    if not isinstance(backends, dict) or not backends:
        return None
    peaks: list[int] = []
    for backend in list(backends.values()):
        try:
            if getattr(backend, "platform", "cpu") == "cpu":
                continue
            for device in backend.local_devices():
                stats = device.memory_stats() or {}
                peak = stats.get("peak_bytes_in_use")
                if isinstance(peak, int) and not isinstance(peak, bool) and peak >= 0:
                    peaks.append(peak)
        except Exception:  # noqa: BLE001 - a figure is never worth a failure
            continue
    return max(peaks) if peaks else None


def allocated() -> int | None:
    """What torch has allocated on all this process's devices now (None: no CUDA)."""
    sizes = _each_device("memory_allocated")
    return None if sizes is None else sum(int(s) for s in sizes)


def reset_peaks() -> None:
    """Start torch's peak figures afresh (the next test of a scope's child)."""
    _each_device("reset_peak_memory_stats")


def release_devices() -> None:
    """Free this process's CUDA contexts now, before its session ends and it exits.

    Once the test is over nothing in the process needs the device: torch's cached
    memory is returned, then every primary context the driver holds for the process is
    reset, so the driver stops listing the process on its devices (the parent's proof
    that the device is free). Only done where CUDA is already initialized; never
    loads or initializes a driver. What the session's end might still do with CUDA
    fails there, after the test's reports.
    """
    cuda = _torch_cuda()
    if cuda is not None:
        with contextlib.suppress(Exception):
            cuda.synchronize()
            cuda.empty_cache()
    for lib in _mapped_cuda():
        with contextlib.suppress(Exception):
            _reset_primary_contexts(lib)


#: The CUDA driver's soname (what every driver install names it, whatever its path).
_CUDA_DRIVER = "libcuda.so.1"


def _mapped_cuda() -> list[ctypes.CDLL]:
    """The CUDA driver library if this process already loaded it (never loads it).

    Asked of the dynamic loader by the driver's soname with ``RTLD_NOLOAD``, which
    matches a library loaded under any path: ~0.05 ms, where reading
    ``/proc/self/maps`` cost ~0.5 ms with torch loaded (three reads per child).
    """
    try:
        return [ctypes.CDLL(_CUDA_DRIVER, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)]
    except OSError:
        return []


def _primary_contexts(lib: ctypes.CDLL) -> Iterator[tuple[ctypes.c_int, bool | None]]:
    """Each device the driver lists, and whether its primary context is active (None:
    the driver would not say). Nothing if the driver is not initialized."""
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return  # not initialized (or broken): no context
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        if lib.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
            yield device, None
            continue
        flags, active = ctypes.c_uint(0), ctypes.c_int(0)
        if lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)):
            yield device, None
            continue
        yield device, bool(active.value)


def _reset_primary_contexts(lib: ctypes.CDLL) -> None:
    reset = getattr(lib, "cuDevicePrimaryCtxReset_v2", None) or lib.cuDevicePrimaryCtxReset
    for device, active in _primary_contexts(lib):
        if active:
            reset(device)


def boot_touch() -> str:
    """What this process did to its devices so far: "context" (device memory: torch's
    CUDA initialized, or a primary context active), "driver" (``cuInit`` ran, as
    ``torch.cuda.is_available()`` does, but nothing holds memory) or ""."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    if cuda is not None:
        with contextlib.suppress(Exception):
            if cuda.is_initialized() or cuda._is_in_bad_fork():
                return "context"
    if not cuda_driver_initialized():
        return ""
    for lib in _mapped_cuda():
        try:
            # A context, or a device the driver would not say of: assume the worst.
            if any(active is not False for _, active in _primary_contexts(lib)):
                return "context"
        except (OSError, AttributeError):
            return "context"  # mapped but cannot be asked: assume the worst
    return "driver"


def cuda_driver_initialized() -> bool:
    """Whether cuInit ran in this process, asked of the driver without initializing it.

    ``import torch`` (CUDA builds) maps libcuda.so without initializing it; forking then
    is safe, forking after cuInit is not. cuDeviceGetCount answers
    CUDA_ERROR_NOT_INITIALIZED until cuInit has run and has no side effect. The library
    is only looked up if it is already mapped (RTLD_NOLOAD): this never loads it.
    """
    for lib in _mapped_cuda():
        try:
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED:
                return True
        except AttributeError:
            return True  # loaded but cannot be asked: assume the worst
    return False


def threads() -> list[tuple[str, bool, int]]:
    """This process's threads other than the calling one (Linux /proc): each one's name,
    whether it is a Python ``threading`` thread (named as Python names it) or a native
    one (named as its library named it, ``/proc/self/task/*/comm``), and its native id.

    Counted from the kernel's view, so threads started by C libraries (OpenMP, MKL,
    CUDA) count too, not only Python's ``threading`` ones.
    """
    import threading

    me = threading.get_native_id()
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    found = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            if int(tid) == me:
                continue
            if int(tid) in python_names:
                found.append((python_names[int(tid)], True, int(tid)))
                continue
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    found.append((f.read().strip() or tid, False, int(tid)))
            except OSError:
                continue  # it just ended
    return found


def waiting_for_connections() -> list[str]:
    """Names of this process's Python threads that wait in ``socket.accept``.

    Such a thread holds no lock while it waits (pytest-rerunfailures starts one in
    every pytest process where xdist is installed, to serve its workers): a fork
    loses the thread and keeps a copy of its socket, and nothing in the fork waits on
    it.
    """
    import threading

    frames = sys._current_frames()
    names = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        code = frame.f_code if frame is not None else None
        if code is not None and code.co_name == "accept" and code.co_filename.endswith("socket.py"):
            names.append(thread.name)
    return names


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once: a template's forks use its handle (each load makes
    a class of its own, ~0.3 ms and dozens of copied pages in every fork)."""
    return ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent: int | None = None) -> None:
    """Be killed when the parent ends, even by SIGKILL (a CI runner's hard stop).

    Otherwise a hung child would be reparented to init and hold its GPU forever, its
    timeout gone with the parent. Processes the child started are out of this reach.

    ``parent`` is the pid of the process that started this one; by default the
    multiprocessing parent (a spawn child knows it from its start), else the parent it
    has now. A parent that ended before the request took effect shows as another parent
    (init or a subreaper took this process over). Pid 1 is no sign of that: pytest is
    pid 1 itself as a container's first process (``docker run image pytest``).
    """
    if parent is None:
        parent = _fresh.spawned_by()
    if parent is None:
        parent = os.getppid()
    try:
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: the parent's own cleanup is all there is
    if os.getppid() != parent:
        os._exit(70)  # the parent ended before the request took effect
