"""The run summary: what the run's children did, counted as their tests end.

Runs in the parent. ``Summary`` keeps the counts (tests isolated, children, forks,
crashes, timeouts, reaped processes, peaks, packing) and words the summary's lines.
"""

from __future__ import annotations

import statistics

from spawnrun.devices import _packing
from spawnrun.driver import _early
from spawnrun.driver._jobs import Job
from spawnrun.wire._reports import NOT_A_TEMPLATE
from spawnrun.wire._reports import OUT_OF_ORDER
from spawnrun.wire._reports import REPLACED_TITLE


class Summary:
    #: Set by the loop: children started while collecting, templates refused (scope ->
    #: why), and the scope of each spawned test (for the refused templates' files).
    early: _early.Early
    refusals: dict[str, str]

    def __init__(self) -> None:
        self.boot_times: list[float] = []
        self.isolated = 0
        self.children = 0
        self.crashes = 0
        self.timeouts = 0
        self.reaped = 0
        self.peaks: list[tuple[int, str, list[str]]] = []
        #: Tests on devices: how many shared one, had a budget but ran alone, or ran
        #: alone (node ids by reason).
        self.shared = 0
        self.budget_alone = 0
        #: Of those that shared, how many on a first run's share (``_packing.first_run_need``).
        self.first_run = 0
        self.alone: dict[str, list[str]] = {}
        #: Scope children replaced after a test said the process is broken.
        self.replaced = 0
        #: Tests that failed (or skipped) on a guessed budget and ran again alone (``Done.again``).
        self.again: list[str] = []
        #: Tests that failed after they ran out of pytest's order and ran again in it.
        self.out_of_order: list[str] = []
        #: The pids of templates that forked, and how many tests ran in their forks.
        self.templates: set[int] = set()
        self.forks = 0
        #: Tests that take more than one job slot (node id -> slots) and the run's slots.
        self.slotted: dict[str, int] = {}
        self.slots_of_run = 0

    def _scope_tests(self, scope: str) -> list[str]:
        """The spawned tests of ``scope`` (the driver knows them)."""
        return []

    def _count(self, job: Job) -> None:
        self.children += job.children_started
        if job.template_pid and job.went:
            self.forks += 1
            self.templates.add(job.template_pid)
        if job.turned:
            self._count_test(job)
        # Else booted ahead: for a test that did not run (-x, an interrupt), or one whose
        # turn is still to come (its child died meanwhile): counted at its turn.

    def _count_test(self, job: Job) -> None:
        if job.counted:
            return  # ended and counted before its report was told (in pytest's order)
        job.counted = True
        self.isolated += 1
        self.replaced += bool(job.replaced)
        self.crashes += job.crashes
        self.timeouts += job.timeouts
        self.reaped += job.reaped_count
        if job.claimed:
            if job.shared:
                self.shared += 1
                self.first_run += job.plan.budget_source == _packing.FIRST_RUN_SOURCE
            elif job.plan.need is not _packing.ALONE:
                self.budget_alone += 1
            else:
                self.alone.setdefault(job.plan.alone_because, []).append(job.item.nodeid)
        if job.peak_device_bytes is not None:
            self.peaks.append((job.peak_device_bytes, job.item.nodeid, job.devices))

    def _packing_lines(self, list_alone: bool, shown: int = 10) -> list[str]:
        """Which tests shared a device and which ran alone, and why."""
        if not (self.shared or self.budget_alone) and not list_alone:
            return []
        alone = sum(len(ids) for ids in self.alone.values())
        parts = [f"{self.shared} shared a GPU within their budgets"]
        if self.first_run:
            parts[0] += f" ({self.first_run} on a first run's share: no peak recorded yet)"
        if self.budget_alone:
            parts.append(f"{self.budget_alone} with a budget found no neighbour")
        reasons = ", ".join(f"{why}: {len(ids)}" for why, ids in sorted(self.alone.items()))
        if alone:
            parts.append(f"{alone} ran alone ({reasons})")
        lines = ["packing: " + "; ".join(parts)]
        if list_alone:
            for why, ids in sorted(self.alone.items()):
                more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
                lines.append(f"  alone, {why}: {', '.join(ids[:shown])}{more}")
        return lines

    def summary(self, peaks_shown: int = 10, list_alone: bool = False) -> list[str]:
        """The run summary's lines ([] when nothing was spawned)."""
        if not self.isolated:
            return []
        first = f"{_plural(self.isolated, 'test')} isolated in "
        # A template runs no test: its forks are the children that did.
        first += _plural(self.children - len(self.templates) + self.forks, "child", "children")
        if self.forks:
            first += (
                f" ({self.forks} forked from {_plural(len(self.templates), 'template')} "
                "that collected their file)"
            )
        if self.boot_times:
            times = sorted(self.boot_times)
            first += f"; boot median {statistics.median(times):.2f}s, slowest {times[-1]:.2f}s"
        lines = [first]
        if self.early.started:
            started = _plural(self.early.started, "child", "children")
            lines.append(f"{started} started while collecting ({self.early.taken} used)")
        ends = []
        if self.replaced:
            were = "child was" if self.replaced == 1 else "children were"
            ends.append(f"{self.replaced} scope {were} replaced after a test ({REPLACED_TITLE})")
        if self.crashes:
            ends.append(f"{self.crashes} crashed")
        if self.timeouts:
            ends.append(f"{self.timeouts} timed out")
        if self.reaped:
            were = "was" if self.reaped == 1 else "were"
            ends.append(f"{_plural(self.reaped, 'process', 'processes')} left behind {were} reaped")
        if ends:
            lines.append(", ".join(ends))
        # Files refused for one reason share a line (kornia's 19 all imported onnxruntime).
        refused: dict[str, list[str]] = {}
        for scope, why in sorted(self.refusals.items()):
            if not why:
                continue  # the forkserver went off: its warning says why
            files = refused.setdefault(why, [])
            for nodeid in self._scope_tests(scope):
                path = nodeid.split("::")[0]
                if path not in files:  # a file's tests split over several templates
                    files.append(path)
        for why, files in refused.items():
            where = ", ".join(files) + (f" ({len(files)} files)" if len(files) > 1 else "")
            lines.append(f"{where or '?'}: {NOT_A_TEMPLATE}: {why}")
        lines += self._packing_lines(list_alone)
        if self.slotted:
            lines.append(
                f"job slots: {_plural(len(self.slotted), 'test')} took more than one, as many "
                "as the cores an earlier run measured each keeping busy need (up to "
                f"{max(self.slotted.values())} of {self.slots_of_run})"
            )
        if self.again:
            shown = ", ".join(self.again[:10]) + (" ..." if len(self.again) > 10 else "")
            lines.append(
                f"{_plural(len(self.again), 'test')} ran out of memory (or skipped for want "
                "of it) on a guessed budget, or beside one, or held more than it over its "
                "process tree, and ran again alone (the second run's outcome counts; its "
                f"peak is recorded): {shown}"
            )
        if self.out_of_order:
            shown = ", ".join(self.out_of_order[:10])
            shown += " ..." if len(self.out_of_order) > 10 else ""
            lines.append(
                f"{_plural(len(self.out_of_order), 'test')} {OUT_OF_ORDER}, failed, and ran "
                f"again after the tests before it (the second run's outcome counts): {shown}"
            )
        if self.peaks:
            lines.append("peak GPU memory per test (torch's caching allocator, reserved):")
            ranked = sorted(self.peaks, key=lambda p: (-p[0], p[1]))
            for size, nodeid, devices in ranked[:peaks_shown]:
                where = f"  [gpu {','.join(devices)}]" if devices else ""
                lines.append(f"  {size / 2**20:.1f} MiB  {nodeid}{where}")
            if len(ranked) > peaks_shown:
                lines.append(f"  ... and {len(ranked) - peaks_shown} more (junitxml has all)")
        return lines


def _plural(n: int, one: str, many: str = "") -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"
