"""``torch.cuda.is_available()`` while a child collects, without initializing the driver.

A conftest or test module that asks ``torch.cuda.is_available()`` at import (kornia's
conftest, timm's ``skipif`` decorators) runs ``cuInit``: no context, no memory, but a
process that did it cannot be forked for its tests (a fork's CUDA fails), so every test
of such a file collected it in a child of its own. torch's own fork-safe check
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``) asks NVML instead, which starts a thread of the
driver's in the process (seen on the H200, run 37): no more forkable either.

The parent knows the answer: where its own collection asked (torch imported, the
driver already initialized there, so asking again costs nothing), ``in_parent`` says
whether CUDA was available. A child forked from the library template (torch already
imported) then answers ``torch.cuda.is_available()`` itself while it configures pytest
and collects (``while_collecting``): the parent's finding, for the devices the child
sees (``CUDA_VISIBLE_DEVICES``: none, hidden, or at least one, which is CUDA's answer on
a machine where CUDA works). The original is back before anything else runs: the
test, and every process forked from a template, ask CUDA itself. Where the parent found
no CUDA, or never asked, nothing changes.

``torch.__config__.show()`` too: torch's build configuration, which asks CUDA whether it
has a device (``at::show_config`` calls ``c10::cuda::device_count``, so ``cuInit``). PyG
reads it as ``torch_geometric.typing`` is imported (``'USE_MKL=OFF' in ...show()``), so
every configured template of PyG's suite was refused and each test configured pytest
itself (H100, run 76). Where the parent's collection had initialized the driver, the
parent asks it once (``config_in_parent``: nothing more is initialized), and a child
answers with that text while it collects, where it sees a device as the parent did
(the text's CUDA part is there exactly when CUDA has a device); else torch's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from spawnrun.proc import _probe

_parent: bool | None = None
_config: list[str | None] = []


def in_parent() -> bool:
    """Whether the parent's collection asked torch and CUDA was available (False: not
    known yet, or not). Never initializes the driver: asked only once it is."""
    global _parent
    if _parent is not None:
        return _parent
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not getattr(getattr(torch, "version", None), "cuda", None):
        return False  # no torch yet (it may come), or a build without CUDA
    if _probe.boot_touch() == "":
        return False  # nobody asked yet: asking now would initialize the driver
    try:
        _parent = bool(cuda.is_available())
    except Exception:  # noqa: BLE001 - an answer we cannot get is no answer
        _parent = False
    return _parent


def known() -> bool:
    """Whether the parent's finding is known: its collection asked (CUDA available or
    not), or its torch is a build without CUDA."""
    if in_parent() or _parent is not None:
        return True
    torch = sys.modules.get("torch")
    return torch is not None and not getattr(getattr(torch, "version", None), "cuda", None)


def config_in_parent() -> str | None:
    """``torch.__config__.show()`` as the parent's torch says it, where the parent found
    CUDA available (its driver is then initialized: asking costs nothing more); None
    where not known. Asked once."""
    if _config:
        return _config[0]
    if not in_parent():
        return None  # nothing to say: (not yet) initialized here
    text: str | None = None
    try:
        import torch.__config__  # noqa: PLC0415 - the parent's collection imported it

        text = str(torch.__config__.show())
    except Exception:  # noqa: BLE001 - an answer we cannot get is no answer
        text = None
    _config.append(text)
    return text


def while_collecting(parent_found: bool, config: str | None = None) -> Callable[[], None]:
    """Answer ``torch.cuda.is_available()`` from the parent's finding, and
    ``torch.__config__.show()`` with ``config``, until the result is called (then
    torch's own again)."""
    torch: Any = sys.modules.get("torch")
    if not parent_found:
        return lambda: None

    def seen() -> bool:
        return sees_a_device(os.environ.get("CUDA_VISIBLE_DEVICES"))

    undo = [
        _answering(getattr(torch, "cuda", None), "is_available", seen),
        # The parent's text is this process's where it sees a device, as the parent did.
        _answering(getattr(torch, "__config__", None), "show", lambda: config if seen() else None)
        if config is not None
        else (lambda: None),
    ]

    def restore() -> None:
        for step in undo:
            step()

    return restore


def _answering(owner: Any, name: str, answer: Callable[[], Any]) -> Callable[[], None]:
    """``owner.name()`` answered by ``answer()`` (None: by the original) until the
    result is called; the original after, also where held by name (``from torch.cuda
    import is_available``)."""
    original = getattr(owner, name, None)
    if original is None:
        return lambda: None
    collecting = [True]

    def answered(*args: Any, **kwargs: Any) -> Any:
        if collecting[0]:
            value = answer()
            if value is not None:
                return value
        return original(*args, **kwargs)

    answered.__doc__ = original.__doc__
    setattr(owner, name, answered)

    def restore() -> None:
        collecting[0] = False
        if getattr(owner, name, None) is answered:
            setattr(owner, name, original)

    return restore


def sees_a_device(visible: str | None) -> bool:
    """Whether CUDA lists a device for this ``CUDA_VISIBLE_DEVICES``, on a machine
    where it lists some: unset, or a first entry that is an index or a UUID (CUDA stops
    at the first entry it cannot read: "", "-1" and "none" hide every device)."""
    if visible is None:
        return True
    first = visible.split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return True
    return first.isdigit()


class WhileImporting:
    """The library template (the zygote) answers ``torch.cuda.is_available()`` and
    ``torch.__config__.show()`` from the parent's finding while it imports what the
    parent's collection imported, as a child does while it collects.

    torch's own inductor asks at import (``torch._inductor.runtime.benchmarking``, torch
    2.11): with CUDA's real answer the template initialized the driver, and the whole
    torch package was left out of it, so every test of kornia's suite configured pytest
    importing torch itself (7 s boots on an H200). The answer is the one for the devices
    the template sees, fixed before it imports (reading the mask then is no module's
    read). A test whose devices would answer otherwise (it sees none) is not forked from
    the template (``differs``): a spawned child imports those modules itself.
    """

    def __init__(self, parent_found: bool, config: str | None) -> None:
        self.parent_found = parent_found
        self.config = config
        self.sees = sees_a_device(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.undo: list[Callable[[], None]] = []

    def ensure(self) -> None:
        """Answer from now on: at once where torch is imported, else as its import ends
        (a library that imports torch and asks at once)."""
        if self.undo or not self.parent_found:
            return
        torch: Any = sys.modules.get("torch")
        if torch is None:
            from spawnrun.child import _streams  # noqa: PLC0415 - armed in the template

            self.undo = [_streams.also_after("torch", self._answer)]
            return
        self._answer(torch)

    def _answer(self, torch: Any) -> None:
        def available() -> bool:
            global template_answer
            template_answer = self.sees
            return self.sees

        def shown() -> str | None:
            global template_answer
            if self.config is not None and self.sees:
                template_answer = self.sees
                return self.config
            return None

        self.undo += [
            _answering(getattr(torch, "cuda", None), "is_available", available),
            _answering(getattr(torch, "__config__", None), "show", shown),
        ]

    def restore(self) -> None:
        for step in self.undo:
            step()
        self.undo = []


#: What the library template answered while it imported, where one of its imports
#: asked (None: none asked): a fork whose devices answer otherwise is declined.
template_answer: bool | None = None


def differs(visible: str | None, parent_found: bool) -> str:
    """Why a fork with this ``CUDA_VISIBLE_DEVICES`` may not come from the library
    template, the parent having found CUDA available or not ("" where it may)."""
    if template_answer is None:
        return ""
    if parent_found and sees_a_device(visible) == template_answer:
        return ""
    if not parent_found and not template_answer:
        return ""
    said = "available" if template_answer else "not available"
    return (
        f"a module imported in the template asked torch.cuda.is_available() there and was "
        f"answered {said}; for this test ({_shown(visible)}, CUDA "
        f"{'found' if parent_found else 'not found'} by the parent) it answers otherwise"
    )


def _shown(visible: str | None) -> str:
    return "CUDA_VISIBLE_DEVICES unset" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
