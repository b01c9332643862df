"""How a child, a fork or a template ends: the exit work that matters, not the teardown.

Runs in children only. Imports only ``_coverage`` and ``_leftovers``: the child
(``_child``) and the template (``_template``) both leave this way, so neither imports
the other for it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import weakref
from typing import NoReturn

from spawnrun.child import _leftovers
from spawnrun.proc import _coverage

#: The signal a child's threads dump their stacks on (the parent sends it before a kill).
DUMP_SIGNAL = signal.SIGUSR1


def leave(code: int) -> NoReturn:
    """End the process: the exit work that matters runs, the slow interpreter teardown not.

    After "done" nothing the test can see is left to do, but its exit work still is:
    executors shut down and non-daemon threads are joined (``threading``'s exit hook),
    ``atexit`` handlers run (multiprocessing's finalizers, which unlink semaphores and
    join child processes; coverage's save where the user's configuration started it),
    and a coverage measurement started for the child (``_coverage``) is saved. Module
    teardown and the final garbage collection are skipped (``os._exit``): with torch
    loaded they cost ~0.3 s per child.
    A child stuck here (a leaked thread that never ends) is the parent's to end, off the
    critical path. Forked children leave this way too, never through the template's code.
    """
    try:
        # threading offers no public "run the exit hooks"; this is what the interpreter
        # itself calls at shutdown, before atexit.
        threading._shutdown()  # type: ignore[attr-defined]
        # Before atexit: coverage's own exit handler closes the data files.
        _coverage.save()
        _skip_library_finalizers()
        atexit._run_exitfuncs()
        # What the test left running, once the exit work joined what it joins.
        _leftovers.end()
    except BaseException:  # noqa: BLE001 - nothing may keep the process alive
        code = code or 70
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
            pass
    os._exit(code)


def _skip_library_finalizers() -> None:
    """Leave out, at exit, the finalizers of torch's operator libraries.

    torch keeps an operator library (``torch.library.Library``) for each module that
    registers kernels, with a finalizer that unregisters them from the dispatcher at
    exit: ~40 ms per child with torch imported, for a dispatcher that ends with the
    process. Other finalizers (a ``TemporaryDirectory``'s cleanup, say) still run.
    ``weakref.finalize`` has no public registry of its live finalizers.
    """
    library = sys.modules.get("torch.library")
    drop = getattr(library, "_del_library", None)
    registry = getattr(weakref.finalize, "_registry", None)
    if drop is None or not isinstance(registry, dict):
        return
    for finalizer, info in list(registry.items()):
        if getattr(info, "func", None) is drop:
            finalizer.atexit = False
