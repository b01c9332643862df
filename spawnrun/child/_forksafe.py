"""Whether forking this process now is safe: the template's rules, asked by any process.

Runs in a template (before it forks its file's tests) and in a child (whether its scope
may fork). Imports only ``_probe``, ``_libraries`` and ``_threadwatch``: both sides
import it, so neither imports the other.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from spawnrun.child import _threadwatch
from spawnrun.proc import _libraries
from spawnrun.proc import _probe

#: Native threads, by the name their library gives them, that a fork may leave behind:
#: their library takes its own locks in a ``pthread_atfork`` handler and runs without the
#: thread in the child. Each was checked against the library's fork handling.
FORK_AWARE = {
    # jemalloc's prefork handler takes every one of its mutexes, the background
    # thread's included, and its child handler turns background threads off in the
    # child (purging then happens inline). pyarrow's libarrow starts one as it loads
    # (``datasets`` imports pyarrow), and so does any program linked with jemalloc and
    # ``background_thread:true``.
    "jemalloc_bg_thd": "jemalloc",
}

#: Libraries whose import starts threads that a fork cannot leave behind, and the setting
#: they document under which those threads do not start: a refusal where one of them is
#: imported names it. onnxruntime (1.29 on, Linux) starts its telemetry uploader's
#: threads as its extension loads; a fork of that process has the uploader's state and
#: not its threads (a fork that exits normally aborts joining one), and the setting is
#: read once, at that load. The same load also skips them where ``CI``,
#: ``GITHUB_ACTIONS`` or ``TF_BUILD`` is set.
SETTINGS = {
    "onnxruntime": (
        "ORT_DISABLE_TELEMETRY",
        "1",
        "onnxruntime's telemetry uploader, which its import starts",
    ),
}


def unsafe_state() -> str:
    """Why forking this process now would be unsafe ("" if it is safe)."""
    if not _probe.proc_mounted():
        return _probe.NO_PROC  # what cannot be checked is not safe
    runtime = _probe.device_runtime()
    if runtime:
        return runtime
    threads = unsafe_threads()
    if threads:
        return threads_reason(threads)
    return plugin_state()


def threads_reason(threads: list[tuple[str, int]]) -> str:
    """Why these threads (name, native id) make a fork unsafe: each name, with the
    import that started it where that is known, and a library's setting that keeps its
    threads from starting where one of those libraries was imported here."""
    named = []
    for name, tid in threads:
        origin = _threadwatch.started_by(tid)
        named.append(f"{name}, started as {origin} was imported" if origin else name)
    shown = "; ".join(sorted(set(named)))
    reason = (
        f"{len(threads)} other thread(s) run in it ({shown}); a forked child would inherit "
        "the locks they hold but not them (it hangs on one)"
    )
    for package, (variable, value, what) in SETTINGS.items():
        if package in sys.modules and os.environ.get(variable) != value:
            reason += (
                f"; {what}, does not start where {variable}={value} is set (its documented "
                "setting): set it, and these templates fork"
            )
    return reason


def unsafe_threads() -> list[tuple[str, int]]:
    """This process's other threads (name, native id) that make a fork of it unsafe,
    judged one by one: a thread a fork may leave behind is not among them.

    - Libraries that handle fork themselves stop their pools when the process forks
      (OpenBLAS, which numpy loads, starts one per core at import and parks it in a
      ``pthread_atfork`` handler): a fork that does nothing lets them.
    - A native thread of a library that takes its locks around a fork and runs
      without the thread in the child (``FORK_AWARE``) stays and is harmless.
    - A Python thread waiting in ``socket.accept`` holds no lock (``_probe``).

    What is left would hang or deadlock a forked child: its locks are copied held, the
    thread is not.
    """
    threads = _probe.threads()
    if not threads:
        return []
    _quiesce()
    waiting = set(_probe.waiting_for_connections())
    return [
        (name, tid)
        for name, python, tid in _probe.threads()
        if name not in (waiting if python else FORK_AWARE)
    ]


def boot_touch() -> str:
    """What this process did to its devices so far (``_probe.boot_touch``); a plugin's
    ``pytest_spawnrun_device_state`` answer counts as an initialized driver."""
    touched = _probe.boot_touch()
    return touched or ("driver" if plugin_state() else "")


def _quiesce() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3.12+: "process is multi-threaded, use of fork()"
        pid = os.fork()
        if pid == 0:
            os._exit(0)
    os.waitpid(pid, 0)


def plugin_state() -> str:
    """Ask the ``pytest_spawnrun_device_state`` hooks of the modules imported here.

    The template has no pytest configuration, so implementations in loaded plugin or
    preloaded modules are called directly, with ``config=None``.
    """
    for module in _hooked():
        hook = module.__dict__.get("pytest_spawnrun_device_state")
        if not callable(hook):
            continue
        try:
            answer = hook(config=None)
        except Exception as exc:  # noqa: BLE001 - a broken hook: assume the worst
            return f"{module.__name__}.pytest_spawnrun_device_state raised {exc!r}"
        if answer:
            return str(answer)
    return ""


#: The imported modules that define the hook, by name, and where ``sys.modules`` stood
#: when it was last looked at: only names added since are looked at (torch alone brings
#: ~1700 modules, and in a fork every module looked at is a page copied).
_definers: dict[str, Any] = {}
_looked: _libraries.Mark = (0, None)


def _hooked() -> list[Any]:
    """The imported modules that define ``pytest_spawnrun_device_state`` (a module's
    own, not its hookspec's). A name whose module was replaced since it was looked at
    is not looked at again."""
    global _looked
    added = _libraries.added_since(_looked)
    _looked = _libraries.mark()
    for name in added:
        # vars(), not getattr(): a lazy module's __getattr__ could import things.
        module = sys.modules.get(name)
        hook = getattr(module, "__dict__", {}).get("pytest_spawnrun_device_state")
        if callable(hook) and name != "spawnrun.hookspecs":
            _definers[name] = module
    return [m for name, m in _definers.items() if sys.modules.get(name) is m]
