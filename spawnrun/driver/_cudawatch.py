"""Notice when the parent process itself initialized CUDA, and say who did it.

Runs in the parent. Never imports torch: it only looks at ``sys.modules``. If torch is
already imported, ``torch.cuda._lazy_init`` is wrapped to remember the first caller
outside torch that initialized CUDA. Spawned tests still run isolated either way (they
start fresh interpreters); the warning is there because that context costs device
memory for the whole run and breaks any fork-based tool.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import pytest

from spawnrun.proc import _probe
from spawnrun.wire import _reports

_WRAPPED = "__spawnrun_wrapped__"
_origin: list[tuple[str, int, str]] = []
_warned = False

MESSAGE = "spawnrun: CUDA was initialized in the pytest parent process"


def watch() -> None:
    """Wrap torch's lazy CUDA init if torch is imported and CUDA not yet initialized."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or getattr(cuda._lazy_init, _WRAPPED, False):
        return
    original = cuda._lazy_init
    torch_dir = os.path.dirname(getattr(torch, "__file__", "") or "") + os.sep

    def lazy_init(*args: Any, **kwargs: Any) -> Any:
        if not _origin and not cuda.is_initialized():
            frames = [
                f
                for f in traceback.extract_stack()[:-1]
                if not f.filename.startswith(torch_dir) and __file__ != f.filename
            ]
            if frames:
                f = frames[-1]
                _origin.append((f.filename, f.lineno or 0, f.name))
        return original(*args, **kwargs)

    setattr(lazy_init, _WRAPPED, True)
    cuda._lazy_init = lazy_init


def check(config: pytest.Config) -> None:
    """Warn once if CUDA is initialized in this process."""
    global _warned
    if _warned:
        return
    # A context: torch's own flag, or one the driver holds. Not cuInit alone (kornia's
    # and timm's collection ask torch.cuda.is_available()): no context, no device
    # memory, and spawnrun never forks this process.
    if _probe.boot_touch() != "context":
        return
    runtime = _probe.device_runtime()
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    _warned = True
    filename, lineno = "", 0  # unknown: the warning points at spawnrun's own code
    if _origin:
        filename, lineno, func = _origin[0]
        where = f"{filename}:{lineno} in {func}"
    else:
        where = "code that ran before spawnrun could watch (a conftest or plugin import)"
    held = _reserved_mib(cuda) if cuda is not None else "an unknown amount"
    text = (
        f"{MESSAGE}, by {where}; it holds {held} of device memory plus its context "
        "(typically 500 MiB or more) for the whole run. Spawned tests still run "
        "isolated; move the CUDA call into a test or fixture to free that memory. "
        f"(Seen: {runtime}.)"
    )
    _reports.record_warning(config, _reports.warning(text, filename, lineno), "")


def _reserved_mib(cuda: Any) -> str:
    try:
        total = sum(cuda.memory_reserved(i) for i in range(cuda.device_count()))
    except Exception:  # noqa: BLE001
        return "an unknown amount"
    return f"{total / 2**20:.0f} MiB"
