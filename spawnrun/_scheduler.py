"""Dispatch spawned tests onto free devices, several at a time, and replay them as they end.

Runs in the parent. Policy, in full:

* Tests are dispatched in collection order. A spawned test's turn comes when pytest
  reaches it; it then waits until a slot (``--spawn-jobs``) and the number of devices
  it asks for (``@pytest.mark.gpu(count=N)``, default 1) are free, while the children
  already running go on and are replayed as they finish. Later tests wait behind it, so
  a large request is never starved by a stream of small ones; the price is that devices
  can idle while a large request waits for the last of them. Grouping multi-GPU tests
  (for example in one module) keeps that rare.
* In-process tests run in the main process as usual, between dispatches; the running
  children carry on meanwhile.
* When pytest reaches the last test, every child is waited for, so the session's exit
  status counts all of them. On ``-x``/``--maxfail`` nothing more is dispatched and the
  children still running are killed and reported as skipped with the reason.
* Under pytest-xdist each worker runs one child at a time and the workers share the
  devices through a file ledger (see ``_devices.Ledger``).
"""

from __future__ import annotations

import time
from multiprocessing.connection import wait
from typing import Any

import pytest

from spawnrun import _devices
from spawnrun import _replay

STOPPED = (
    "spawnrun: stopped while running, because the session stopped (-x, --maxfail or an interrupt)"
)
#: How often a test waiting for devices held by another process looks again.
_LEDGER_POLL = 0.05


class Scheduler:
    def __init__(
        self,
        allocator: _devices.Allocator,
        limit: int,
        settle: float | None,
    ) -> None:
        self.allocator = allocator
        self.limit = limit
        self.settle = settle
        self.running: list[_replay.Job] = []
        self.devices: dict[int, list[str]] = {}
        self.baselines: dict[int, dict[str, int] | None] = {}
        #: (node id, seconds) of waits for device memory longer than a second.
        self.long_settles: list[tuple[str, float]] = []

    def submit(
        self,
        item: pytest.Item,
        nextitem: pytest.Item | None,
        timeout: float | None,
        count: int,
        hide_devices: bool,
    ) -> None:
        parent_error = _replay.parent_teardown(item, nextitem)
        while True:
            if item.session.shouldfail or item.session.shouldstop:
                return  # as pytest: nothing new starts once the session is stopping
            devices = self.allocator.take(count) if len(self.running) < self.limit else None
            if devices is not None:
                break
            if self.running:
                self.pump(block=True)
            else:
                time.sleep(_LEDGER_POLL)  # devices are held by another xdist worker
        env = {}
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        elif hide_devices:
            env["CUDA_VISIBLE_DEVICES"] = ""
        job = _replay.Job(item, timeout, env, parent_error)
        if devices:
            job.replay.properties.append(("spawnrun_devices", ",".join(devices)))
        self.devices[id(job)] = devices
        self.baselines[id(job)] = _devices.used_memory(devices) if devices and self.settle else None
        try:
            job.start()
        except BaseException:
            self._release(job)
            raise
        self.running.append(job)

    def pump(self, block: bool) -> None:
        """Handle what the children said; replay the tests that ended, in that order."""
        if not self.running:
            return
        waitables: dict[Any, _replay.Job] = {}
        for job in self.running:
            assert job.child is not None
            waitables[job.child.conn] = job
            waitables[job.child.proc.sentinel] = job
        timeout: float | None = 0.0
        if block:
            deadlines = [j.deadline for j in self.running if j.deadline is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ready = wait(list(waitables), timeout)
        for job in {id(waitables[r]): waitables[r] for r in ready}.values():
            while not job.done:
                assert job.child is not None
                msg = job.child.recv(0)
                if msg is None:
                    break
                job.on_message(msg)
        now = time.monotonic()
        for job in self.running:
            if not job.done and job.deadline is not None and now >= job.deadline:
                job.on_timeout()
        finished = [j for j in self.running if j.done]
        self.running = [j for j in self.running if not j.done]
        for job in finished:
            self._release(job)
        for job in finished:
            job.replay_and_raise()

    def drain(self) -> None:
        while self.running:
            self.pump(block=True)

    def abort(self) -> None:
        """The session stops: end every child, report each test as stopped."""
        jobs, self.running = self.running, []
        for job in jobs:
            job.abort(STOPPED)
            self._release(job)
        for job in jobs:
            job.replay.emit(job.parent_error)

    def kill_all(self) -> None:
        """Last resort (an exception is unwinding): end every child, report nothing."""
        jobs, self.running = self.running, []
        for job in jobs:
            if job.child is not None:
                job.child.kill()
                job.child.finish()
            self._release(job)

    def _release(self, job: _replay.Job) -> None:
        devices = self.devices.pop(id(job), [])
        baseline = self.baselines.pop(id(job), None)
        if baseline and self.settle:
            waited = _devices.settle(baseline, self.settle)
            if waited > 1.0:
                self.long_settles.append((job.item.nodeid, waited))
        if devices:
            self.allocator.give_back(devices)
