"""Demo conftest: sets the parent up the way a GPU project's conftest often does.

Loaded by the pytest parent and again by every spawned child (each child is a new
interpreter that rebuilds the session), so anything parent-only is guarded.
"""

from __future__ import annotations

import os

import fakedevice
import pytest

import spawnrun

#: The model examples have their own dependencies, pytest.ini and README: run them as
#: `pytest examples/models`, not as part of this demo.
collect_ignore = ["models"]

#: Holds the pytest parent's pid; spawned children inherit it through the environment.
PARENT_PID_ENV = "SPAWNRUN_EXAMPLES_PARENT_PID"

# Like a conftest that touches CUDA at import time: the device is now live in this
# process, so a *forked* child of it could not use the device. Spawned children
# import this module afresh and get a device of their own.
fakedevice.init()


def pytest_configure(config: pytest.Config) -> None:
    # Only the parent records its pid: a child must not overwrite it with its own.
    if not spawnrun.is_child():
        os.environ[PARENT_PID_ENV] = str(os.getpid())


def pytest_unconfigure(config: pytest.Config) -> None:
    # Leave the parent's environment as we found it.
    if not spawnrun.is_child():
        os.environ.pop(PARENT_PID_ENV, None)
