"""Which tests may share a device: memory budgets, a per-device cap, and nothing else.

Runs in the parent; pure (no processes, no NVML, no files): the scheduler asks, the
allocators (``_devices``) keep the claims. Policy, in full:

* A test's **need** on each of its devices is either a budget in bytes (it may share
  the device) or ``ALONE`` (it runs with nobody else on the device).
* A device takes a claim with a budget when nobody holds it alone, fewer than
  ``per_gpu`` tests hold it, and the budgets already on it, the new one and a
  ``reserve`` per process (its CUDA context, which no allocator cap limits) fit its
  capacity. Where the capacity is unknown, a budget runs alone.
* Where the run can read the device's free memory (NVML), that must cover the new
  budget and its reserve too: other processes use GPUs as well.
* A claim with ``ALONE`` takes a device nobody holds.
* Devices for a test are chosen least loaded first (fewest claims, then least budget
  held, then inventory order), so tests spread over GPUs before they pile onto one.

Budgets a run learned (``--spawn-pack auto``) go through ``learned_need``: a measured
peak plus a margin, and alone when that is a large share of the device (a vLLM engine
sizes its cache from free memory: it must never have neighbours).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

import pytest

#: A need that shares nothing.
ALONE = None
#: What a process's CUDA context (and cuBLAS's workspace) takes on a device beside what
#: its allocator holds: measured on the H200 at 0.52-0.62 GiB per process after a first
#: matmul (docs/validation/gpu-validation.md); rounded up.
RESERVE = 1 << 30
#: Learned budgets: the measured peak times this, plus ``LEARNED_MARGIN``.
LEARNED_FACTOR = 1.25
LEARNED_MARGIN = 256 << 20
#: A learned budget (with its reserve) above this share of the device runs alone.
ALONE_SHARE = 0.25
#: Where the budget of a test spawned by ``--spawn-gpu`` alone, with no peak recorded
#: yet, comes from (``first_run_need``).
FIRST_RUN_SOURCE = "first run: a share of the device, no peak recorded yet"
#: The smallest such share: below it, the test runs alone.
FIRST_RUN_LEAST = 1 << 30

_UNITS = {
    "": 2**30,  # a bare number is GiB
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value: object, source: str) -> int:
    """A memory size: a string with a binary or decimal unit ("6GiB", "500MB"), or GiB."""
    if isinstance(value, bool):
        raise pytest.UsageError(f"{source}: expected a memory size such as 6GiB, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        number, unit = math.nan, "?"
    if unit not in _UNITS or math.isnan(number) or math.isinf(number) or number <= 0:
        raise pytest.UsageError(
            f"{source}: expected a memory size > 0 such as 6GiB, 500MB or a number of GiB, "
            f"got {value!r}"
        )
    return math.ceil(number * _UNITS[unit])


def show(size: int | None) -> str:
    """A size as people read it: GiB from 1 GiB on, else MiB."""
    if size is None:
        return "unknown"
    if size >= 2**30:
        return f"{size / 2**30:.1f} GiB"
    return f"{size / 2**20:.0f} MiB"


def learned_need(peak: int, capacity: int | None) -> tuple[int | None, str]:
    """The budget a measured peak earns, or ALONE with the reason."""
    budget = math.ceil(peak * LEARNED_FACTOR) + LEARNED_MARGIN
    budget = -(-budget // 2**20) * 2**20  # whole MiB
    if capacity is None:
        return ALONE, "the device's memory is unknown"
    if budget + RESERVE > ALONE_SHARE * capacity:
        return ALONE, f"its peak ({show(peak)}) is a large share of the device"
    return budget, ""


def first_run_need(capacity: int | None, per_gpu: int) -> int | None:
    """The budget a test spawned by ``--spawn-gpu`` alone, with no peak recorded yet,
    shares its devices under (``auto``): an equal share of the device among ``per_gpu``
    tests, each less its context's reserve; ALONE where the device's memory is unknown
    or the share would be under ``FIRST_RUN_LEAST``.

    A guess, like a learned budget: torch is capped there in the child, and a test that
    fails (or is skipped after it used a device) on it, or beside it, or whose process
    tree held more, runs again alone, whose outcome counts."""
    if capacity is None or per_gpu < 2:
        return ALONE
    share = capacity // per_gpu - RESERVE
    share = share // 2**20 * 2**20  # whole MiB
    return share if share >= FIRST_RUN_LEAST else ALONE


@dataclass
class Claim:
    """One test's hold on one device."""

    token: str
    need: int | None


@dataclass
class Pool:
    """The claims on every device of the run, and the rules for taking more."""

    ids: tuple[str, ...]
    capacity: Mapping[str, int | None]
    per_gpu: int
    reserve: int = RESERVE
    claims: dict[str, list[Claim]] = field(default_factory=dict)

    def held(self, device: str) -> list[Claim]:
        return self.claims.setdefault(device, [])

    def idle(self) -> list[str]:
        """Devices nobody holds, in inventory order."""
        return [d for d in self.ids if not self.held(d)]

    def fits(self, device: str, need: int | None, free: int | None = None) -> bool:
        claims = self.held(device)
        if need is ALONE:
            return not claims
        if any(c.need is ALONE for c in claims) or len(claims) >= self.per_gpu:
            return False
        capacity = self.capacity.get(device)
        if capacity is None:
            return not claims  # nothing to pack against: a budget runs alone
        if not claims:
            return need <= capacity  # alone on it, as an unbudgeted test would be
        held = sum((c.need or 0) + self.reserve for c in claims)
        if held + need + self.reserve > capacity:
            return False
        return free is None or free >= need + self.reserve

    def choose(
        self,
        count: int,
        need: int | None,
        free: Callable[[str], int | None] = lambda d: None,
        among: Sequence[str] | None = None,
    ) -> list[str] | None:
        """``count`` devices that take ``need`` now, least loaded first; None if too few."""
        order = {d: i for i, d in enumerate(self.ids)}
        candidates = self.ids if among is None else among
        fitting = [d for d in candidates if self.fits(d, need, free(d))]
        if len(fitting) < count:
            return None
        fitting.sort(key=lambda d: (len(self.held(d)), self._budget_held(d), order[d]))
        return sorted(fitting[:count], key=order.__getitem__)

    def _budget_held(self, device: str) -> int:
        return sum((c.need or 0) + self.reserve for c in self.held(device))

    def take(self, devices: Sequence[str], need: int | None, token: str) -> None:
        for device in devices:
            self.held(device).append(Claim(token, need))

    def give_back(self, devices: Sequence[str], token: str) -> None:
        for device in devices:
            claims = self.held(device)
            self.claims[device] = [c for c in claims if c.token != token]


def default_per_gpu(cpus: int, gpus: int) -> int:
    """Tests at once on one device: the cores per GPU, 2 to 8.

    Each child needs a core to boot and to launch its kernels; more children than cores
    per GPU only queue on the CPU. Above eight, creating CUDA contexts at once contends
    (1.75 s each with 16 processes on one H200 against 0.24 s alone).
    """
    return max(2, min(8, cpus // max(1, gpus)))


def cpu_slots(load: float | None, cpus: int, jobs: int) -> int:
    """The job slots a test takes: those of the cores it kept busy on average when an
    earlier run measured it (``load``), each slot standing for ``cpus / jobs`` cores; one
    where nothing was measured or nothing is known of the cores, all of them at most."""
    if load is None or cpus <= 0 or jobs <= 1:
        return 1
    return max(1, min(jobs, math.ceil(load * jobs / cpus - 0.05)))


#: A ``Plan.scope`` of tests forked one by one from a template that collected their file.
TEMPLATE_SCOPE = "template "


def is_template(scope: str) -> bool:
    """Whether ``scope`` is a template's, whose tests are forked from it one by one."""
    return scope.startswith(TEMPLATE_SCOPE)


def shared_scope(scope: str) -> str:
    """The scope whose child runs a test's setup, call and teardown among others' ("": a
    process of its own: none, or a file's template, which forks one for each test)."""
    return "" if is_template(scope) else scope


@dataclass(frozen=True)
class Plan:
    """What a spawned test needs, decided once at collection (kept in ``item.stash``)."""

    timeout: float | None
    #: Devices it gets (``CUDA_VISIBLE_DEVICES`` set to exactly them).
    count: int
    #: Its need on each device it holds: a budget in bytes, or ALONE.
    need: int | None = ALONE
    #: Why it runs alone ("" when it has a budget): for the run summary.
    alone_because: str = ""
    #: Spawned by --spawn-gpu without the marker: it sees (and holds) every device.
    every: bool = False
    #: Where its budget came from ("memory='2GiB'", "learned: peak 1.2 GiB").
    budget_source: str = ""
    #: Its need is what earlier runs measured (``--spawn-pack auto``), not declared.
    learned: bool = False
    #: The scope whose tests share one child ("module test_x.py", "group llm"; "": a
    #: child of its own), or the template their forks come from (``TEMPLATE_SCOPE``).
    scope: str = ""
    #: Why it is spawned fresh, never forked ("": fast mode may fork it): its outcome
    #: in a fork was in doubt, this run or an earlier one.
    unforked: str = ""
    #: The failure it had forked and spawned alike in an earlier run, its file and
    #: conftests unchanged since: the same failure in a fork counts ("": none known).
    known_failure: str = ""

    @property
    def forked(self) -> bool:
        """It is forked from a template that collected its file (fast mode)."""
        return is_template(self.scope)
