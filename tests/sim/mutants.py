"""Bugs that the dispatcher's property suite must catch, each an exact source edit.

A mutant is one edit (``old`` -> ``new``, each found exactly once) in one module of a
copy of ``spawnrun/``. ``python tests/sim/mutants.py [NAME ...]`` applies each in turn
and runs the properties of ``tests/test_dispatch_properties.py`` against it, in a fresh
interpreter whose ``spawnrun`` is the patched copy, with a bounded, derandomized example
budget (``SPAWNRUN_SIM_EXAMPLES``) and no shrinking: the mutant's own ``killer`` first,
then the others. A mutant is killed when a property fails (an assertion, ``Unsafe``,
``Hang``, ``Late``, ``Illegal``, any error); one that every property passes survives,
and the command exits 1. ``tests/test_mutants.py`` runs each in CI.

Case tests do not count here: a bug a property cannot see is a hole in the properties.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
#: The example budget each property gets against a mutant (derandomized: the same
#: examples every run).
EXAMPLES = 120


@dataclass(frozen=True)
class Mutant:
    name: str
    #: The module, relative to the repository's root.
    module: str
    old: str
    new: str
    #: The property expected to kill it (run first).
    killer: str
    why: str


MUTANTS = (
    Mutant(
        "reserve-halved",
        "spawnrun/dispatch/state.py",
        "            settings.reserve,\n        )",
        "            settings.reserve // 2,\n        )",
        "test_packing_near_memory_is_safe",
        "the memory reserve per process halved: devices near their memory overflow",
    ),
    Mutant(
        "backfill-past-shadow",
        "spawnrun/dispatch/starts.py",
        "if ends is None or ends > shadow or not self.fits_now(entry.test):",
        "if ends is None or not self.fits_now(entry.test):",
        "test_backfilling_never_delays_the_head",
        "a test backfilled whatever its record says: it may delay the head",
    ),
    Mutant(
        "no-peer-poll",
        "spawnrun/dispatch/queries.py",
        "        if self.queue and self.peers_hold():\n"
        "            times.append(self.now + self.settings.poll)\n",
        "",
        "test_every_wait_has_a_wake_up",
        "no wake-up while a peer holds a device: its release is seen only by chance",
    ),
    Mutant(
        "no-settle-deadline",
        "spawnrun/dispatch/ends.py",
        "child.move(State.SETTLING, self.now, self.now + self.settings.settle)",
        "child.move(State.SETTLING, self.now)",
        "test_every_wait_has_a_wake_up",
        "no deadline for a child settling after its exit: only NVML's release ends it",
    ),
    Mutant(
        "alone-as-zero-budget",
        "spawnrun/dispatch/state.py",
        "        self._ids += 1\n        scope = test.scope",
        "        self._ids += 1\n"
        "        need = 0 if need is None else need\n"
        "        scope = test.scope",
        "test_every_test_ends_once_and_nothing_is_stuck",
        "a child that needs its devices alone recorded and claimed as a 0-byte budget",
    ),
    Mutant(
        "timeout-not-killed",
        "spawnrun/dispatch/ends.py",
        '                self.emit(ev.Kill(child.id, "timeout"))\n',
        "",
        "test_backfilling_keeps_every_test_ending_once_and_nothing_stuck",
        "a timed-out child is never killed (it is given up while its process runs)",
    ),
    Mutant(
        "no-liveness-check",
        "spawnrun/dispatch/core.py",
        "            if live.can_move(self, head):\n                return\n",
        "            return\n",
        "test_a_wait_nothing_can_end_is_reported",
        "a head that nothing can wake is never reported: the run waits without end",
    ),
    Mutant(
        "peers-ignored",
        "spawnrun/dispatch/core.py",
        "            self.set_peers(event.claims)",
        "            pass",
        "test_every_test_ends_once_and_nothing_is_stuck",
        "other xdist workers' ledger claims ignored: a start denied again and again",
    ),
    # Added: a bug for each remaining property, and two of the same family.
    Mutant(
        "slot-off-by-one",
        "spawnrun/dispatch/queries.py",
        "used + min(test.slots, self.settings.jobs) <= self.settings.jobs",
        "used + min(test.slots, self.settings.jobs) < self.settings.jobs",
        "test_wall_time_is_within_a_factor_of_the_lower_bound",
        "one job slot fewer than the run has: tests wait while a slot is free",
    ),
    Mutant(
        "driver-order",
        "spawnrun/driver/_perform.py",
        "        for action in batch.performed(actions):  # the simulator's order too",
        "        for action in actions:",
        "test_the_driver_performs_a_batch_in_the_simulators_order",
        "the driver performs a batch in the dispatcher's order, not the shared one",
    ),
    Mutant(
        "batch-order",
        "spawnrun/dispatch/batch.py",
        "    return sorted(actions, key=later)  # stable: the order within each stays",
        "    return list(actions)",
        "test_a_batch_is_performed_with_goes_first_and_starts_in_place",
        "a batch performed as returned: children for later tests start before a go",
    ),
    Mutant(
        "batch-starts-last",
        "spawnrun/dispatch/batch.py",
        "    named = {a.child for a in actions if isinstance(a, (ev.Go, ev.Dismiss, ev.Kill))}",
        "    named: set[int] = set()",
        "test_a_batch_is_performed_with_goes_first_and_starts_in_place",
        "every start performed last: a dismissal of a child started in the batch is lost",
    ),
    Mutant(
        "no-preemption",
        "spawnrun/dispatch/starts.py",
        "        idle = [c for c in self.live_children() if self.idle_holder(c, head)]\n",
        "        idle: list[Child] = []\n",
        "test_every_test_ends_once_and_nothing_is_stuck",
        "idle holders are never dismissed for the head (hold and wait)",
    ),
    Mutant(
        "backfill-slack-shrunk",
        "spawnrun/dispatch/queries.py",
        "    SLACK = (1.25, 0.25)",
        "    SLACK = (0.5, 0.0)",
        "test_backfilling_never_delays_the_head",
        "a backfilled test's record taken as half: it ends after the head's shadow",
    ),
    Mutant(
        "kill-grace-forgotten",
        "spawnrun/dispatch/ends.py",
        "                child.move(State.KILLED, self.now, self.now + s.kill_grace)\n"
        "            elif child.state is State.EXITING:",
        "                child.move(State.KILLED, self.now)\n"
        "            elif child.state is State.EXITING:",
        "test_every_wait_has_a_wake_up",
        "a timed-out child killed with no deadline: an unkillable one holds forever",
    ),
)
BY_NAME = {m.name: m for m in MUTANTS}


def patched(mutant: Mutant, into: Path) -> Path:
    """A copy of ``spawnrun/`` under ``into`` with the mutant's edit; its root."""
    target = into / "spawnrun"
    shutil.copytree(ROOT / "spawnrun", target, ignore=shutil.ignore_patterns("__pycache__"))
    module = into / mutant.module
    text = module.read_text()
    if text.count(mutant.old) != 1:
        raise LookupError(f"{mutant.name}: its text is not exactly once in {mutant.module}")
    module.write_text(text.replace(mutant.old, mutant.new))
    return into


def properties() -> dict[str, Callable[[], None]]:
    """The property suite's properties (hypothesis tests), by name, in file order."""
    import test_dispatch_properties as suite

    found = {}
    for name, value in vars(suite).items():
        if name.startswith("test_") and hasattr(value, "hypothesis"):
            found[name] = value
    return found


def hunt(mutant: Mutant) -> str:
    """In this process (its ``spawnrun`` the patched copy): the property that kills the
    mutant, with its first line of failure ("" if none does)."""
    import spawnrun

    where = Path(spawnrun.__file__).resolve()
    copy = Path(os.environ["SPAWNRUN_MUTANT_COPY"]).resolve()
    if copy not in where.parents:
        raise RuntimeError(f"spawnrun imports from {where}, not the patched copy in {copy}")
    found = properties()
    order = [n for n in (mutant.killer,) if n in found]
    order += [n for n in found if n != mutant.killer]
    for name in order:
        try:
            found[name]()
        except BaseException as error:  # a hang or an error counts: the property failed
            if isinstance(error, KeyboardInterrupt):
                raise
            line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            return f"{name}: {type(error).__name__}: {line[:200]}"
    return ""


def check(mutant: Mutant, examples: int = EXAMPLES, timeout: float = 300.0) -> str:
    """Run the properties against ``mutant`` in a fresh interpreter: what killed it
    ("" if it survived)."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        copy = patched(mutant, Path(tmp))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(copy), str(TESTS)])
        env["SPAWNRUN_SIM_EXAMPLES"] = str(examples)
        env["SPAWNRUN_MUTANT_COPY"] = str(copy)
        env.pop("PYTHONDEVMODE", None)  # speed only: the properties start no process
        proc = subprocess.run(
            [sys.executable, "-c", f"from sim import mutants; mutants._child({mutant.name!r})"],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    out = proc.stdout.strip().splitlines()
    if proc.returncode not in (0, 3) or not out:
        raise RuntimeError(f"{mutant.name}: the check itself failed:\n{proc.stderr}")
    return "" if proc.returncode == 3 else out[-1]


def _child(name: str) -> None:
    try:
        killed = hunt(BY_NAME[name])
    except Exception:
        traceback.print_exc()
        raise SystemExit(2) from None
    print(killed or "survived", flush=True)
    raise SystemExit(0 if killed else 3)


def main(argv: list[str]) -> int:
    chosen = [BY_NAME[n] for n in argv] if argv else list(MUTANTS)
    survived = []
    for mutant in chosen:
        began = time.monotonic()
        killed = check(mutant)
        took = time.monotonic() - began
        print(f"{mutant.name:24} {took:6.1f}s  {killed or 'SURVIVED'}", flush=True)
        if not killed:
            survived.append(mutant.name)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    raise SystemExit(main(sys.argv[1:]))
