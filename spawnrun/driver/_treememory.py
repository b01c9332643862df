"""The device memory a test's process tree holds: sampled while it runs, learned after
it, and judged against its budget.

Runs in the parent, for a test's ``_jobs.Job``: plain functions of what the job knows
(its claimed devices, its processes, its plan), reading NVML's per-process usage
(``_devices.process_memory``) and the process table; never the job itself.
"""

from __future__ import annotations

from spawnrun.child._budget import SECTION
from spawnrun.devices import _devices
from spawnrun.devices import _packing
from spawnrun.launch import _runner

#: How often a running test's process tree is sampled for the device memory it holds
#: (one NVML query per claimed device, and a walk of /proc): an engine process that
#: holds memory for a second or more is seen.
SAMPLE_EVERY = 0.25


def tree_held(claimed: list[str], root: int) -> int | None:
    """What the process tree below ``root`` (the test's process: a template's fork, else
    the child) holds on ``claimed`` now (NVML's per-process usage): ``root`` and every
    process below it, also one that left its session. None where NVML cannot say."""
    pids = {root} | {pid for pid, _ in _runner.process_tree(root)}
    return _devices.process_memory(claimed, pids)


def over_guess(plan: _packing.Plan, guessed: bool, tree_peak: int | None) -> bool:
    """Whether a test's process tree held more than its learned budget (an engine
    process grew since the peak was learned, beyond torch's cap in the child)."""
    need = plan.need
    if not guessed or need is None or tree_peak is None:
        return False
    return tree_peak - _packing.RESERVE > need


def learned_peak(
    claimed: list[str],
    pids: set[int],
    child_pid: int,
    tree_peak: int | None,
    torch_peak: int | None,
    jax_peak: int | None = None,
) -> tuple[bool, int] | None:
    """Whether the test used one of its devices, and the peak that ``--spawn-pack auto``
    budgets it by next time (None: nothing is learned).

    torch's reserved peak on its fullest device, or what NVML lists for its processes
    now (its context included, so less the reserve) where that is more (memory held by
    other libraries), or the tree's sampled peak (``tree_peak``) where that is more
    still. A test that used no device, as one of them saw it, learns 0; where neither
    could look (no torch view, no NVML: a JAX test on a host without NVML), nothing is
    learned: an unmeasured peak is never 0, and a test with no record does not share.
    Where JAX started a GPU backend in the test's process, its own peak counts instead
    of NVML's figure, which is the pool JAX preallocated (75% of the device by default,
    whatever the test used).
    """
    if jax_peak is not None:
        return True, max(torch_peak or 0, jax_peak)
    pids = pids | set(_runner.group_members(child_pid))
    held = _devices.process_memory(claimed, pids)
    if tree_peak is not None:
        held = max(held or 0, tree_peak)
    if torch_peak is None and held is None:
        return None
    used = bool(torch_peak) or bool(held)
    peak = torch_peak or 0
    if held is not None:
        peak = max(peak, held - _packing.RESERVE)
    return used, peak


def tree_overrun(plan: _packing.Plan, tree_peak: int | None) -> str:
    """Why the test fails its declared budget over its whole process tree ("": it
    does not). A process the test started (an engine, a server), which no cap reaches,
    that took more fails the test, as torch's cap does in its own process; its
    neighbours never pay for it. (A learned budget so exceeded runs the test again
    alone: ``over_guess``.)"""
    need = plan.need
    if plan.learned or need is _packing.ALONE or tree_peak is None:
        return ""
    held = tree_peak - _packing.RESERVE
    if held <= need:
        return ""
    show = _packing.show
    return (
        f"{SECTION}: the test's process tree held {show(tree_peak)} on "
        f"one of its GPUs at once (NVML, sampled every {SAMPLE_EVERY:g} s; "
        f"{show(held)} less the {show(_packing.RESERVE)} reserve for its context), more "
        f"than its budget of {show(need)} ({plan.budget_source}): a process it "
        "started went over it, where no cap reaches"
    )


def holds_too_much(
    claimed: list[str],
    pids: set[int],
    child_pid: int,
    held_after: int | None,
    replace_above: int,
) -> str:
    """Why a scope's child holds too much device memory to run the scope's next test
    ("" if it does not): what torch still had allocated after the test, or what NVML
    lists for its processes where that is more."""
    held, how = held_after or 0, "torch has allocated"
    pids = pids | set(_runner.group_members(child_pid))
    listed = _devices.process_memory(claimed, pids) if claimed else None
    if listed is not None and listed > held:
        held, how = listed, "NVML lists for its processes"
    if held <= replace_above:
        return ""
    limit = _packing.show(replace_above)
    return f"after it {how} {_packing.show(held)}, more than spawn_scope_memory {limit}"
