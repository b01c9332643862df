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
from spawnrun import _reports

STOPPED = (
    "spawnrun: stopped while running, because the session stopped (-x, --maxfail or an interrupt)"
)
RESTARTED = (
    "spawnrun: booting ahead did not apply to {nodeid}: {runtime} was initialized while its "
    "child booted (a conftest or test module touches the GPU at import), so its devices are "
    "set when its child starts, at its turn, instead"
)
#: How often a test waiting for devices held by another process looks again.
_LEDGER_POLL = 0.05


class Scheduler:
    def __init__(
        self,
        allocator: _devices.Allocator,
        limit: int,
        settle: float | None,
        lookahead: int = 0,
    ) -> None:
        self.allocator = allocator
        self.limit = limit
        self.settle = settle
        self.lookahead = lookahead
        self.running: list[_replay.Job] = []
        #: Jobs booted ahead of their turn, by node id.
        self.ahead: dict[str, _replay.Job] = {}
        self.restart_warned = False
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
        job = self.ahead.pop(item.nodeid, None)
        if job is None:
            job = _replay.Job(item, timeout, env, parent_error)
        else:
            job.parent_error = parent_error
            job.timeout = timeout
            if job.restart and not self.restart_warned:
                self.restart_warned = True
                _warn(item, RESTARTED.format(nodeid=item.nodeid, runtime=job.restart))
        if devices:
            job.replay.properties.append(("spawnrun_devices", ",".join(devices)))
        job.devices = devices
        job.baseline = _devices.used_memory(devices) if devices and self.settle else None
        try:
            if job.child is None:
                job.start()
            else:
                job.dispatch(env)
        except BaseException:
            self._release(job)
            raise
        self.running.append(job)

    def prefetch(self, upcoming: list[tuple[pytest.Item, float | None]]) -> None:
        """Boot children for the next spawned tests (with their timeouts) ahead of time."""
        for item, timeout in upcoming[: self.lookahead]:
            if item.nodeid not in self.ahead and len(self.ahead) < self.lookahead:
                job = _replay.Job(item, timeout)
                job.start()
                self.ahead[item.nodeid] = job

    def pump(self, block: bool) -> None:
        """Handle what the children said; replay the tests that ended, in that order."""
        listening = [
            j
            for j in [*self.running, *self.ahead.values()]
            if not j.done and j.child is not None and j.child.proc is not None
        ]
        waitables: dict[Any, _replay.Job] = {}
        for job in listening:
            assert job.child is not None
            waitables[job.child.conn] = job
            waitables[job.child.proc.sentinel] = job
        timeout: float | None = 0.0
        if block and not any(j.done for j in self.running):
            deadlines = [j.deadline for j in self.running if j.deadline is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ready = wait(list(waitables), timeout) if waitables else []
        for job in {id(waitables[r]): waitables[r] for r in ready}.values():
            while not job.done and job.child is not None and job.child.proc is not None:
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
        self._drop_ahead()
        jobs, self.running = self.running, []
        for job in jobs:
            job.abort(STOPPED)
            self._release(job)
        for job in jobs:
            job.replay.emit(job.parent_error)

    def kill_all(self) -> None:
        """Last resort (an exception is unwinding): end every child, report nothing."""
        self._drop_ahead()
        jobs, self.running = self.running, []
        for job in jobs:
            if job.child is not None:
                job.child.kill()
                job.child.finish()
            self._release(job)

    def _drop_ahead(self) -> None:
        # Children booted for tests that will not run now: end them, report nothing,
        # as pytest reports nothing for tests after a stop.
        jobs, self.ahead = list(self.ahead.values()), {}
        for job in jobs:
            if job.child is not None:
                job.child.kill()
                job.child.finish()

    def _release(self, job: _replay.Job) -> None:
        devices, job.devices = job.devices, []
        baseline, job.baseline = job.baseline, None
        if baseline and self.settle:
            waited = _devices.settle(baseline, self.settle)
            if waited > 1.0:
                self.long_settles.append((job.item.nodeid, waited))
        if devices:
            self.allocator.give_back(devices)


def _warn(item: pytest.Item, text: str) -> None:
    _reports.record_warning(item.config, _reports.warning(text, str(item.path)), item.nodeid)
