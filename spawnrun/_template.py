"""A template: the child that collected a file forks a fresh process for each of its tests.

Runs in a test's child (``ChildSpec.fork_each``, fast mode's default for a file with
several tests that run alone) and in the processes it forks. The child has configured
pytest and collected the file, as any child does; it runs none of the tests itself. For
each ``Go`` it forks; the fork sets up every fixture its test needs, runs it, tears
everything down (``nextitem=None``), says "done" and exits, as a child of its own would.
A fork that dies ends the template the same way (signal or exit code), so the parent
reports the test as a child's crash and the file's other tests go on in a fresh
template. Forking is refused where the collection left the process unsafe to fork (the
template rules of ``_zygote``): the child then runs its one test itself and ends.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any
from typing import NoReturn

import pytest

from spawnrun import _child
from spawnrun import _probe
from spawnrun import _protocol as proto


def fork_each(relay: Any, item: Any, then: list[Any], by_id: dict[str, Any]) -> None:
    """A template: fork a fresh process for each test, from what is collected here.

    Nothing of a test runs in the template: each fork sets up every fixture it needs
    and tears all of them down (``nextitem=None``), as a child of its own would, and
    says "done" itself. A fork that dies ends the template the same way, so its
    test's report is a child's crash report and the rest go on in a fresh template.
    """
    forks = 0
    while True:
        forks += 1
        _fork_test(relay, item, bool(then), forks)
        if not then:
            break
        found = relay._await_go(by_id)
        if found is None:
            break
        then = then[then.index(found) + 1 :] if found in then else []
        item = found
    relay.done = True  # the forks said "done"; what follows is told as After


def _fork_test(relay: Any, item: Any, more: bool, serial: int) -> None:
    if relay.sink is not None:
        relay.sink.flush()
        relay.terminal_from = os.path.getsize(relay.sink.current)
    sys.stdout.flush()
    sys.stderr.flush()
    template = os.getpid()
    pid = os.fork()
    if pid == 0:
        _forked(relay, item, more, serial, template)
    # A timeout's stack dump is asked of this process: the test's is the fork's.
    # (faulthandler reinstalls its handler only when it was unregistered first.)
    faulthandler.unregister(_child.DUMP_SIGNAL)
    signal.signal(_child.DUMP_SIGNAL, lambda *_: _signal_quietly(pid, _child.DUMP_SIGNAL))
    _, status = os.waitpid(pid, 0)  # retried after the handler (PEP 475)
    signal.signal(_child.DUMP_SIGNAL, signal.SIG_DFL)
    faulthandler.register(_child.DUMP_SIGNAL, file=relay.stacks, all_threads=True, chain=False)
    if os.WIFSIGNALED(status):
        _die_by(os.WTERMSIG(status))
    code = os.waitstatus_to_exitcode(status)
    if code:
        os._exit(code)


def _forked(relay: Any, item: Any, more: bool, serial: int, template: int) -> NoReturn:
    try:
        _probe.die_with_parent(template)
        # Its stacks are the test's: where the template's would go (it forwards the
        # parent's request), not among the processes below the test.
        faulthandler.register(_child.DUMP_SIGNAL, file=relay.stacks, all_threads=True, chain=False)
        relay.send(proto.ForkedTest(os.getpid()))
        _own_basetemp(item.config, serial)
        relay.current = item.nodeid
        try:
            relay._run(item, None)
        except (KeyboardInterrupt, pytest.exit.Exception):
            _child.leave(0)  # told (Interrupted, Done): the parent ends the session
        if more:
            relay._done_for_now()
        else:
            relay.finish()
    except BaseException:  # noqa: BLE001 - the template ends with it: a crash report
        traceback.print_exc()
        _child.leave(70)
    _child.leave(0)


def _own_basetemp(config: Any, serial: int) -> None:
    """A forked test's own base for ``tmp_path``, as each spawned child has one.

    pytest keeps the session's temporary-directory factory on the config, with no
    public way to point it elsewhere: its given base is replaced before any test of
    this process asks for it.
    """
    factory = getattr(config, "_tmp_path_factory", None)
    base = getattr(config.option, "basetemp", None)
    if factory is not None and base:
        factory._given_basetemp = Path(os.path.abspath(f"{base}-{serial}"))
        factory._basetemp = None


def _signal_quietly(pid: int, signum: int) -> None:
    with contextlib.suppress(OSError):  # it just ended
        os.kill(pid, signum)


def _die_by(signum: int) -> NoReturn:
    """End this process by the signal that ended its fork (the parent tells which)."""
    faulthandler.disable()  # the fork's stacks are written; none of ours
    with contextlib.suppress(OSError, ValueError):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal that does not end a process by default
