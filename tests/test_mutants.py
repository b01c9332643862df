"""Each bug of ``tests/sim/mutants.py`` is caught by the dispatcher's properties.

A mutant is a known bug (one exact edit of a copy of ``spawnrun/``); it runs against the
properties of ``test_dispatch_properties.py`` in a fresh interpreter, with a bounded,
derandomized example budget and no shrinking, and must fail one of them. A mutant that
survives shows a hole in the properties (a case test that catches it does not count).
"""

from __future__ import annotations

import pytest
from sim import mutants


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_the_properties_kill_the_mutant(mutant: mutants.Mutant) -> None:
    killed = mutants.check(mutant)
    assert killed, f"{mutant.name} ({mutant.why}) survived every property"
    assert killed.split(":")[0].startswith("test_"), killed


def test_every_mutant_edits_the_source_as_it_is() -> None:
    """An edit whose text is gone (the code moved on) must be written anew, not skipped."""
    for mutant in mutants.MUTANTS:
        text = (mutants.ROOT / mutant.module).read_text()
        assert text.count(mutant.old) == 1, mutant.name
