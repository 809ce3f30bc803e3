#!/usr/bin/env python3
"""Regenerate the ``--help`` blocks of docs/commands/*.md in place.

A block sits between a marker naming the command and an end marker:

    <!-- coldsnap payload verify --help -->
    ```text
    usage: coldsnap payload verify ...
    ```
    <!-- end -->

and holds exactly what ``coldsnap payload verify --help`` prints at COLUMNS=100 (fixed, so the
wrapping does not depend on the terminal). The text comes from the CLI's own parser, in process;
tests/unit/test_docs.py compares every block with the same function, so a stale page fails the tests.

    python scripts/docs-help.py           rewrite the blocks
    python scripts/docs-help.py --check   exit 1, naming the pages, when a block is stale
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ROOT / "docs" / "commands"
COLUMNS = "100"
BLOCK = re.compile(r"<!-- coldsnap (?P<command>[a-z][a-z -]*?) --help -->\n.*?<!-- end -->", re.DOTALL)


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every subcommand parser under ``parser`` (nested ones too, e.g. ``payload verify``), by its words."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[path + (name,)] = sub
                found.update(subcommands(sub, path + (name,)))
    return found


def help_text(parser: argparse.ArgumentParser) -> str:
    """``parser.format_help()`` as a terminal COLUMNS wide prints it (argparse reads the width from COLUMNS)."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        return parser.format_help().rstrip("\n")
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def block(command: str, text: str) -> str:
    return f"<!-- coldsnap {command} --help -->\n```text\n{text}\n```\n<!-- end -->"


def all_help() -> dict[str, str]:
    """``"payload verify"`` → its help text, for every subcommand of ``coldsnap``."""
    sys.path.insert(0, str(ROOT))
    from coldsnap.cli import build_parser

    return {" ".join(path): help_text(sub) for path, sub in subcommands(build_parser()).items()}


def regenerate(page: str, helps: dict[str, str]) -> str:
    """``page`` with every block's text replaced by the command's current help."""
    def replace(match: re.Match[str]) -> str:
        command = match.group("command")
        if command not in helps:
            raise SystemExit(f"docs-help: no command `coldsnap {command}` (known: {', '.join(sorted(helps))})")
        return block(command, helps[command])

    return BLOCK.sub(replace, page)


def main(argv: list[str] | None = None) -> int:
    options = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    options.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale")
    check = options.parse_args(argv).check
    helps = all_help()
    stale = []
    for path in sorted(PAGES.glob("*.md")):
        page = path.read_text()
        new = regenerate(page, helps)
        if new != page:
            stale.append(path.relative_to(ROOT))
            if not check:
                path.write_text(new)
    for path in stale:
        print(f"{'stale' if check else 'rewrote'}: {path}", file=sys.stderr)
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
