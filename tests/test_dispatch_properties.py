"""Properties of the dispatcher over generated suites and event orders (the simulator).

Each example is a random suite (devices, budgets, scopes, templates, early children,
xdist peers, -x) whose simulated children boot, run, crash, linger, refuse and exit at
random times. ``World.run`` itself fails on a hang (nothing due while pytest waits) and on
every safety breach (a device over its capacity or cap, a test alone with company, a go
to a child that is not ready, a scope's tests out of order); the properties below add
what must hold at the end.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

import pytest
from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from sim.world import FATES
from sim.world import Spec
from sim.world import World

from spawnrun.dispatch import Dispatcher
from spawnrun.dispatch import batch
from spawnrun.dispatch import events as ev
from spawnrun.dispatch.state import PEER

GiB = 1 << 30
T = TypeVar("T")
#: NVML's release after a child's exit: at once, soon, past ``settle``, or never.
RELEASES = [0.0, 0.0, 0.5, 5.0, math.inf, math.inf]
FATE_WEIGHTS = ["pass"] * 8 + ["fail"] * 2 + list(FATES)


_STRATEGIES: dict[object, st.SearchStrategy[object]] = {}


def _pick(draw: st.DrawFn, options: Sequence[T]) -> T:
    """``draw(st.sampled_from(options))``, its strategy made once (making strategies
    afresh for every draw took most of the suite's time)."""
    key = ("pick", tuple(options))
    if key not in _STRATEGIES:
        _STRATEGIES[key] = st.sampled_from(tuple(options))
    return draw(_STRATEGIES[key])  # type: ignore[return-value]


def _ints(draw: st.DrawFn, low: int, high: int) -> int:
    key = ("ints", low, high)
    if key not in _STRATEGIES:
        _STRATEGIES[key] = st.integers(low, high)
    return draw(_STRATEGIES[key])  # type: ignore[return-value]


@st.composite
def scenarios(
    draw: st.DrawFn,
    drain: bool = False,
    edges: bool = False,
    dispatcher: Callable[[ev.Settings], Dispatcher] = Dispatcher,
) -> World:
    """A random suite. ``drain``: it opens with a long budgeted test and an alone one
    behind it, and later tests are mostly recorded, so that backfilling is exercised.
    ``edges``: few tests, other workers holding devices for long (while nothing else
    may wake the dispatcher), NVML releases that come late or never. ``dispatcher``:
    the class the world drives."""
    ndev = _ints(draw, 1, 3)
    devices = tuple(str(i) for i in range(ndev))
    capacity = _pick(draw, [None, 16 * GiB, 80 * GiB])
    config = ev.Settings(
        devices=devices,
        capacity=tuple((d, capacity) for d in devices),
        per_gpu=_ints(draw, 1, 4),
        reserve=GiB,
        jobs=_ints(draw, 1, 4),
        lookahead=_ints(draw, 0, 3),
        early=_ints(draw, 0, 2),
        exit_grace=2.0,
        kill_grace=1.0,
        settle=3.0,
        poll=0.5,
        patience=50.0,
        defer=draw(st.booleans()),
        backfill=_pick(draw, [1, 4] if drain else [0, 0, 1, 4]),
        gather=_pick(draw, [0, 0, 1, 3, 32]),
    )
    if drain:
        config = replace(config, jobs=max(config.jobs, 2))
    files = ["file0", "file1", "file2", "filescope a", "filescope b", "filetpl x", "filetpl y"]
    touches = {f: _pick(draw, ["", "", ev.DRIVER, ev.CONTEXT]) for f in files}
    # What an earlier run saw of some files (true: a file that changed is booted anew).
    known = draw(st.sets(st.sampled_from(files)))
    config = replace(config, boots=tuple((f, touches[f]) for f in sorted(known)))
    n = _ints(draw, 1, 5 if edges else 12)
    specs = []
    # A scope's tests need the same devices and budget (``_plan._scope_plan``): one
    # child holds them for all.
    shared: dict[str, tuple[int, int | None, bool]] = {}
    for i in range(n):
        grouping = _pick(draw, ["", "", "", "scope a", "scope b", "tpl x", "tpl y"])
        scope = grouping if grouping.startswith("scope") else ""
        template = grouping if grouping.startswith("tpl") else ""
        count = _pick(draw, [1, 1, 1, 0, 2])
        need = _pick(draw, [None, None, 2 * GiB, 4 * GiB, 40 * GiB])
        every = draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans())
        if scope:
            count, need, every = shared.setdefault(scope, (count, need, every))
        timeout = _pick(draw, [None, None, None, 1.5, 4.0])
        seconds = _pick(draw, [0.0, 0.2, 1.0, 3.0])
        # What an earlier run measured: nothing, the truth, or a record far off.
        records = [None, seconds, seconds, seconds * 3, seconds / 4]
        recorded = _pick(draw, records[1:3] * 3 + records if drain else records)
        test = ev.Test(
            f"t{i}",
            count=min(count, ndev),
            need=need,
            every=every,
            scope=scope,
            forked=scope == "scope b",  # a file's template, as the driver hands it over
            template=template,
            timeout=timeout,
            duration=recorded,
            key=f"file{grouping or i % 3}",
            file=f"file{grouping or i % 3}",
        )
        specs.append(
            Spec(
                test,
                duration=seconds,
                boot=_pick(draw, [0.1, 0.5, 2.0]),
                fate=_pick(draw, FATE_WEIGHTS),
                # NVML's release: at once, late, past ``settle``, or never.
                release=_pick(draw, RELEASES[2:] if edges else RELEASES),
                touches=touches[test.file],
            )
        )
    if drain:
        head = [
            Spec(
                ev.Test(tid, need=need, duration=seconds, file="file0", key="file0"),
                seconds,
                touches=touches["file0"],
            )
            for tid, need, seconds in (("long", 2 * GiB, 8.0), ("alone", None, 1.0))
        ]
        specs = head + specs
    peers = draw(
        st.lists(
            st.tuples(
                st.sampled_from([0.0, 0.3] if edges else [0.0, 1.0, 3.0]),
                st.sampled_from([4.0, 12.0] if edges else [2.0, 6.0]),
                st.sampled_from(devices),
                st.sampled_from([None, 2 * GiB]),
            ).filter(lambda p: p[0] < p[1]),
            min_size=int(edges),
            max_size=2,
        )
    )
    if peers:  # xdist: children claim through the ledger at their start (never deferred)
        config = replace(config, defer=False, backfill=0, gather=0)
    expect = tuple((f"file{k}", 1, None) for k in draw(st.lists(st.sampled_from("012"))))
    # Job slots by measured CPU load (drawn last: the draws before keep their examples).
    slots = draw(
        st.lists(st.sampled_from([1, 1, 1, 2, 5]), min_size=len(specs), max_size=len(specs))
    )
    specs = [replace(s, test=replace(s.test, slots=n)) for s, n in zip(specs, slots, strict=True)]
    # A failure that may stop the session orders what pytest is told, as the driver
    # does (``Units.stops``).
    maxfail = _pick(draw, [0, 0, 1, 2])
    return World(
        replace(config, ordered=maxfail > 0),
        specs,
        maxfail=maxfail,
        expect=expect,
        peers=tuple(peers),
        peer_lag=_pick(draw, [0.0, 0.0, 0.05, 0.3]),
        told_next=draw(st.booleans()),
        template_refuses=frozenset(draw(st.sets(st.sampled_from(["tpl x", "tpl y"])))),
        dispatcher=dispatcher,
    )


def _serial_bound(world: World) -> float:
    """Running every test one after another, each with every overhead it can have."""
    s = world.settings
    per_test = [
        spec.boot + spec.duration + s.exit_grace + s.kill_grace + s.settle + 2.0
        for spec in world.specs.values()
    ]
    peers = sum(end - start + world.peer_lag + 0.2 for start, end, _, _ in world.peers)
    return sum(per_test) + peers + 3 * 1.5


#: The examples each property draws are few enough that the suite runs in well under a
#: minute on two loaded cores (CI). ``SPAWNRUN_SIM_SCALE`` multiplies them for a deeper
#: run; ``tests/sim/mutants.py`` sets ``SPAWNRUN_SIM_EXAMPLES``: that budget for every
#: property, derandomized (the same examples each run), no database, no shrinking.
_BUDGET = int(os.environ.get("SPAWNRUN_SIM_EXAMPLES", "0"))
_SCALE = float(os.environ.get("SPAWNRUN_SIM_SCALE", "1"))
SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    **(
        dict(derandomize=True, database=None, phases=(Phase.explicit, Phase.generate))
        if _BUDGET
        else {}
    ),
)


def _examples(n: int) -> settings:
    """``SETTINGS`` with ``n`` examples (scaled), or the mutant check's budget."""
    return settings(SETTINGS, max_examples=_BUDGET or max(1, int(n * _SCALE)))


@_examples(300)
@given(scenarios())
def test_every_test_ends_once_and_nothing_is_stuck(world: World) -> None:
    _every_test_ends_once_and_nothing_is_stuck(world)


@_examples(200)
@given(scenarios(drain=True))
def test_backfilling_keeps_every_test_ending_once_and_nothing_stuck(world: World) -> None:
    _every_test_ends_once_and_nothing_is_stuck(world)


def _every_test_ends_once_and_nothing_is_stuck(world: World) -> None:
    result = world.run()
    submitted = result.dispatcher.submitted
    for test in submitted:
        assert len(result.ends.get(test, [])) == 1, (test, result.ends.get(test))
    assert set(result.ends) <= set(submitted)
    assert result.stuck == []
    after = result.dispatcher.stopped_after
    if after:  # as in-process, what pytest reached before the stopping test ran and reported
        earlier = submitted[: submitted.index(after)]
        assert [t for t in earlier if result.ends[t] == ["drop"]] == []
    if not result.stopped:
        assert len(submitted) == len(world.specs)
        assert "drop" not in {how for hows in result.ends.values() for how in hows}
    assert result.time <= _serial_bound(world)
    # A claim always has a holder: once every child is gone, only peers' claims remain.
    pool = result.dispatcher.pool
    assert {c.token for d in pool.ids for c in pool.held(d)} <= {PEER}


@_examples(200)
@given(scenarios())
def test_each_fate_gets_its_report(world: World) -> None:
    result = world.run()
    if result.stopped:
        return
    warned = {test for test, _ in result.warnings}
    # A scope's later test runs in a child started for another: its boot is not its own.
    started_for = {p.test for p in result.procs.values()}
    for tid, spec in world.specs.items():
        (how,) = result.ends[tid]
        timeout = spec.test.timeout
        if not result.dispatcher.can_ever_fit(spec.test):
            assert how == "report:UNFIT", (tid, spec)
        elif spec.fate in ("start-fail", "boot-die") and tid in started_for:
            assert how == "report:START_FAILED", (tid, spec)
        elif timeout is not None and spec.duration >= timeout:
            expected = (
                "report:CRASHED"
                if spec.fate == "crash" and spec.duration / 2 <= timeout
                else "report:TIMEOUT"
            )
            assert how == expected, (tid, spec)
        elif spec.fate == "crash":
            assert how == "report:CRASHED", (tid, spec)
        elif spec.fate in ("start-fail", "boot-die"):
            assert how == "replay", (tid, spec)
        else:
            assert how == "replay", (tid, spec)
        if spec.fate == "exit-3" and how == "replay" and not spec.test.scope:
            assert tid in warned, (tid, result.warnings)
        if spec.fate in ("linger", "unkillable") and how == "replay" and not spec.test.scope:
            assert tid in warned, (tid, result.warnings)
        if spec.fate == "guess" and how == "replay" and (not spec.test.scope or spec.test.forked):
            # A failure a guess may have caused: it ran again, alone, once.
            assert world.needs[tid] is None, (tid, world.needs)
            assert world.agains.count(tid) <= 1, world.agains


@pytest.mark.parametrize("jobs", [1, 4])
def test_the_generator_reaches_every_fate(jobs: int) -> None:
    """A guard for the properties: the suites they draw do exercise each kind of end."""
    fates = set()

    @settings(max_examples=150, deadline=None, database=None)
    @given(scenarios())
    def collect(world: World) -> None:
        fates.update(spec.fate for spec in world.specs.values())

    collect()
    assert fates == set(FATES)


def test_the_generator_exercises_gathering() -> None:
    """A guard for the properties: some drawn suites pass over tests that need their
    devices alone while their devices are busy (``Settings.gather``)."""
    gathered = []

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(scenarios())
    def collect(world: World) -> None:
        if not world.settings.gather or world.settings.backfill:
            return
        result = world.run()
        entries = result.dispatcher.tests.values()
        gathered.extend(e.test.id for e in entries if e.passed and e.test.need is None)

    collect()
    assert len(gathered) >= 10, gathered


# The properties the design claims, each over suites drawn to reach its edge ---------


@st.composite
def near_memory(draw: st.DrawFn) -> World:
    """Budgeted tests that overlap on devices whose memory fits a few of them, where the
    reserve per process decides how many (a capacity of a whole number of GiB against
    budgets of 1 to 3 GiB and a 1 GiB reserve)."""
    ndev = _ints(draw, 1, 2)
    devices = tuple(str(i) for i in range(ndev))
    capacity = _ints(draw, 3, 14) * GiB + _pick(draw, [0, GiB // 2])
    config = ev.Settings(
        devices=devices,
        capacity=tuple((d, capacity) for d in devices),
        per_gpu=8,
        reserve=GiB,
        jobs=_ints(draw, 4, 8),
        lookahead=_ints(draw, 0, 2),
        exit_grace=2.0,
        kill_grace=1.0,
        settle=3.0,
        poll=0.5,
        defer=draw(st.booleans()),
    )
    specs = []
    for i in range(_ints(draw, 4, 10)):
        need = _pick(draw, [GiB, 2 * GiB, 3 * GiB, 2 * GiB, None])
        test = ev.Test(f"t{i}", need=need, file=f"file{i % 2}", key=f"file{i % 2}")
        specs.append(
            Spec(
                test,
                duration=_pick(draw, [2.0, 4.0]),
                boot=_pick(draw, [0.1, 0.5]),
                fate=_pick(draw, ["pass", "pass", "pass", "fail", "linger"]),
                release=_pick(draw, [0.0, 0.5, math.inf]),
            )
        )
    return World(config, specs)


@_examples(150)
@given(near_memory())
def test_packing_near_memory_is_safe(world: World) -> None:
    """Devices near their memory never hold more than it (budgets and a reserve per
    process), by the world's count of processes, and every test ends once."""
    result = world.run()
    assert sorted(result.ends) == sorted(world.specs)
    assert all(len(hows) == 1 for hows in result.ends.values()), result.ends


@st.composite
def shadow_suites(draw: st.DrawFn) -> tuple[World, World]:
    """The same suite with backfilling on and off, where records and boots are true (a
    file's children boot in the same time, each test's record is its duration, nothing
    fails, NVML releases at once): long budgeted tests hold every device, a test that
    needs them alone waits behind them, and later tests, some short enough to backfill
    and some not, could run beside the holders."""
    ndev = _ints(draw, 1, 2)
    devices = tuple(str(i) for i in range(ndev))
    config = ev.Settings(
        devices=devices,
        capacity=tuple((d, 80 * GiB) for d in devices),
        per_gpu=4,
        reserve=GiB,
        jobs=_ints(draw, 2, 4),
        exit_grace=2.0,
        kill_grace=1.0,
        settle=3.0,
        poll=0.5,
        backfill=4,
    )
    boots = {f: _pick(draw, [0.1, 0.5, 1.0]) for f in ("file0", "file1", "file2")}

    def spec(tid: str, need: int | None, seconds: float, file: str, count: int = 1) -> Spec:
        test = ev.Test(tid, count=count, need=need, duration=seconds, file=file, key=file)
        return Spec(test, duration=seconds, boot=boots[file])

    specs = [spec("holder", 2 * GiB, _pick(draw, [4.0, 8.0]), "file0", ndev)]
    specs.append(spec("warm", 2 * GiB, 0.1, "file1"))  # boots file1 early: its time is known
    specs.append(spec("head", None, 1.0, "file2", _ints(draw, 1, ndev)))
    for i in range(_ints(draw, 2, 8)):
        need = _pick(draw, [GiB, 2 * GiB, 2 * GiB, None])
        seconds = _pick(draw, [0.2, 1.0, 3.0, 12.0])
        specs.append(spec(f"t{i}", need, seconds, _pick(draw, ["file0", "file1"])))
    on = World(config, specs)
    off = World(replace(config, backfill=0), [replace(s) for s in specs])
    return on, off


@_examples(120)
@given(shadow_suites())
def test_backfilling_never_delays_the_head(worlds: tuple[World, World]) -> None:
    """Every test that a later test overtook (the head backfilling went past, or one
    passed with it) starts no later than it does in the same suite without backfilling,
    where pytest waits at the head: what is backfilled ends within the head's shadow.
    True where the records are (this suite's are exact; a record far off may delay it)."""
    on, off = worlds
    on.run()
    off.run()
    order = list(on.specs)
    overtaken = {
        test
        for at, test in enumerate(order)
        if any(on.went[later] < on.went[test] for later in order[at + 1 :])
    }
    late = {t: (on.went[t], off.went[t]) for t in overtaken if on.went[t] > off.went[t] + 1e-6}
    assert not late, f"backfilling delayed {late} (with, without)"


@_examples(150)
@given(scenarios(edges=True))
def test_every_wait_has_a_wake_up(world: World) -> None:
    """Few tests beside other workers that hold devices for long, and children whose
    NVML release comes late or never: the world fails (``Late``) where a child waits
    with no deadline and no event coming, or a test waits beside a peer's claim and the
    dispatcher is not fed within ``poll``; the run still ends with every test once."""
    _every_test_ends_once_and_nothing_is_stuck(world)


@st.composite
def packable(draw: st.DrawFn) -> World:
    """Independent tests that all fit at once (small budgets, the cap above the slots
    and children booted ahead), so that only the job slots bound how many run."""
    ndev = _ints(draw, 1, 2)
    devices = tuple(str(i) for i in range(ndev))
    touches = {f: _pick(draw, ["", ev.DRIVER, ev.CONTEXT]) for f in ("f0", "f1")}
    known = draw(st.sets(st.sampled_from(sorted(touches))))
    config = ev.Settings(
        devices=devices,
        capacity=tuple((d, 80 * GiB) for d in devices),
        per_gpu=8,
        reserve=GiB,
        jobs=_ints(draw, 1, 4),
        lookahead=_ints(draw, 0, 3),
        exit_grace=2.0,
        kill_grace=1.0,
        settle=3.0,
        defer=draw(st.booleans()),
        boots=tuple((f, touches[f]) for f in sorted(known)),
    )
    specs = []
    for i in range(_ints(draw, 1, 12)):
        file = _pick(draw, sorted(touches))
        test = ev.Test(
            f"t{i}",
            count=_pick(draw, [0, 1, 1, ndev]),
            need=_pick(draw, [GiB, 2 * GiB, 4 * GiB]),
            file=file,
            key=file,
        )
        duration = _pick(draw, [0.1, 0.5, 1.0, 3.0])
        specs.append(Spec(test, duration, boot=_pick(draw, [0.1, 0.5, 1.0]), touches=touches[file]))
    return World(config, specs)


@_examples(150)
@given(packable())
def test_wall_time_is_within_a_factor_of_the_lower_bound(world: World) -> None:
    """Graham's bound for list scheduling: no schedule ends before the work (each test's
    boot and run) over the job slots, nor before the longest test (the lower bound);
    the dispatcher, which starts every test that may start, ends within their sum
    (at most twice the lower bound), plus the last child's exit."""
    result = world.run()
    work = [s.boot + s.duration for s in world.specs.values()]
    lower = max(sum(work) / world.settings.jobs, max(work))
    bound = sum(work) / world.settings.jobs + max(work)
    assert bound <= 2 * lower
    assert result.time <= bound + 0.1, (result.time, bound)


def _driver_order(actions: list[ev.Action]) -> list[tuple[str, object]]:
    """The order the driver's ``Performer`` performs a batch in (its handlers record)."""
    from spawnrun.driver._perform import Performer

    done: list[tuple[str, object]] = []
    performer = object.__new__(Performer)
    for name in ("_start", "_go", "_kill", "_report"):
        setattr(performer, name, lambda a: done.append(_key(a)))
    kinds = {
        "_dismiss": "Dismiss",
        "_replay_test": "Replay",
        "_again_alone": "Again",
        "_drop_test": "Drop",
        "_warn": "Warn",
    }
    for name, kind in kinds.items():
        setattr(performer, name, lambda x, *_, kind=kind: done.append((kind, x)))
    performer._interrupt = lambda: done.append(("Interrupt", None))  # type: ignore[method-assign]
    Performer._perform(performer, actions)
    return done


def _key(action: ev.Action) -> tuple[str, object]:
    kind = type(action).__name__
    if kind == "Interrupt":
        return kind, None
    return kind, getattr(action, "child", None) or getattr(action, "test", None)


@_examples(60)
@given(scenarios())
def test_the_driver_performs_a_batch_in_the_simulators_order(world: World) -> None:
    """The simulator and the driver perform each batch of the dispatcher's actions in
    the same order (``dispatch.batch.performed``)."""
    world.record = True
    world.run()
    for actions, performed in world.batches:
        assert _driver_order(actions) == [_key(a) for a in performed], actions


class _NoPreemption(Dispatcher):
    """A dispatcher that leaves idle holders in place: the head can then wait for a
    device that nothing will free (a scope's idle child, a child booted ahead)."""

    def _preempt(self, head: ev.Test) -> None:
        pass


@_examples(100)
@given(scenarios(dispatcher=_NoPreemption))
def test_a_wait_nothing_can_end_is_reported(world: World) -> None:
    """Whatever brings it about (here: idle holders never dismissed), a head that no
    child or timer can let start is reported as one that could not be run, with what it
    waited for, and the run goes on: never a hang."""
    result = world.run()
    submitted = result.dispatcher.submitted
    assert all(len(result.ends.get(t, [])) == 1 for t in submitted), result.ends
    for test in result.stuck:
        (report,) = [a for a in result.actions if isinstance(a, ev.Report) and a.test == test]
        assert "nothing could start this test" in report.detail


def _actions() -> st.SearchStrategy[list[ev.Action]]:
    child = st.integers(1, 4)
    action = st.one_of(
        st.builds(lambda c: ev.Start(c, ev.Kind.SPAWN, ("0",), f"t{c}"), child),
        st.builds(lambda c: ev.Go(c, f"t{c}"), child),
        st.builds(ev.Dismiss, child),
        st.builds(lambda c: ev.Kill(c, "timeout"), child),
        st.builds(lambda c: ev.Replay(f"t{c}"), child),
    )
    return st.lists(action, max_size=8)


@_examples(150)
@given(_actions())
def test_a_batch_is_performed_with_goes_first_and_starts_in_place(
    actions: list[ev.Action],
) -> None:
    """``batch.performed``, the order the driver and the simulator share: the same
    actions; a test that may go now goes before children for later tests are started;
    an action that names a child started earlier in the batch still finds it started;
    every other action keeps its place in the order."""
    done = batch.performed(actions)
    assert sorted(map(repr, done)) == sorted(map(repr, actions))
    names = (ev.Go, ev.Dismiss, ev.Kill)
    named = {a.child for a in actions if isinstance(a, names)}
    at = {id(a): i for i, a in enumerate(done)}
    for i, a in enumerate(actions):
        for b in actions[i + 1 :]:
            if isinstance(a, ev.Start) and isinstance(b, names) and b.child == a.child:
                assert at[id(a)] < at[id(b)], (a, b, done)  # it finds its child started
            if isinstance(a, ev.Start) and a.child not in named and isinstance(b, ev.Go):
                assert at[id(b)] < at[id(a)], (a, b, done)  # the go first
    kept = [a for a in actions if not isinstance(a, ev.Start) or a.child in named]
    assert [a for a in done if not isinstance(a, ev.Start) or a.child in named] == kept


def test_the_generator_backfills_past_heads() -> None:
    """A guard for the property on the head's shadow: its suites do backfill, so that
    tests overtake the head (it is not true by being empty)."""
    overtaken = []

    @settings(max_examples=60, deadline=None, database=None, derandomize=True)
    @given(shadow_suites())
    def collect(worlds: tuple[World, World]) -> None:
        on, _off = worlds
        result = on.run()
        overtaken.extend(t for t, e in result.dispatcher.tests.items() if e.overtook)

    collect()
    assert len(overtaken) >= 10, overtaken
