"""The devices a run hands out: found once, named by label, handed over as tokens.

Runs in the parent. ``inventory`` resolves ``--spawn-gpus`` and the vendor
(``--spawn-gpu-vendor``, ``_vendors``) into an ``Inventory``: ids (labels such as ``0`` or
``0:mig1``, for tags, the header, junitxml and the xdist ledger) and, for each, the
token its child's visibility variable gets, its memory where the vendor's tool reported
it, and how NVML finds it. The plugin activates the run's inventory once; children's
environments (``child_env``) and NVML lookups (``_devices``) read tokens from it.
``parse_gpus`` validates a ``--spawn-gpus`` value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import replace
from typing import Any

import pytest

from spawnrun.devices import _discovery
from spawnrun.devices import _nvml
from spawnrun.devices import _vendors

#: Why a test needing several devices cannot run on MIG instances.
MIG_ONE_PER_PROCESS = "one CUDA process sees one MIG instance only"


@dataclass(frozen=True)
class Inventory:
    """The devices this run may hand out, and how they were found (for the header).

    ``ids`` name the devices (tags, header, junitxml, the ledger); ``devices`` say, for
    each, what its child's visibility variable gets (its token), its memory where the
    vendor's tool reported it, and how NVML finds it. An id with no entry is its own
    token. ``variables`` are what a child's tokens go into, all with the same value.
    """

    ids: tuple[str, ...]
    source: str
    devices: tuple[_discovery.Device, ...] = ()
    vendor: str = "nvidia"
    variables: tuple[str, ...] = (_vendors.CUDA_VAR,)

    def device(self, label: str) -> _discovery.Device:
        for found in self.devices:
            if found.label == label:
                return found
        return _discovery.Device(label, label, nvml=label, mig=label.startswith("MIG-"))

    @property
    def mig(self) -> bool:
        return any(self.device(label).mig for label in self.ids)

    def refuses(self, count: int) -> str:
        """Why a test needing ``count`` devices can never run on them ("" if it can)."""
        if count > 1 and self.mig:
            return f"needs {count} GPUs, but the devices are MIG instances: {MIG_ONE_PER_PROCESS}"
        return ""

    def child_env(self, labels: list[str], every: bool) -> dict[str, str]:
        """What a child on ``labels`` gets; ``every``: it sees what the parent sees."""
        if labels:
            value = ",".join(self.device(label).token for label in labels)
            return {var: value for var in self.variables}
        if every:
            return {}
        return dict(_vendors.VENDORS[self.vendor].hidden)

    def visible(self, labels: list[str]) -> str:
        """``VAR=tokens`` a child on ``labels`` got, where its ids alone do not say it."""
        env = self.child_env(labels, every=False)
        if not labels or env == {_vendors.CUDA_VAR: ",".join(labels)}:
            return ""
        return " ".join(f"{var}={value}" for var, value in env.items())

    def describe(self) -> str:
        if not self.ids:
            return f"spawnrun: no GPUs ({self.source}); tests that need one are skipped"
        what = f"{self.vendor}, {self.source}"
        return f"spawnrun: {len(self.ids)} GPU(s) [{', '.join(self.ids)}] ({what})"


#: The junitxml property with what a child's visibility variables got (``Inventory.visible``).
VISIBLE_PROPERTY = "spawnrun_visible"
#: The run's inventory in this process, set once by the plugin (one pytest run per
#: process, as NVML's state is): NVML lookups, children's environments and their reports
#: read devices' tokens from it. None: each id is its own token in CUDA_VISIBLE_DEVICES.
_active: Inventory | None = None


_NONE = Inventory((), "no inventory")


def activate(inventory: Inventory | None) -> None:
    global _active
    _active = inventory


def active() -> Inventory:
    """The run's inventory; before (or without) one, each id is its own CUDA token."""
    return _active or _NONE


def child_env(devices: list[str], every: bool) -> dict[str, str]:
    """The visibility variables of a child on ``devices`` (``Inventory.child_env``)."""
    return active().child_env(devices, every)


def visible(devices: list[str]) -> str:
    return active().visible(devices)


def discover(environ: Mapping[str, str], vendor: str = "auto") -> Inventory:
    """The chosen vendor's outer visibility variable, else NVML (NVIDIA), else its tool.

    ``vendor`` auto picks one (``_vendors.choose``). An outer variable's ids are handed
    on as written, a subset to each child, so they mean what they meant to the user;
    devices found by NVML or a tool are handed out as tokens that name exactly them.
    """
    nvml = _nvml.load_nvml() if vendor in ("auto", "nvidia") else None
    chosen = _vendors.choose(vendor, environ, nvml is not None)
    mask = _vendors.outer_mask(chosen, environ)
    if mask is not None:
        variable, ids = mask
        carriers = _vendors.carriers(chosen, variable, environ)
        devices = tuple(_given(chosen, token, environ, nvml) for token in ids)
        gets = f"; each child gets a subset of it{_into(carriers, variable)}"
        return Inventory(tuple(ids), f"from {variable}{gets}", devices, chosen.name, carriers)
    found: tuple[list[_discovery.Device], str] | None = None
    if chosen is _vendors.NVIDIA and nvml is not None:
        with contextlib.suppress(Exception):
            found = _nvml.from_nvml(nvml)
    if found is None:
        found = chosen.find(_discovery.run_tool)
    if found is not None and not found[0]:
        return Inventory((), f"{chosen.name}, {found[1]}: no devices listed", vendor=chosen.name)
    if found is not None:
        listed, source = found
        kind = "UUID" if all(d.token[:4] in ("GPU-", "MIG-") for d in listed) else "index"
        gets = f"; each child gets {chosen.own}=<its {kind}>"
        if any(d.mig for d in listed):
            gets += ", one MIG instance per test"
        labels = tuple(d.label for d in listed)
        return Inventory(labels, source + gets, tuple(listed), chosen.name, (chosen.own,))
    variables = ", ".join(chosen.masks)
    tools = ", ".join(("NVML", *chosen.tools) if chosen is _vendors.NVIDIA else chosen.tools)
    return Inventory((), f"none found: no {variables}, {tools}", vendor=chosen.name)


def _into(carriers: tuple[str, ...], variable: str) -> str:
    return "" if carriers == (variable,) else f" in {' and '.join(carriers)}"


def _given(
    vendor: _vendors.Vendor, token: str, environ: Mapping[str, str], nvml: Any
) -> _discovery.Device:
    """An id the user gave (an outer mask, or --spawn-gpus), handed on as written."""
    name = _nvml.nvml_index(token, environ, nvml) if vendor is _vendors.NVIDIA else None
    return _discovery.Device(token, token, nvml=name, mig=token.startswith("MIG-"))


def inventory(setting: str, environ: Mapping[str, str], vendor: str = "auto") -> Inventory:
    if setting == "auto":
        return discover(environ, vendor)
    if setting == "none":
        return Inventory((), "--spawn-gpus none")
    if setting.isdigit():
        found = discover(environ, vendor)
        n = int(setting)
        if len(found.ids) >= n:
            return replace(
                found,
                ids=found.ids[:n],
                devices=found.devices[:n],
                source=f"first {n} {found.source}",
            )
        if found.ids:
            # Some devices are visible, fewer than asked: never hand out others.
            raise pytest.UsageError(
                f"--spawn-gpus {n}: only {len(found.ids)} GPU(s) visible "
                f"({', '.join(found.ids)}, {found.source})"
            )
        return _declared(tuple(str(i) for i in range(n)), f"--spawn-gpus {n}", environ, vendor)
    ids = tuple(t for t in setting.split(",") if t)  # "0,": device 0 alone
    return _declared(ids, "declared with --spawn-gpus", environ, vendor)


def _declared(
    ids: tuple[str, ...], source: str, environ: Mapping[str, str], vendor: str
) -> Inventory:
    """Ids trusted as given: each is its own token, in the vendor's innermost variable."""
    nvml = _nvml.load_nvml() if vendor in ("auto", "nvidia") else None
    chosen = _vendors.choose(vendor, environ, nvml is not None)
    mask = _vendors.outer_mask(chosen, environ)
    carriers = _vendors.carriers(chosen, mask[0], environ) if mask else (chosen.own,)
    source += ", trusted as given"
    if carriers != (_vendors.CUDA_VAR,):
        source += f"; each child gets {' and '.join(carriers)}"
    devices = tuple(_given(chosen, token, environ, nvml) for token in ids)
    return Inventory(ids, source, devices, chosen.name, carriers)


def parse_gpus(value: object, source: str) -> str:
    """Validate a ``--spawn-gpus`` value: auto, none, a count, or a comma list of device ids.

    An id is an index (``0``) or a UUID as ``CUDA_VISIBLE_DEVICES`` takes it
    (``GPU-...``, ``MIG-...``); each may appear once. A bare number is a count; a list may
    end with a comma, which is how one index alone is written (``0,``: device 0).
    The value is kept in that form: a single index keeps its comma.
    """
    text = str(value).strip()
    if text.lower() in ("auto", "none") or text.isdigit():
        return text.lower()
    listed = text[:-1] if text.endswith(",") else text
    ids = [t.strip() for t in listed.split(",")]
    bad = [t for t in ids if not _is_device_id(t)]
    if not listed or bad:
        shown = ", ".join(repr(t) for t in bad) if listed else "nothing"
        raise pytest.UsageError(
            f"{source}: expected auto, none, a count or a comma-separated list of "
            f"device ids (indices such as 0,1 or GPU-/MIG- UUIDs; one index alone: 0,), "
            f"got {value!r} ({shown} is no device id)"
        )
    repeated = sorted({t for t in ids if ids.count(t) > 1})
    if repeated:
        raise pytest.UsageError(
            f"{source}: device {', '.join(repeated)} is listed more than once in {value!r}; "
            "each device is handed to one test at a time"
        )
    joined = ",".join(ids)
    return joined + "," if joined.isdigit() else joined


def _is_device_id(text: str) -> bool:
    if text.isdigit():
        return True
    prefix, _, rest = text.partition("-")
    return prefix in ("GPU", "MIG") and bool(rest) and not any(c.isspace() for c in rest)
