"""Python stacks of the processes a test's child starts, on request, for its timeout.

Runs in the test's child, and (copied as ``sitecustomize.py`` into a directory the
child puts first on ``PYTHONPATH``) in every Python process started below it: spawned
ones (``multiprocessing``'s spawn and forkserver children, ``subprocess.Popen([
sys.executable, ...])``) run it at their interpreter's start, forked ones re-arm in
``os.register_at_fork``. Each registers faulthandler on ``SIGNAL`` into
``<directory>/<pid>.txt``; that file existing is what tells the parent a process can be
asked (a process without the hook is never sent the signal, whose default would kill
it). Imports the standard library only: it may run under another interpreter than the
one spawnrun is installed in, and must cost nothing measurable at start.

A process is out of reach when it is not Python, starts with ``-I``/``-S``/``-E`` or
with an environment that drops ``PYTHONPATH``, or later replaces the ``SIGUSR1``
handler with its own.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

TYPE_CHECKING = False  # typing itself would cost every process below a child its import
if TYPE_CHECKING:
    from typing import IO

#: Where the processes below a child write their stacks (set in the child's environment).
ENV = "SPAWNRUN_STACKS_DIR"
SIGNAL = signal.SIGUSR1

#: Kept open for the process's life: faulthandler writes to their descriptors.
_files: list[IO[str]] = []
_forks_armed = False


def stacks_dir(workdir: str) -> str:
    """The directory of the ``<pid>.txt`` files, in a child's work directory."""
    return os.path.join(workdir, "procs")


def arm(directory: str) -> None:
    """This process writes its threads' stacks to ``<directory>/<pid>.txt`` on SIGNAL."""
    try:
        stacks = open(os.path.join(directory, f"{os.getpid()}.txt"), "w")  # noqa: SIM115
        faulthandler.register(SIGNAL, file=stacks, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        return  # no stacks for this process; it runs as it would without spawnrun
    _files.append(stacks)
    _arm_forks(directory)


def _arm_forks(directory: str) -> None:
    global _forks_armed
    if not _forks_armed:  # inherited by forked processes, with the callback
        _forks_armed = True
        os.register_at_fork(after_in_child=lambda: arm(directory))


def install(workdir: str) -> None:
    """In a test's child: every process started below it from now on can be asked.

    Called again after the go, whose environment changes may have replaced
    ``PYTHONPATH``.
    """
    directory = stacks_dir(workdir)
    # One for the run's children, beside their work directories (copying it took each
    # fork of a template about a millisecond). A dot directory: pytest never collects
    # it (--doctest-modules over a basetemp inside the rootdir would import the hook as
    # a module otherwise).
    hook = os.path.join(os.path.dirname(workdir), ".hook")
    try:
        os.makedirs(directory, exist_ok=True)
        _place(os.path.join(hook, "sitecustomize.py"))
    except OSError:
        return
    os.environ[ENV] = directory
    path = os.environ.get("PYTHONPATH", "")
    if hook not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = hook + (os.pathsep + path if path else "")
    _arm_forks(directory)


def _place(target: str) -> None:
    """Copy this file to ``target`` unless it is there: whole or not at all, since
    children copying it at once may have processes starting meanwhile."""
    if os.path.exists(target):
        return
    import shutil
    import tempfile

    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=os.path.dirname(target), suffix=".partial")
    os.close(fd)
    try:
        shutil.copyfile(__file__, partial)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _hand_over() -> None:
    """Run the ``sitecustomize`` this file shadows (a venv's or the distribution's), if any.

    This file's directory leaves ``sys.path`` for good: the program never sees it (only
    ``PYTHONPATH`` names it, for the processes it starts in turn).
    """
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    this = sys.modules.pop("sitecustomize", None)
    try:
        __import__("sitecustomize")  # the next one on sys.path
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if this is not None:  # none: site's own import of this file completes with it
            sys.modules["sitecustomize"] = this


def _at_start() -> bool:
    """Whether site is running this file at an interpreter's start (no main code yet)."""
    main = sys.modules.get("__main__")
    return __name__ == "sitecustomize" and getattr(main, "__file__", None) is None


if _at_start():  # a process below a test's child is starting
    if os.environ.get(ENV):
        arm(os.environ[ENV])
    _hand_over()
