"""Properties of the dispatcher over generated suites and event orders (the simulator).

Each example is a random suite (devices, budgets, scopes, templates, early children,
xdist peers, -x) whose simulated children boot, run, crash, linger, refuse and exit at
random times. ``World.run`` itself fails on a hang (nothing due while pytest waits) and on
every safety breach (a device over its capacity or cap, a test alone with company, a go
to a child that is not ready, a scope's tests out of order); the properties below add
what must hold at the end.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from sim.world import FATES
from sim.world import Spec
from sim.world import World

from spawnrun.dispatch import events as ev
from spawnrun.dispatch.state import PEER

GiB = 1 << 30
FATE_WEIGHTS = ["pass"] * 8 + ["fail"] * 2 + list(FATES)


@st.composite
def scenarios(draw: st.DrawFn, drain: bool = False) -> World:
    """A random suite. ``drain``: it opens with a long budgeted test and an alone one
    behind it, and later tests are mostly recorded, so that backfilling is exercised."""
    ndev = draw(st.integers(1, 3))
    devices = tuple(str(i) for i in range(ndev))
    capacity = draw(st.sampled_from([None, 16 * GiB, 80 * GiB]))
    config = ev.Settings(
        devices=devices,
        capacity=tuple((d, capacity) for d in devices),
        per_gpu=draw(st.integers(1, 4)),
        reserve=GiB,
        jobs=draw(st.integers(1, 4)),
        lookahead=draw(st.integers(0, 3)),
        early=draw(st.integers(0, 2)),
        exit_grace=2.0,
        kill_grace=1.0,
        settle=3.0,
        poll=0.5,
        patience=50.0,
        defer=draw(st.booleans()),
        backfill=draw(st.sampled_from([1, 4] if drain else [0, 0, 1, 4])),
        gather=draw(st.sampled_from([0, 0, 1, 3, 32])),
    )
    if drain:
        config = replace(config, jobs=max(config.jobs, 2))
    files = ["file0", "file1", "file2", "filescope a", "filescope b", "filetpl x", "filetpl y"]
    touches = {f: draw(st.sampled_from(["", "", ev.DRIVER, ev.CONTEXT])) for f in files}
    # What an earlier run saw of some files (true: a file that changed is booted anew).
    known = draw(st.sets(st.sampled_from(files)))
    config = replace(config, boots=tuple((f, touches[f]) for f in sorted(known)))
    n = draw(st.integers(1, 12))
    specs = []
    for i in range(n):
        grouping = draw(st.sampled_from(["", "", "", "scope a", "scope b", "tpl x", "tpl y"]))
        scope = grouping if grouping.startswith("scope") else ""
        template = grouping if grouping.startswith("tpl") else ""
        count = draw(st.sampled_from([1, 1, 1, 0, 2]))
        need = draw(st.sampled_from([None, None, 2 * GiB, 4 * GiB, 40 * GiB]))
        timeout = draw(st.sampled_from([None, None, None, 1.5, 4.0]))
        seconds = draw(st.sampled_from([0.0, 0.2, 1.0, 3.0]))
        # What an earlier run measured: nothing, the truth, or a record far off.
        records = [None, seconds, seconds, seconds * 3, seconds / 4]
        recorded = draw(st.sampled_from(records[1:3] * 3 + records if drain else records))
        test = ev.Test(
            f"t{i}",
            count=min(count, ndev),
            need=need,
            every=draw(st.booleans()) and draw(st.booleans()) and draw(st.booleans()),
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
                boot=draw(st.sampled_from([0.1, 0.5, 2.0])),
                fate=draw(st.sampled_from(FATE_WEIGHTS)),
                release=draw(st.sampled_from([0.0, 0.0, 0.5, 5.0])),
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
                st.sampled_from([0.0, 1.0, 3.0]),
                st.sampled_from([2.0, 6.0]),
                st.sampled_from(devices),
                st.sampled_from([None, 2 * GiB]),
            ).filter(lambda p: p[0] < p[1]),
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
    maxfail = draw(st.sampled_from([0, 0, 1, 2]))
    return World(
        replace(config, ordered=maxfail > 0),
        specs,
        maxfail=maxfail,
        expect=expect,
        peers=tuple(peers),
        peer_lag=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])),
        told_next=draw(st.booleans()),
        template_refuses=frozenset(draw(st.sets(st.sampled_from(["tpl x", "tpl y"])))),
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


SETTINGS = settings(
    max_examples=1500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(scenarios())
def test_every_test_ends_once_and_nothing_is_stuck(world: World) -> None:
    _every_test_ends_once_and_nothing_is_stuck(world)


@SETTINGS
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


@SETTINGS
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

    @settings(max_examples=300, deadline=None, database=None)
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
