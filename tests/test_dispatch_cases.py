"""The hangs and losses that were seen, each as a simulator case for the dispatcher.

Each case is a suite of the shape that hung or lost a report on the old scheduler. A
case that exercises a rule is also run with that rule taken out (``without``): it must
then hang or break, which shows the case tests the rule and not nothing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim.world import Result
from sim.world import Spec
from sim.world import Unsafe
from sim.world import World

from spawnrun.dispatch import Dispatcher
from spawnrun.dispatch import batch
from spawnrun.dispatch import events as ev
from spawnrun.dispatch.events import Kind

GiB = 1 << 30
H200 = 140 * GiB


def _settings(**kw: object) -> ev.Settings:
    base: dict[str, object] = dict(
        devices=("0",),
        capacity=(("0", H200),),
        per_gpu=8,
        jobs=8,
        lookahead=2,
        exit_grace=20.0,
        kill_grace=5.0,
        settle=10.0,
    )
    base.update(kw)
    return ev.Settings(**base)  # type: ignore[arg-type]


def _outcomes(world: World) -> dict[str, str]:
    result = world.run()
    assert result.stuck == []
    return {t: hows[0] for t, hows in result.ends.items()}


def _reports_of(result: Result, test: str) -> list[ev.Report]:
    return [a for a in result.actions if isinstance(a, ev.Report) and a.test == test]


def _learned_second_run() -> list[Spec]:
    """Case 1's file: budgets, exclusive tests, bare tests with learned budgets, one more."""
    tpl = "tpl test_mixed.py"
    specs = [
        Spec(ev.Test(f"budget{i}", need=GiB * (1 + i % 3), template=tpl), duration=0.1 * (i % 6))
        for i in range(10)
    ]
    specs += [Spec(ev.Test(f"exclusive{i}", template=tpl), duration=0.3) for i in range(3)]
    specs += [Spec(ev.Test(f"bare{i}", need=2 * GiB, template=tpl), duration=0.2) for i in range(2)]
    specs += [Spec(ev.Test("exclusive3", template=tpl), duration=0.3)]
    return specs


def _interleaved_scopes(scope: str) -> list[Spec]:
    """A conftest that interleaves two modules' tests (or --ff after failures in both)."""
    return [
        Spec(ev.Test(f"{m}{i}", scope=f"{scope} {m}"), duration=0.2) for i in range(3) for m in "ab"
    ]


def test_fast_mode_with_learned_budgets_finishes() -> None:
    specs = _learned_second_run()
    outcomes = _outcomes(World(_settings(), specs))
    assert outcomes == {s.test.id: "replay" for s in specs}


@pytest.mark.parametrize("scope", ["module", "class"])
@pytest.mark.parametrize("lookahead", [0, 2])
def test_scopes_out_of_their_order_finish_and_never_share(scope: str, lookahead: int) -> None:
    specs = _interleaved_scopes(scope)
    # World checks that no two alone tests ever hold gpu 0 at once, and the order in
    # each child.
    outcomes = _outcomes(World(_settings(lookahead=lookahead), specs))
    assert outcomes == {s.test.id: "replay" for s in specs}


def test_an_idle_scope_child_is_dismissed_before_it_blocks_the_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the rule the idle child of scope a holds gpu 0 while b0 waits for it.

    Nothing can move then: the liveness check reports b0 instead of hanging.
    """
    specs = _interleaved_scopes("module")
    monkeypatch.setattr(Dispatcher, "_preempt", lambda self, head: None)
    result = World(_settings(lookahead=0), specs).run()
    assert result.stuck
    (text,) = {a.detail for a in _reports_of(result, result.stuck[0])}
    assert "nothing could start this test" in text and "between tests" in text


@pytest.mark.parametrize("fate", ["linger", "exit-3"])
def test_a_fork_that_does_not_exit_cleanly_is_blamed_and_the_next_passes(fate: str) -> None:
    """A non-daemon thread or an atexit that hangs, or one that exits 3, after "done"."""
    tpl = "tpl test_threads.py"
    specs = [
        Spec(ev.Test("leaves_a_thread", template=tpl), duration=0.1, fate=fate),
        Spec(ev.Test("next_one", template=tpl), duration=0.1),
    ]
    world = World(_settings(), specs)
    result = world.run()
    assert {t: h[0] for t, h in result.ends.items()} == {
        "leaves_a_thread": "replay",
        "next_one": "replay",
    }
    assert [t for t, _ in result.warnings] == ["leaves_a_thread"]
    if fate == "linger":
        assert "did not exit within 20s" in result.warnings[0][1]


def test_a_child_that_cannot_start_gives_its_device_back() -> None:
    """EMFILE while starting: the test gets the error, later tests on the device run."""
    specs = [Spec(ev.Test("emfile"), fate="start-fail")]
    specs += [Spec(ev.Test(f"after{i}"), duration=0.1) for i in range(3)]
    outcomes = _outcomes(World(_settings(jobs=1), specs))
    assert outcomes == {
        "emfile": "report:START_FAILED",
        "after0": "replay",
        "after1": "replay",
        "after2": "replay",
    }


def test_a_child_that_cannot_be_killed_is_given_up_with_a_warning() -> None:
    specs = [Spec(ev.Test("stuck_in_the_driver"), duration=0.1, fate="unkillable")]
    specs += [Spec(ev.Test("next"), duration=0.1)]
    result = World(_settings(jobs=1), specs).run()
    assert {t: h[0] for t, h in result.ends.items()} == {
        "stuck_in_the_driver": "replay",
        "next": "replay",
    }
    texts = [text for test, text in result.warnings if test == "stuck_in_the_driver"]
    assert any("could not be killed" in text for text in texts)


@pytest.mark.parametrize("passes_after", [0.0, 0.5], ids=["same-turn", "after-the-stop"])
def test_a_test_before_an_interrupt_runs_to_its_end_and_is_reported(passes_after: float) -> None:
    """One child calls pytest.exit while a test pytest reached before it still runs."""
    specs = [
        Spec(ev.Test("passes", count=1), duration=1.0 + passes_after, boot=0.5),
        Spec(ev.Test("exits", count=1), duration=1.0, boot=0.5, fate="interrupt"),
        Spec(ev.Test("never", count=1), duration=1.0, boot=0.5),
    ]
    devices = ("0", "1", "2")
    config = _settings(devices=devices, capacity=tuple((d, H200) for d in devices), jobs=3)
    result = World(config, specs).run()
    # As in-process: "passes" ran before "exits"; "never" would not have run at all.
    assert result.ends == {"passes": ["replay"], "exits": ["replay"], "never": ["drop"]}
    ends = [a for a in result.actions if isinstance(a, (ev.Replay, ev.Interrupt))]
    assert ends[-1] == ev.Interrupt("exits")  # once the earlier test is reported


def test_the_interrupt_comes_after_the_replays_of_its_batch() -> None:
    d = Dispatcher(_settings(devices=("0", "1"), capacity=(), jobs=2))
    for test in ("a", "b"):
        d.handle(ev.Submit(0, ev.Test(test)))
        d.step()
    assert d.handle(ev.Booted(1, 1), ev.Booted(1, 2)) == [
        ev.Go(1, "a", ("0",)),
        ev.Go(2, "b", ("1",)),
    ]
    actions = d.handle(ev.Done(2, 2, "b", interrupt=True), ev.Done(2, 1, "a"))
    # Told in pytest's order, whatever order they ended in.
    assert actions == [ev.Replay("a"), ev.Replay("b"), ev.Interrupt("b")]


def test_a_test_that_ended_before_the_interrupting_one_before_it_is_never_told() -> None:
    """Issue 56: a test after one that raises KeyboardInterrupt (or calls
    ``pytest.exit``) ended first, beside it, and was reported PASSED; in-process pytest
    never reaches it. What ends is told in pytest's order, so it is dropped unreported."""
    d = Dispatcher(_settings(devices=("0", "1", "2"), capacity=(), jobs=3))
    for test in ("a", "b", "c"):
        d.handle(ev.Submit(0, ev.Test(test)))
        d.step()
    d.handle(ev.Booted(1, 1), ev.Booted(1, 2), ev.Booted(1, 3))
    assert d.handle(ev.Done(2, 3, "c")) == []  # a, before it, still runs
    assert d.handle(ev.Done(3, 2, "b", interrupt=True)) == []
    told = d.handle(ev.Done(4, 1, "a"))
    assert told == [ev.Replay("a"), ev.Replay("b"), ev.Drop("c"), ev.Interrupt("b")]


def test_waiting_for_another_workers_device_is_bounded_by_polls() -> None:
    specs = [Spec(ev.Test("mine"), duration=0.1)]
    world = World(_settings(jobs=1), specs, peers=((0.0, 30.0, "0", None),))
    result = world.run()
    assert result.ends == {"mine": ["replay"]}
    assert result.time >= 30.0


@pytest.mark.parametrize("lag", [0.0, 1.0])
def test_a_start_another_worker_beat_to_the_ledger_waits_again(lag: float) -> None:
    """The dispatcher learns of a peer's claim a poll late: its start is denied (no
    process), the test waits in its place and runs once the peer is done."""
    specs = [Spec(ev.Test("mine"), duration=0.1), Spec(ev.Test("next"), duration=0.1)]
    world = World(_settings(jobs=2), specs, peers=((0.0, 5.0, "0", None),), peer_lag=lag)
    result = world.run()
    assert result.ends == {"mine": ["replay"], "next": ["replay"]}
    assert result.time >= 5.0
    assert bool(world.denied) == (lag > 0)


def test_booting_ahead_follows_what_pytest_says_comes_next() -> None:
    """An xdist worker's order is not the collection's: only the told test boots ahead."""
    d = Dispatcher(_settings(devices=("0", "1"), capacity=(), lookahead=2))
    suite = tuple(ev.Test(t) for t in ("a", "b", "c"))
    d.handle(ev.Suite(0, suite), ev.Next(0, ("c",)), ev.Submit(0, suite[0]))
    started = [a.test for a in d.step() if isinstance(a, ev.Start)]
    assert started == ["a", "c"]


def test_children_boot_ahead_while_every_slot_is_taken() -> None:
    """Short budgeted tests, slow boots: the waiting test and the next ones boot while
    the slots are full, so a slot that frees runs a booted child, not a fresh boot.
    (The first switch booted ahead only while no test waited: run 18's default mode
    went from 1.18x to 1.83x plain on the H200.)"""
    specs = [Spec(ev.Test(f"t{i}", need=2 * GiB), duration=0.3, boot=2.5) for i in range(16)]
    result = World(_settings(jobs=4, lookahead=4), specs).run()
    assert all(v == ["replay"] for v in result.ends.values())
    # 4 slots, a boot each: one wave of boots (2.5 s) then the rest already booted.
    # Booting only at a free slot takes four waves of 2.8 s.
    assert result.time < 8.0, result.time


@pytest.mark.parametrize("fate", ["start-fail", "boot-die"])
def test_a_child_booted_while_its_test_waits_for_a_slot_dies_once(fate: str) -> None:
    """Its death is its test's report at its slot; it is never booted again in a loop."""
    specs = [Spec(ev.Test("long"), duration=3.0), Spec(ev.Test("doomed"), fate=fate)]
    result = World(_settings(devices=("0", "1"), jobs=1, lookahead=1, capacity=()), specs).run()
    assert result.ends == {"long": ["replay"], "doomed": ["report:START_FAILED"]}
    starts = [a for a in result.actions if isinstance(a, ev.Start) and a.test == "doomed"]
    assert len(starts) == 1


def test_a_test_that_never_fits_gets_a_report_not_a_wait() -> None:
    specs = [Spec(ev.Test("huge", need=200 * GiB)), Spec(ev.Test("small", need=GiB))]
    outcomes = _outcomes(World(_settings(), specs))
    assert outcomes == {"huge": "report:UNFIT", "small": "replay"}


def test_an_early_child_with_the_wrong_guess_is_dismissed_and_runs_nothing() -> None:
    """A file's first test has a budget: the child started with no budget does not fit."""
    specs = [Spec(ev.Test("first", need=2 * GiB, key="test_a.py"), duration=0.1)]
    world = World(_settings(early=2), specs, expect=(("test_a.py", 1, None),))
    result = world.run()
    assert result.ends == {"first": ["replay"]}
    early = [p for p in result.procs.values() if p.kind is ev.Kind.EARLY]
    assert len(early) == 1 and early[0].ran == []


def test_an_early_child_that_matches_is_taken() -> None:
    specs = [Spec(ev.Test("first", key="test_a.py"), duration=0.1)]
    result = World(_settings(early=2), specs, expect=(("test_a.py", 1, None),)).run()
    assert [p.ran for p in result.procs.values()] == [["first"]]


def test_a_stop_dismisses_idle_scope_children_so_their_teardown_runs() -> None:
    """-x under a module scope: the idle child is dismissed (not killed)."""
    specs = [
        Spec(ev.Test("a0", scope="module a"), duration=0.1, fate="fail"),
        Spec(ev.Test("a1", scope="module a"), duration=0.1),
    ]
    world = World(_settings(jobs=1), specs, maxfail=1)
    kills: list[ev.Kill] = []
    original = world._kill

    def record(action: ev.Kill) -> None:
        kills.append(action)
        original(action)

    world._kill = record  # type: ignore[method-assign]
    result = world.run()
    assert result.ends == {"a0": ["replay"], "a1": ["drop"]}  # as in-process: not run
    assert kills == []
    assert [p.ran for p in result.procs.values()] == [["a0"]]


def test_a_go_before_boot_is_caught_by_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """The world itself can fail: a dispatcher that sends go at start is caught."""
    from spawnrun.dispatch.state import Run

    start = Run.start

    def eager(self, kind, devices, need, test=None, members=None, key="", parent=0):  # type: ignore[no-untyped-def]
        child = start(self, kind, devices, need, test, members, key, parent)
        if test is not None:
            self.emit(ev.Go(child.id, test.id))
        return child

    monkeypatch.setattr(Run, "start", eager)
    with pytest.raises(Unsafe):
        World(_settings(), [Spec(ev.Test("a"))]).run()


# Children whose boot touches no device memory boot unclaimed (issue 25) ---------------


@pytest.mark.parametrize("defer", [True, False])
def test_exclusive_tests_boot_while_the_one_before_runs(defer: bool) -> None:
    """Six tests alone on one device, boots longer than the tests. Once the file's first
    boot showed it makes no context, the next children boot unclaimed while the one
    before runs, and each takes the device once it is free. Holding their claims from
    their start (H200 run 21: 4.24x plain), each boots only once the device is empty."""
    specs = [Spec(ev.Test(f"x{i}", file="test_x.py"), duration=1.0, boot=2.5) for i in range(6)]
    result = World(_settings(jobs=4, lookahead=4, settle=0.5, defer=defer), specs).run()
    assert all(v == ["replay"] for v in result.ends.values())
    if defer:
        assert result.time < 12.0, result.time  # two boots, then the tests back to back
    else:
        assert result.time > 20.0, result.time  # a boot before each test


@pytest.mark.parametrize(("defer", "known"), [(True, True), (True, False), (False, True)])
def test_module_children_without_a_budget_boot_while_another_module_runs(
    defer: bool, known: bool
) -> None:
    """Four modules of eight tests, each module's child alone on the device (no budget).
    Where an earlier run saw the modules' boots make no context (``boots``), the next
    module's child imports and collects while the current one runs; a module never
    booted before holds its claim from its start, as every child used to."""
    specs = [
        Spec(ev.Test(f"m{m}::t{i}", scope=f"module m{m}", file=f"m{m}.py"), duration=0.3, boot=3)
        for m in range(4)
        for i in range(8)
    ]
    boots = tuple((f"m{m}.py", "") for m in range(4)) if known else ()
    config = _settings(jobs=4, lookahead=2, settle=0.5, defer=defer, boots=boots)
    result = World(config, specs).run()
    assert all(v == ["replay"] for v in result.ends.values())
    bound = 3 + 4 * 8 * 0.3 + 2.0
    assert (result.time < bound) is (defer and known), result.time


def test_booting_children_do_not_count_toward_the_per_device_cap() -> None:
    """Two tests at once on the device (its cap), short tests, slow boots: children that
    boot unclaimed hold no place under the cap, so a freed place runs a booted child."""
    specs = [
        Spec(ev.Test(f"t{i}", need=2 * GiB, file="t.py"), duration=0.3, boot=2.5) for i in range(12)
    ]
    config = _settings(jobs=4, per_gpu=2, lookahead=4, boots=(("t.py", ""),))
    deferred = World(replace(config, defer=True), specs).run()
    claimed = World(config, specs).run()
    assert all(v == ["replay"] for v in deferred.ends.values())
    # Boots come in waves of four (the lookahead): 12 tests in about three 2.5 s waves;
    # claimed from their start, two boots at a time (the cap): six waves.
    assert deferred.time < 9.0 and claimed.time > 15.0, (deferred.time, claimed.time)


def test_a_file_whose_boot_makes_a_context_never_boots_unclaimed() -> None:
    """Its conftest allocates on the device at import: each of its children holds its
    claim from its start (the world counts such a boot as holding what it sees, so an
    unclaimed one beside the exclusive test would fail the run), while another file's
    children boot unclaimed."""
    specs = [
        Spec(ev.Test(f"k{i}", file="test_k.py"), boot=2.0, touches=ev.CONTEXT) for i in range(4)
    ]
    specs += [Spec(ev.Test(f"p{i}", file="test_p.py"), boot=2.0) for i in range(4)]
    result = World(_settings(jobs=2, lookahead=3, settle=0.5, defer=True), specs).run()
    assert all(v == ["replay"] for v in result.ends.values())
    assert result.dispatcher.boots == {"test_k.py": ev.CONTEXT, "test_p.py": ""}
    assert not [p for p in result.procs.values() if p.deferred and p.test.startswith("k")]
    assert [p for p in result.procs.values() if p.deferred and p.test.startswith("p")]


def test_a_boot_that_initialized_the_driver_runs_on_the_devices_it_saw() -> None:
    """Its conftest calls ``torch.cuda.is_available()``: the driver then knows only the
    devices the child saw, so its go gives it those, even when another is free first
    (the world fails on a go to others)."""
    specs = [Spec(ev.Test("long", file="a.py"), duration=5.0)]
    specs += [
        Spec(ev.Test(f"d{i}", file="test_d.py"), duration=0.5, boot=1.0, touches=ev.DRIVER)
        for i in range(6)
    ]
    config = _settings(
        devices=("0", "1"),
        capacity=(),
        jobs=2,
        lookahead=3,
        defer=True,
        boots=(("test_d.py", ev.DRIVER),),
    )
    result = World(config, specs).run()
    assert all(v == ["replay"] for v in result.ends.values())
    bound = [p for p in result.procs.values() if p.deferred and p.ran]
    assert bound and all(p.devices == p.seen for p in bound)


def test_a_test_that_never_fits_gets_no_child_booted_unclaimed() -> None:
    """Found by the properties: a test bigger than the device, of a file known to boot
    cleanly, got a child booted ahead unclaimed (no fit was asked); that child's death
    then became its report, instead of "does not fit"."""
    specs = [
        Spec(ev.Test("small", file="f.py")),
        Spec(ev.Test("huge", need=200 * GiB, file="f.py"), fate="boot-die"),
    ]
    config = _settings(jobs=1, lookahead=1, defer=True, boots=(("f.py", ""),))
    result = World(config, specs).run()
    assert result.ends == {"small": ["replay"], "huge": ["report:UNFIT"]}
    assert [p.test for p in result.procs.values()] == ["small"]


@pytest.mark.parametrize("learn_early", [True, False])
def test_what_a_child_started_while_collecting_saw_is_learned(
    learn_early: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found on the H200 (scopes, run 23): every module's first child was started while
    collecting, and only spawned and scope children taught what a file's boot touches,
    so no later child of those files booted unclaimed. Four tests alone, one file."""
    if not learn_early:
        from spawnrun.dispatch.ends import Ends

        learn = Ends._learn_boot

        def spawned_only(self: Ends, child: object, touched: str) -> None:
            if getattr(child, "kind", None) is not ev.Kind.EARLY:
                learn(self, child, touched)  # type: ignore[arg-type]

        monkeypatch.setattr(Ends, "_learn_boot", spawned_only)
    specs = [
        Spec(ev.Test(f"x{i}", key="f.py", file="f.py"), duration=1.0, boot=2.5) for i in range(4)
    ]
    config = _settings(jobs=2, lookahead=2, early=1, settle=0.5, defer=True)
    result = World(config, specs, expect=(("f.py", 1, None),)).run()
    assert all(v == ["replay"] for v in result.ends.values())
    assert result.warnings == []
    assert (result.time < 8.5) is learn_early, result.time


def test_an_unclaimed_child_still_booting_at_its_turn_takes_its_slot_and_devices() -> None:
    """Its devices are free at its turn: it claims the devices it sees and takes its
    slot while it boots, so the driver's boot limit holds for it (a boot that hangs was
    waited for without end, its test never started)."""
    d = Dispatcher(_settings(jobs=2, lookahead=2, defer=True, boots=(("f.py", ""),)))
    test = ev.Test("t", file="f.py")
    d.handle(ev.Suite(0, (test,)))
    (start,) = [a for a in d.step() if isinstance(a, ev.Start)]
    assert start.deferred and start.devices == ("0",)
    d.handle(ev.Submit(0.1, test))
    d.step()
    assert d.tests["t"].phase.name == "STARTED" and d.children[start.child].devices == ("0",)
    assert d.handle(ev.Booted(1.0, start.child)) == [ev.Go(start.child, "t", ("0",))]


def test_a_booting_head_has_the_idle_holders_of_the_devices_it_sees_dismissed() -> None:
    """The head's unclaimed child still boots; a child booted ahead, claimed, for a later
    test of an unknown file sits idle on the device the head's child sees. The head must
    take it now (the boot limit starts with its claim): waiting for its own boot to end
    first would wait without end if that boot hangs."""
    d = Dispatcher(_settings(jobs=2, lookahead=2, defer=True, boots=(("a.py", ""),)))
    head, later = ev.Test("a", file="a.py"), ev.Test("b", file="b.py")
    d.handle(ev.Suite(0, (head, later)))
    starts = {a.test: a for a in d.step() if isinstance(a, ev.Start)}
    assert starts["a"].deferred and not starts["b"].deferred  # b's file is unknown
    d.handle(ev.Booted(0.5, starts["b"].child))  # b's child is ready, idle, on gpu 0
    d.handle(ev.Submit(1.0, head))
    actions = d.step()
    assert ev.Dismiss(starts["b"].child) in actions
    d.handle(ev.Exited(1.1, starts["b"].child, 0), ev.Released(1.1, starts["b"].child))
    d.step()
    assert d.tests["a"].phase.name == "STARTED", d.tests["a"]
    assert d.children[starts["a"].child].devices == ("0",)


def _drain_behind_a_long_test(recorded: bool) -> list[Spec]:
    """A long budgeted test runs; an exclusive test waits for the device to drain;
    short budgeted tests come after it. ``recorded``: earlier runs measured them."""

    def test(tid: str, need: int | None, seconds: float) -> Spec:
        known = seconds if recorded else None
        return Spec(ev.Test(tid, need=need, duration=known, file="f.py"), duration=seconds)

    specs = [test("long", 2 * GiB, 10.0), test("exclusive", None, 1.0)]
    return specs + [test(f"short{i}", 2 * GiB, 1.0) for i in range(4)]


@pytest.mark.parametrize("recorded", [True, False])
def test_short_tests_are_backfilled_while_an_exclusive_test_waits_for_a_drain(
    recorded: bool,
) -> None:
    """The short tests waited behind the exclusive one, which waited for the long one:
    the device ran one test at a time for most of the run (issue 25: exclusive tests
    drain the device). With records, they run beside the long test and end before it,
    and the exclusive test starts no later than without them."""
    specs = _drain_behind_a_long_test(recorded)
    plain = World(_settings(), specs)  # no backfill: pytest waits at the head
    backfilled = World(_settings(backfill=4), specs)
    first, second = plain.run(), backfilled.run()
    for result in (first, second):
        assert result.stuck == [] and set(result.ends) == {s.test.id for s in specs}
    shorts = [f"short{i}" for i in range(4)]
    if recorded:
        assert second.time < first.time - 1.5, (first.time, second.time)
        assert backfilled.went["exclusive"] <= plain.went["exclusive"]
        assert all(backfilled.went[s] < backfilled.went["exclusive"] for s in shorts)
    else:  # nothing recorded: today's order
        assert backfilled.went == plain.went


def test_a_template_started_after_a_stop_is_dismissed_once_its_forks_ran() -> None:
    """Found by the backfilling property: pytest went on past tests waiting for a drain
    (records said the drain would take long); a later test stopped the session (-x); an
    earlier one still ran, from a template started after the stop, which was then kept
    for tests that could not come any more: the run never ended."""

    def test(tid: str, need: int | None, seconds: float, template: str = "") -> Spec:
        plan = ev.Test(tid, need=need, duration=seconds, template=template, file=tid[:1])
        return Spec(plan, duration=seconds, boot=1.0 if seconds else 0.1)

    specs = [
        test("long", 2 * GiB, 8.0),
        test("alone", None, 1.0),
        test("t0", None, 0.0, template="tpl x"),
        test("unfit", 40 * GiB, 0.0),
    ]
    settings = _settings(capacity=(("0", 16 * GiB),), per_gpu=1, jobs=2, lookahead=0)
    result = World(replace(settings, backfill=1), specs, maxfail=1).run()
    assert result.ends == {
        "long": ["replay"],
        "alone": ["replay"],
        "t0": ["replay"],
        "unfit": ["report:UNFIT"],
    }


def test_a_test_that_failed_on_a_guess_runs_again_alone_once() -> None:
    """A learned budget is a guess: a test that failed with one (or beside one) runs
    again at once, alone, and only that run's reports count; never a third time."""
    specs = [
        Spec(ev.Test("guessed", need=2 * GiB), duration=1.0, fate="guess"),
        Spec(ev.Test("neighbour", need=2 * GiB), duration=3.0),
    ]
    world = World(_settings(), specs)
    result = world.run()
    assert result.ends == {"guessed": ["replay"], "neighbour": ["replay"]}
    assert world.agains == ["guessed"] and world.needs["guessed"] is None
    # Alone: it waited for its neighbour to leave the device.
    assert world.went["guessed"] >= 3.0


def test_a_forked_test_that_failed_on_a_guess_runs_again_in_a_child_of_its_own() -> None:
    """A test forked from its file's template runs with the budget the template was
    started with: run again alone, it gets a child of its own (a fork of the template
    would run with that budget again). Its template's other test still forks from it."""
    specs = [
        Spec(ev.Test("guessed", need=2 * GiB, template="t"), duration=1.0, fate="guess"),
        Spec(ev.Test("sibling", need=2 * GiB, template="t"), duration=1.0),
    ]
    world = World(_settings(), specs)
    result = world.run()
    assert result.ends == {"guessed": ["replay"], "sibling": ["replay"]}
    assert world.agains == ["guessed"] and world.needs["guessed"] is None
    assert world.kinds == {"guessed": Kind.SPAWN, "sibling": Kind.FORK}


def test_a_templates_test_that_failed_on_a_guess_runs_again_apart() -> None:
    """The driver hands a file's template to the dispatcher as a scope whose child forks
    each test: one that failed on a guess runs again alone in a child of its own (its
    budget was the template's), and the template goes on with its next test."""
    specs = [
        Spec(ev.Test(name, need=2 * GiB, scope="t", forked=True), duration=1.0, fate=fate)
        for name, fate in (("first", "pass"), ("guessed", "guess"), ("last", "pass"))
    ]
    world = World(_settings(), specs)
    result = world.run()
    assert result.ends == {"first": ["replay"], "guessed": ["replay"], "last": ["replay"]}
    assert world.agains == ["guessed"] and world.needs["guessed"] is None
    assert world.kinds == {"first": Kind.SCOPE, "guessed": Kind.SPAWN, "last": Kind.SCOPE}


def _mixed_suite() -> list[Spec]:
    """Budgeted tests of 1-3 s with a test that needs the device alone after every
    third of them (the shape of issue 25's mixed suite: bare and exclusive tests among
    budgeted ones)."""
    specs = []
    for i in range(18):
        seconds = (1.0, 2.0, 3.0)[i % 3]
        specs.append(Spec(ev.Test(f"b{i}", need=2 * GiB, file="f.py"), duration=seconds))
        if i % 3 == 2:
            specs.append(Spec(ev.Test(f"alone{i}", file="f.py"), duration=0.5))
    return specs


def test_tests_that_need_the_device_alone_share_one_drain() -> None:
    """Each test that needed the device alone drained it at its turn: nothing new
    started until every running test had left, and after it the device filled again,
    six times (issue 25). Gathered, they wait while the budgeted tests run and then run
    one after another in a single drain; the run is shorter and nothing is lost."""
    specs = _mixed_suite()
    each = World(_settings(), specs)
    gathered = World(_settings(gather=32), specs)
    first, second = each.run(), gathered.run()
    for result in (first, second):
        assert result.stuck == []
        assert result.ends == {s.test.id: ["replay"] for s in specs}
    alone = [s.test.id for s in specs if s.test.need is None]
    budgeted = [s.test.id for s in specs if s.test.need is not None]
    assert min(gathered.went[a] for a in alone) >= max(gathered.went[b] for b in budgeted)
    assert min(each.went[a] for a in alone) < max(each.went[b] for b in budgeted)
    assert second.time < first.time - 4.0, (first.time, second.time)


def test_gathering_stops_at_its_limit_and_when_only_gathered_tests_are_left() -> None:
    """At most ``gather`` such tests wait passed over; past that limit the earliest is
    the head again (pytest waits there), so how far pytest runs ahead stays bounded."""
    specs = _mixed_suite()
    world = World(_settings(gather=2), specs)
    result = world.run()
    assert result.stuck == [] and result.ends == {s.test.id: ["replay"] for s in specs}
    alone = [s.test.id for s in specs if s.test.need is None]
    budgeted = [s.test.id for s in specs if s.test.need is not None]
    # The third one waiting made the first the head: some ran before the last budgeted.
    assert min(world.went[a] for a in alone) < max(world.went[b] for b in budgeted)
    assert sorted(alone, key=world.went.__getitem__) == alone  # still in their order


def test_a_stop_that_a_decisions_report_causes_reaches_the_dispatcher() -> None:
    """Found by the properties: two tests whose children could not start were reported
    by the dispatcher's decisions (not by an event), and the second report stopped the
    session (``--maxfail 2``). The simulator told the stop only after events, so the
    dispatcher never heard it and kept the template it had started, waiting for tests
    that could not come: a hang of the simulator, not of the driver, which queues the
    stop as it replays the report."""

    def spec(tid: str, template: str = "") -> Spec:
        key = f"file{template or tid}"
        test = ev.Test(tid, template=template, key=key, file=key)
        return Spec(test, duration=0.0, boot=0.1, fate="start-fail")

    settings = _settings(capacity=(("0", None),), per_gpu=1, jobs=1, lookahead=1, defer=True)
    settings = replace(settings, boots=(("filet1", ""),))
    result = World(settings, [spec("t0", "tpl x"), spec("t1")], maxfail=2).run()
    assert result.stuck == []
    assert result.ends == {"t0": ["report:START_FAILED"], "t1": ["report:START_FAILED"]}


def test_a_scopes_alone_tests_are_gathered_while_its_child_boots_unclaimed() -> None:
    """On the H200, fast mode's file templates (scopes) of exclusive tests were booted
    ahead unclaimed, their file's boot known to make no context; a test of such a scope
    was then the head, and each drained the device for itself (six drains in a
    48-test suite). Gathered like any test that needs its device alone, they run after
    the budgeted tests, in one drain."""
    specs = []
    for i in range(12):
        specs.append(Spec(ev.Test(f"b{i}", need=2 * GiB, file="f.py"), duration=2.0))
        if i % 4 == 3:
            test = ev.Test(f"ex{i}", scope="template t.py", file="t.py", key="t.py")
            specs.append(Spec(test, duration=0.3))
    settings = _settings(defer=True, boots=(("t.py", ""), ("f.py", "")))
    each, gathered = World(settings, specs), World(replace(settings, gather=32), specs)
    first, second = each.run(), gathered.run()
    for result in (first, second):
        assert result.stuck == [] and result.ends == {s.test.id: ["replay"] for s in specs}
    alone = [s.test.id for s in specs if s.test.scope]
    budgeted = [s.test.id for s in specs if not s.test.scope]
    assert min(gathered.went[a] for a in alone) >= max(gathered.went[b] for b in budgeted)
    assert second.time < first.time, (first.time, second.time)


def test_a_child_booted_ahead_gives_its_claim_back_when_x_stops_the_run() -> None:
    """With -x, a test whose child cannot start stops the run; a child booted ahead for
    the next test in the same step cannot start either and is dismissed: it must not
    keep its claim on the device. Found by the property test (a claim left with no
    holder): the simulator told a failed start only after the step, unlike the driver,
    which tells it in the feed that started the child, and drained before it came."""
    settings = _settings(
        capacity=(("0", None),),
        per_gpu=1,
        jobs=1,
        lookahead=2,
        defer=True,
        boots=(("file0", ""),),
    )
    specs = [
        Spec(ev.Test(tid, key=f"file{i}", file=f"file{i}"), duration=0.0, fate="start-fail")
        for i, tid in enumerate(("first", "second"))
    ]
    result = World(settings, specs, maxfail=1).run()
    pool = result.dispatcher.pool
    assert [c.token for d in pool.ids for c in pool.held(d)] == []


def test_tests_that_keep_several_cores_busy_take_as_many_job_slots() -> None:
    """A test an earlier run measured keeping cores busy takes the job slots of those
    cores: two such tests never run at once, nor beside light ones beyond the slots
    (``World`` fails on that), while light tests still fill the slots; one that needs more
    slots than the run has runs alone, and every test ends."""
    specs = [Spec(ev.Test(f"heavy{i}", need=GiB, slots=3), duration=1.0) for i in range(2)]
    specs += [Spec(ev.Test(f"light{i}", need=GiB), duration=1.0) for i in range(4)]
    specs += [Spec(ev.Test("huge", need=GiB, slots=9), duration=1.0)]
    world = World(_settings(jobs=4), specs)
    result = world.run()
    assert sorted(result.ends) == sorted(s.test.id for s in specs)
    went = world.went

    def beside(a: str, b: str) -> bool:
        return went[a] < went[b] + 1.0 and went[b] < went[a] + 1.0

    assert not beside("heavy0", "heavy1")
    assert len({went[f"light{i}"] for i in range(4)}) < 4  # light ones ran side by side
    assert [t for t in went if t != "huge" and beside(t, "huge")] == []


@pytest.mark.parametrize("ordered", [True, False])
def test_a_stop_reports_nothing_that_pytest_would_not_reach(ordered: bool) -> None:
    """Issue 43: with recorded durations, short tests ran (backfilled) while the
    exclusive test before them waited for the long one; one failed first, and ``-x``
    stopped after it, then reported the exclusive test's failure too ("stopping after 2
    failures"). In-process, the exclusive test fails and stops the session: nothing after
    it is reached. The backfilled failure now runs again in its order (it never does: the
    session stopped before it); ordered (``Settings.ordered``, as the driver sets it under
    ``-x``), the tests end to pytest in its order, so the stop comes at the exclusive test
    and what ended after it is dropped; the world checks nothing is told after the stop."""
    specs = _drain_behind_a_long_test(recorded=True)
    specs[1] = replace(specs[1], fate="fail")  # the exclusive test
    specs[2] = replace(specs[2], fate="fail")  # short0, backfilled
    world = World(_settings(backfill=4, ordered=ordered), specs, maxfail=1)
    result = world.run()
    if not ordered:
        # The pause after a failure taken out: what ended is still told in pytest's
        # order, so nothing after the stop is reported (the world checks it), but
        # short0's failure, told in the same batch, counts too.
        assert result.ends["short1"] == ["drop"]
        return
    assert result.dispatcher.stopped_after == "exclusive"
    assert world.failures == 1
    assert result.ends == {
        "long": ["replay"],
        "exclusive": ["replay"],
        **{f"short{i}": ["drop"] for i in range(4)},
    }


@pytest.mark.parametrize("gather", [32, 0])
def test_a_test_that_ran_out_of_order_and_failed_runs_again_after_those_before_it(
    gather: int,
) -> None:
    """Issue 43: an order-dependent suite (the third test reads what the exclusive one
    before it writes). Gathering passed over the exclusive test while the long one held
    the device, the reader ran first and failed. A test that ran out of its order and
    failed runs again once every test before it has ended (spawned, with its own need),
    and only that run counts; without gathering nothing runs out of order and nothing runs again."""

    def test(tid: str, need: int | None, seconds: float, first: str = "") -> Spec:
        plan = ev.Test(tid, need=need, file="f.py")
        return Spec(plan, duration=seconds, needs_first=first)

    specs = [
        test("long", 2 * GiB, 3.0),
        test("exclusive", None, 0.5),
        test("reader", 2 * GiB, 0.2, first="exclusive"),
        test("after", 2 * GiB, 0.2),
    ]
    world = World(_settings(gather=gather), specs)
    result = world.run()
    assert result.stuck == [] and world.failures == 0
    assert set(result.ends) == {s.test.id for s in specs}
    if not gather:
        assert world.agains == []
        return
    assert world.in_order == ["reader"]
    # Its counted run started after every test before it had ended, with its own need
    # (its budget is the test's own, not the guess).
    assert world.went["reader"] >= world.went["exclusive"] + 0.5
    assert world.needs["reader"] == 2 * GiB


def test_no_test_before_a_failure_waiting_to_be_told_is_gathered() -> None:
    """Found by the properties (issue 43's ordered stops): under ``-x``, a test that
    needs both devices alone was passed over (gathered) while a child started while
    collecting held one of them idle; a later test crashed, and its failure waited to be
    told until the gathered test had ended, while every test after it waited behind that
    failure: nothing could move. While a failure waits to be told, nothing is gathered."""

    def test(tid: str, count: int, file: str, fate: str = "pass") -> Spec:
        scope = "scope a" if file == "filescope a" else ""
        plan = ev.Test(tid, count=count, scope=scope, key=file, file=file)
        return Spec(plan, duration=0.0, fate=fate)

    specs = [
        test("t0", 1, "filescope a"),
        test("t1", 1, "file1"),
        test("t2", 2, "file2"),
        test("t3", 1, "file0", fate="crash"),
        test("t4", 1, "file1"),
        test("t5", 1, "file2"),
        test("t6", 1, "filescope a"),
        test("t7", 1, "file1"),
        test("t8", 0, "file2"),
        test("t9", 1, "file0"),
    ]
    settings = _settings(
        devices=("0", "1"),
        capacity=(("0", None), ("1", None)),
        per_gpu=1,
        jobs=1,
        lookahead=0,
        early=2,
        exit_grace=2.0,
        kill_grace=1.0,
        settle=3.0,
        ordered=True,
        gather=32,
    )
    world = World(settings, specs, maxfail=1, expect=(("file0", 1, None), ("file0", 1, None)))
    result = world.run()
    assert result.stuck == []
    assert result.dispatcher.stopped_after == "t3"


def test_a_batch_is_performed_in_one_order_by_the_driver_and_the_simulator():
    """A child booted ahead is started after the tests that go now; one that another
    action of the batch names is started where it stands. The driver started every
    child booted ahead last, the simulator in the batch's order: a ``Dismiss`` of a
    child started in the same batch was performed before its start, and lost."""
    ahead = ev.Start(1, Kind.SPAWN, ("0",), test="a")
    going = ev.Start(2, Kind.SPAWN, ("0",), test="b")
    dismissed = ev.Start(3, Kind.SPAWN, ("0",), test="c")
    batch_ = [ahead, going, dismissed, ev.Go(2, "b"), ev.Dismiss(3)]
    assert batch.performed(batch_) == [going, dismissed, ev.Go(2, "b"), ev.Dismiss(3), ahead]


def test_a_process_given_up_after_a_kill_holds_no_job_slot():
    """A timed-out child that outlives its kill is given up (and reported), and the next
    test starts: the world's job-slot check counted it on, and called that unsafe (found
    by the property suite beside CPU hogs)."""
    settings = ev.Settings(jobs=1, per_gpu=1, exit_grace=2.0, kill_grace=1.0, settle=3.0)
    specs = [
        Spec(ev.Test("t0", need=None, timeout=1.5, key="f0", file="f0"), 3.0, 0.1, "unkillable"),
        Spec(ev.Test("t1", need=None, key="f1", file="f1"), 0.0, 0.1, "linger"),
    ]
    result = World(settings, specs).run()
    assert result.ends == {"t0": ["report:TIMEOUT"], "t1": ["replay"]}


def test_a_killed_process_holds_no_job_slot_while_it_dies():
    """A timed-out test's child is sent SIGKILL and its test reported: from then on it
    runs none of the test's code, so the next test may take its job slot (its devices
    stay held until it has exited or is given up). The world's job-slot check counted
    a killed process that had not yet died, and called that unsafe (found by the
    property suite beside CPU hogs)."""
    gib = 2**30
    settings = ev.Settings(
        devices=("0",), capacity=(("0", 16 * gib),), jobs=2, per_gpu=2, kill_grace=1.0
    )
    specs = [
        Spec(ev.Test("t0", need=2 * gib, timeout=1.5, key="f0", file="f0"), 3.0, 0.1, "unkillable"),
        # A scope's child stays after its first test: it holds its slots until its last.
        Spec(ev.Test("t1", need=2 * gib, slots=2, scope="a", key="fa", file="fa"), 1.0, 0.1),
        Spec(ev.Test("t2", need=2 * gib, slots=2, scope="a", key="fa", file="fa"), 1.0, 0.1),
    ]
    result = World(settings, specs).run()
    assert result.ends == {"t0": ["report:TIMEOUT"], "t1": ["replay"], "t2": ["replay"]}


def test_a_test_that_dies_in_a_fork_runs_again_spawned_once() -> None:
    """Issue 56: a test that crashes (or hangs) only in a fork, standing in for a library
    whose import-time state is not fork-safe, was reported as the fork's crash on every
    run and never run spawned. A death in a fork is evidence against the fork: the test
    runs again in a child of its own (with its own need), once; the template goes on
    with the file's next test. A death there counts."""
    scope = "scope f"
    specs = [
        Spec(ev.Test("dies", scope=scope, forked=True, file="f"), fate="crash"),
        Spec(ev.Test("next", scope=scope, forked=True, file="f")),
    ]
    result = World(_settings(), specs).run()
    again = [a for a in result.actions if isinstance(a, ev.Again)]
    assert again == [ev.Again("dies", alone=False)]
    assert result.ends == {"dies": ["report:CRASHED"], "next": ["replay"]}
