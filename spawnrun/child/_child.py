"""The spawn child's process: rebuild the parent's pytest configuration, run its test.

Runs in the child only. The parent starts ``main`` through ``multiprocessing``'s spawn
context; the zygote's template calls it in each child it forks, and a configured
template (``_configured``) configures pytest here once (``configured``) and hands each
fork its test (``take_over``). What serves the test once pytest is configured is the
relay's (``_relay``): it finds the test, waits for the go, streams the reports.

Life: boot (configure, collect, find the node id) -> ``Booted`` -> wait for ``Go`` ->
setup/call/teardown, each report streamed as soon as pytest logs it -> ``Done`` -> exit.
The child's devices (``CUDA_VISIBLE_DEVICES``) are in its environment from its start.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any
from typing import NoReturn

import pytest

from spawnrun.child import _availability
from spawnrun.child import _budget
from spawnrun.child import _collection
from spawnrun.child import _environ
from spawnrun.child import _jaxcache
from spawnrun.child import _metadata
from spawnrun.child import _stackhook
from spawnrun.child import _streams
from spawnrun.child import _template
from spawnrun.child import _threadwatch
from spawnrun.child._leave import leave
from spawnrun.child._relay import Relay
from spawnrun.child._relay import arm_faulthandler
from spawnrun.proc import _bytecode
from spawnrun.proc import _coverage
from spawnrun.proc import _main
from spawnrun.proc import _probe
from spawnrun.wire import _orders
from spawnrun.wire import _replies

#: On the configuration of the session this process runs its test in (``_configure``
#: made it): the plugin then leaves running tests to pytest instead of spawning again.
#: Another session in the same process (the test's own ``pytester.runpytest()``) is a
#: pytest process of its own to the plugin, as it would be in-process: not a flag of the
#: process, which that session would inherit.
OWN = pytest.StashKey[bool]()


def owns(config: pytest.Config) -> bool:
    """Whether ``config`` is this child's own session's (not one its test started)."""
    return config.stash.get(OWN, False)


def main(
    spec: _orders.ChildSpec, conn: Connection, forked: bool = False, parent: int | None = None
) -> NoReturn:
    _bytecode.start()  # forked: the template's environment was replaced by the test's
    _streams.arm()  # a file's template here forks its tests with what they seeded
    _threadwatch.arm()  # and names the import that started a thread, if one refuses
    # Measured from the start, before the suite's conftests and modules are imported.
    _coverage.start(spec.coverage, forked)
    # Before any of the suite's code: its budget caps torch when its CUDA comes up.
    _budget.install()
    _jaxcache.install()
    relay = isolate(spec, conn, parent)
    os.chdir(spec.invocation_dir)
    relay.undo = _while_booting(spec)
    try:
        config = _configure(spec, spec.args, relay)
        code = config.hook.pytest_cmdline_main(config=config)
        _ended(relay, code)
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        _failed(relay)
    relay.finish()
    leave(0)


def _configure(spec: _orders.ChildSpec, args: list[str], relay: Relay) -> Any:
    """pytest configured as the parent's, to collect ``args``, with ``relay`` plugged in."""
    config = _from_dict_args(spec.option_dict, [*spec.plugin_args, *args], spec.plugin_args)
    # The conftests are loaded now: values of their types decode to their classes.
    for name, data in spec.late_options.items():
        setattr(config.option, name, pickle.loads(data))
    if spec.workerinput is not None:
        # The xdist worker this test runs for, as its plugins and fixtures see it.
        config.workerinput = dict(spec.workerinput)  # type: ignore[attr-defined]
    config.pluginmanager.register(relay, "spawnrun-child")
    return config


#: Fresh pytest configurations made in a template before it forks, one per plugin
#: arguments (``prebuild``): each fork takes its copy instead of making its own.
_PREBUILT: dict[tuple[str, ...], pytest.Config] = {}


def prebuild(plugin_args: list[str]) -> None:
    """In a template, before it forks children that configure pytest: make the part of
    their configuration that is the same for all of them (``get_config``: the plugin
    manager with pytest's own plugins registered, ``-p no:`` applied), once.

    A fork of the library template configures pytest itself (every configured
    template is unsafe where a conftest initializes a device at import): measured on
    two cores, a fork's CPU went from ~40 ms to ~36 ms and its page faults from ~5,100
    to ~4,900 with it. pytest's own ``Config.fromdictargs`` starts with the same call,
    so the configuration is the one it would make; its invocation arguments and
    directory are the fork's own (``_from_dict_args``)."""
    key = tuple(plugin_args)
    if key not in _PREBUILT:
        _PREBUILT[key] = _get_config(list(plugin_args))


def _get_config(args: list[str]) -> pytest.Config:
    """pytest's ``get_config``, which ``Config.fromdictargs`` calls first; internal to
    pytest (8.0 to 9.2 alike), hence here alone."""
    from _pytest.config import get_config

    return get_config(args)


def _from_dict_args(
    option_dict: dict[str, Any], args: list[str], plugin_args: list[str]
) -> pytest.Config:
    """``pytest.Config.fromdictargs(option_dict, args)``, from the configuration the
    template made ahead where there is one (used once: it is this process's copy),
    marked as this child's own (``OWN``) before anything asks."""
    config = _PREBUILT.pop(tuple(plugin_args), None)
    if config is None:
        config = _get_config(args)
    else:  # as get_config(args) would have made them, here and now
        config.invocation_params = dataclasses.replace(
            config.invocation_params, args=tuple(args), dir=Path.cwd()
        )
    # Before its initial conftests load (``parse``): ``_headstart`` asks then.
    config.stash[OWN] = True
    config.option.__dict__.update(option_dict)
    config.parse(args, addopts=False)
    for name in config.option.plugins:
        config.pluginmanager.consider_pluginarg(name)
    return config


def _ended(relay: Relay, code: Any) -> None:
    if not relay.booted:
        # pytest ended before the test was even looked for: an error in a hook at
        # configure or collection time (INTERNALERROR), told to the child's own
        # terminal reporter. Its words are the cause: send them.
        relay.send(_replies.Booted(os.getpid(), False, relay.ended_early(code), failed=True))
        relay.booted = True


def _failed(relay: Relay) -> None:
    if not relay.booted:
        relay.send(
            _replies.Booted(
                os.getpid(),
                False,
                "error while starting pytest in the child:\n" + traceback.format_exc(),
                failed=True,
            )
        )
    elif not relay.interrupted:
        relay.notes.append("error in the child after the test:\n" + traceback.format_exc())


def configured(spec: _orders.ChildSpec, serving: Any) -> NoReturn:
    """A configured template (``_configured``): configure pytest as ``main`` does, with
    the parent's own arguments, and start the session; ``serving`` forks each test where
    the session would collect. Returns only in a fork, whose session then ends here as
    a child's does (``take_over`` made it the test's child)."""
    _bytecode.start()  # no budget here: each fork installs its own, once
    own = os.path.join(
        os.path.dirname(os.path.dirname(spec.stacks_path)), f"template-{os.getpid()}"
    )
    os.makedirs(own, exist_ok=True)
    stacks = open(os.path.join(own, "stacks.txt"), "w")  # noqa: SIM115 - the process's
    # Its own stacks, terminal file and base temp: never its first test's.
    options = dict(spec.option_dict, basetemp=os.path.join(own, "tmp"))
    spec = dataclasses.replace(spec, stacks_path=stacks.name, option_dict=options)
    relay = Relay(spec, None, stacks)  # type: ignore[arg-type]
    os.chdir(spec.invocation_dir)
    relay.undo = _while_booting(spec)
    config = _configure(spec, spec.run_args, relay)
    config.pluginmanager.register(serving, "spawnrun-configured")
    try:
        code = config.hook.pytest_cmdline_main(config=config)
    except BaseException:  # noqa: BLE001 - in a fork: told to the parent
        if not serving.forked:
            raise
        _failed(relay)
    else:
        _ended(relay, code)
    relay.finish()
    leave(0)


def take_over(
    config: Any, spec: _orders.ChildSpec, conn: Connection, parent: int, streams: list[int]
) -> None:
    """A configured template's fork becomes the test's child: what ``main`` and
    ``isolate`` do before pytest collects, with the test's spec. ``streams``: the
    parent's stdout and stderr, with -s."""
    relay: Relay = config.pluginmanager.get_plugin("spawnrun-child")
    relay.conn = conn
    relay.spec = spec
    _bytecode.start()  # the test's environment replaced the template's
    _budget.install()
    _jaxcache.install()
    _probe.die_with_parent(parent)
    os.setsid()
    # pytest's capture of the template held files every fork would share (one offset;
    # the template ended it): each fork captures into files of its own, around its own
    # output streams.
    capture = config.pluginmanager.get_plugin("capturemanager")
    _output_to(spec.log_path, streams)
    directory = os.path.dirname(spec.stacks_path)
    _name_capture_files(directory)
    if capture is not None:
        capture.start_global_capturing()
    relay.stacks = open(spec.stacks_path, "w")  # noqa: SIM115 - lives as long as the process
    arm_faulthandler(relay.stacks)
    _stackhook.install(directory)
    if relay.sink is not None:
        relay.sink.reopen(os.path.join(directory, "terminal.log"))
    relay.current = spec.nodeid
    relay.wanted = _collection.wanted_paths(spec.args, spec.invocation_dir)
    config.args = list(spec.args)
    config.option.basetemp = spec.option_dict.get("basetemp")
    if config.option.basetemp:
        _template.point_basetemp(config, config.option.basetemp)


def _output_to(log_path: str | None, streams: list[int]) -> None:
    """stdout and stderr to the child's log, or (-s) to the parent's ``streams``."""
    if log_path is not None:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        streams = [fd, fd]
    for target, stream in zip((1, 2), streams, strict=False):
        os.dup2(stream, target)
    for stream in set(streams):
        os.close(stream)


def isolate(spec: _orders.ChildSpec, conn: Connection, parent: int | None = None) -> Relay:
    """Make this process a test's own: session, output, crash stacks, capture buffers."""
    _probe.die_with_parent(parent)
    # Own session and process group: the parent can kill everything the test
    # started with one killpg, and a Ctrl-C at the terminal reaches only the parent.
    os.setsid()
    _output_to(spec.log_path, [])
    stacks = open(spec.stacks_path, "w")  # noqa: SIM115 - lives as long as the process
    arm_faulthandler(stacks)
    # And every Python process the test starts, for the stacks of a timeout.
    _stackhook.install(os.path.dirname(spec.stacks_path))
    _name_capture_files(os.path.dirname(spec.stacks_path))
    return Relay(spec, conn, stacks)


def _name_capture_files(directory: str) -> None:
    """Give pytest's fd-capture buffers names in the child's work directory.

    pytest captures a test's output into anonymous temporary files, which vanish
    with a crashed child; named ones let the parent show what the test printed just
    before it died. ``_pytest.capture`` imports ``TemporaryFile`` by name and offers
    no public way to choose the buffer, hence this one patch.
    """
    import _pytest.capture

    serial = iter(range(1_000_000))

    def named(buffering: int = -1, **_: Any) -> Any:
        path = os.path.join(directory, f"capture-{next(serial)}.out")
        return open(path, "w+b", buffering=buffering)  # noqa: SIM115

    _pytest.capture.TemporaryFile = named  # type: ignore[attr-defined, assignment]


def _while_booting(spec: _orders.ChildSpec) -> list[Callable[[], None]]:
    """What a child arranges while it boots, each undone before its test: the parent's
    CUDA answers while it collects, the template's package metadata while pytest is
    configured, a watch on whether its boot read its device mask, and ``__main__``
    settled as complete as the parent's."""
    return [
        _availability.while_collecting(spec.cuda_available, spec.torch_config),
        _metadata.while_configuring(),
        _environ.observing_boot(),
        _main.settle,
    ]
