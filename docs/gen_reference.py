"""Rewrite the settings table in docs/guide/configuration.md from spawnrun/config/_table.py.

Run it from anywhere: ``python docs/gen_reference.py``. The table lies between the
page's settings-table markers; ``tests/test_docs.py`` fails while the page's table is
not what ``spawnrun.config._settings.reference_table()`` renders from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "guide" / "configuration.md"
START = "<!-- settings-table:start -->"
END = "<!-- settings-table:end -->"


def render(text: str) -> str:
    """The page's text with the block between the markers replaced by the table."""
    from spawnrun.config._settings import reference_table

    head, start, rest = text.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"{PAGE}: no {START} ... {END} block")
    return f"{head}{START}\n{reference_table()}{END}{tail}"


def main() -> int:
    # The working tree's spawnrun, installed or not.
    sys.path.insert(0, str(ROOT))
    text = PAGE.read_text()
    new = render(text)
    if new == text:
        print(f"{PAGE.relative_to(ROOT)}: up to date")
    else:
        PAGE.write_text(new)
        print(f"{PAGE.relative_to(ROOT)}: settings table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
