#!/usr/bin/env python3
"""Regenerate docs/settings.md's table of every ``COLDSNAP_*`` variable from the registry
(``coldsnap/settings.py``), between ``<!-- settings table -->`` and ``<!-- end -->``.
tests/unit/test_settings.py compares the page with :func:`table`, so a stale page fails the tests.

    python scripts/docs-settings.py           rewrite the table
    python scripts/docs-settings.py --check   exit 1 when it is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "settings.md"
START, END = "<!-- settings table -->", "<!-- end -->"
sys.path.insert(0, str(ROOT))


def table() -> str:
    from coldsnap.settings import SETTINGS

    rows = ["| variable | type | default | read by | flag | what it does |", "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        kind = f"{s.kind}: {' / '.join(s.choices)}" if s.choices else s.kind
        rows.append(f"| `{s.name}` | {kind} | {s.default} | {', '.join(s.readers)} | {f'`{s.flag}`' if s.flag else ''} "
                    f"| {s.what} |")
    return "\n".join(rows)


def rendered(page: str) -> str:
    head, _, rest = page.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main() -> int:
    page = PAGE.read_text()
    new = rendered(page)
    if "--check" in sys.argv[1:]:
        if new != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: python scripts/docs-settings.py", file=sys.stderr)
            return 1
        return 0
    if new != page:
        PAGE.write_text(new)
        print(f"rewrote: {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
