"""The packing policy as pure logic: budgets, the reserve, the per-device cap, learning."""

from __future__ import annotations

import time

import pytest

from spawnrun.devices import _packing
from spawnrun.devices._packing import ALONE
from spawnrun.devices._packing import RESERVE

GiB = 2**30


def pool(capacity: int | None = 10 * GiB, per_gpu: int = 8, ids: int = 1) -> _packing.Pool:
    names = tuple(str(i) for i in range(ids))
    return _packing.Pool(names, {n: capacity for n in names}, per_gpu)


@pytest.mark.parametrize(
    "value, size",
    [
        ("6GiB", 6 * GiB),
        ("6 gib", 6 * GiB),
        ("500MB", 500 * 10**6),
        ("1.5GiB", int(1.5 * GiB)),
        ("2G", 2 * 10**9),
        ("512MiB", 512 * 2**20),
        (6, 6 * GiB),
        (0.5, GiB // 2),
        ("3", 3 * GiB),
    ],
)
def test_sizes_read_binary_and_decimal_units(value, size):
    assert _packing.parse_size(value, "here") == size


@pytest.mark.parametrize("value", ["lots", -1, 0, "0GiB", "6 parsecs", True, None, [], "nan"])
def test_a_malformed_size_names_its_source(value):
    with pytest.raises(pytest.UsageError, match="^test_x: expected a memory size"):
        _packing.parse_size(value, "test_x")


def test_budgets_share_a_device_as_long_as_they_and_their_reserves_fit():
    p = pool(capacity=10 * GiB)
    # 4 GiB + 1 GiB reserve each: two fit in 10 GiB, a third does not.
    for token in ("a", "b"):
        assert p.choose(1, 4 * GiB) == ["0"]
        p.take(["0"], 4 * GiB, token)
    assert p.choose(1, 4 * GiB) is None
    assert p.choose(1, 1) is None  # 10 GiB - 2 x (4 + 1) leaves nothing
    p.give_back(["0"], "a")
    assert p.choose(1, 4 * GiB) == ["0"]


def test_the_reserve_counts_per_process():
    p = pool(capacity=4 * GiB + 4 * RESERVE)
    for token in "abcd":
        assert p.fits("0", GiB)
        p.take(["0"], GiB, token)
    assert not p.fits("0", 1)


def test_alone_means_nobody_else_on_the_device():
    p = pool()
    p.take(["0"], GiB, "small")
    assert not p.fits("0", ALONE)  # an exclusive test waits for the device to empty
    p.give_back(["0"], "small")
    p.take(["0"], ALONE, "big")
    assert not p.fits("0", GiB)  # and nothing joins it
    assert p.idle() == []


def test_the_cap_on_tests_per_device():
    p = pool(capacity=1000 * GiB, per_gpu=3)
    for token in "abc":
        p.take(["0"], GiB, token)
    assert not p.fits("0", GiB)


def test_free_memory_must_cover_a_budget_beside_neighbours():
    p = pool(capacity=80 * GiB)
    assert p.fits("0", 8 * GiB, free=GiB)  # alone on it: as an unbudgeted test would run
    p.take(["0"], 8 * GiB, "a")
    # Another process took most of the device: the ledger has room, the device not.
    assert not p.fits("0", 8 * GiB, free=4 * GiB)
    assert p.fits("0", 8 * GiB, free=9 * GiB + RESERVE)


def test_unknown_capacity_runs_a_budget_alone():
    p = pool(capacity=None)
    assert p.fits("0", GiB)
    p.take(["0"], GiB, "a")
    assert not p.fits("0", GiB)


def test_a_budget_that_fits_the_device_alone_is_never_refused_an_empty_one():
    # 9.5 GiB + the reserve exceed 10 GiB, but alone it gets the whole device.
    p = pool(capacity=10 * GiB)
    assert p.fits("0", int(9.5 * GiB))
    assert not p.fits("0", 11 * GiB)


def test_devices_are_chosen_least_loaded_first():
    p = pool(capacity=80 * GiB, ids=3)
    p.take(["0"], GiB, "a")
    p.take(["1"], 2 * GiB, "b")
    assert p.choose(1, GiB) == ["2"]
    p.take(["2"], 3 * GiB, "c")
    assert p.choose(1, GiB) == ["0"]  # all hold one: the least budget held
    assert p.choose(2, GiB) == ["0", "1"]
    assert p.choose(1, GiB, among=["2"]) == ["2"]
    assert p.choose(1, GiB, among=[]) is None  # no candidates is not every device
    assert p.choose(1, ALONE) is None


def test_learned_budgets_add_a_margin_and_stay_alone_when_large():
    budget, why = _packing.learned_need(GiB, 80 * GiB)
    assert budget is not None and GiB * 1.25 < budget <= GiB * 1.25 + 300 * 2**20
    assert why == ""
    # A vLLM engine's 60 GiB: never packed.
    need, why = _packing.learned_need(60 * GiB, 80 * GiB)
    assert need is ALONE and "large share" in why
    assert _packing.learned_need(GiB, None)[0] is ALONE


@pytest.mark.parametrize("cpus, gpus, expected", [(2, 1, 2), (16, 1, 8), (16, 8, 2), (64, 4, 8)])
def test_default_per_gpu_follows_the_cores_per_gpu(cpus, gpus, expected):
    assert _packing.default_per_gpu(cpus, gpus) == expected


def test_children_sharing_a_device_create_contexts_a_few_at_a_time(tmp_path):
    from spawnrun.child import _budget

    prefix = str(tmp_path / "init")
    with _budget._few_at_a_time(prefix, 2), _budget._few_at_a_time(prefix, 2):
        # Both slots held: a third waits its bound, then goes on without one.
        start = time.monotonic()
        with _budget._few_at_a_time(prefix, 2, limit=0.2):
            waited = time.monotonic() - start
        assert 0.2 <= waited < 2
    start = time.monotonic()
    with _budget._few_at_a_time(prefix, 2, limit=5):
        assert time.monotonic() - start < 1  # free again once the others are done
    with _budget._few_at_a_time("", 2), _budget._few_at_a_time(prefix, 0):
        pass  # no lock asked for: nothing to wait for
