#!/usr/bin/env python3
"""Regenerate docs/architecture.md's walk of ``coldsnap restore DIR`` from a traced restore.

The restore runs as ``coldsnap restore DIR`` does (``python -m coldsnap``), with a profile hook on its main
thread that notes the first *function call* into each module of coldsnap's restore path (an import, and what
runs inside one, is not a visit). The page's list, between ``<!-- restore walk -->`` and ``<!-- end -->``, is
that order, each module with the first sentence of its docstring. tests/integration/test_capture_restore.py
restores its capture this way and compares the order with the page, so a walk that changes fails the tests
until the page says so.

    python scripts/docs-restore-walk.py DIR [RESTORE FLAGS...]           restore DIR traced, rewrite the list
    python scripts/docs-restore-walk.py --check DIR [RESTORE FLAGS...]   exit 1 when the page differs

Run it as root with a restorable artifact whose images this host's records vouch for (a ``--prepare-only``
restore records them), so that the fast entry is taken; the restored server is stopped afterwards.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
START, END = "<!-- restore walk -->", "<!-- end -->"

# The restore's own path: its entry, the CLI, the operation runner, activation, the snapshot and the agent's
# client. Leaves every part uses (contracts, settings, timing, progress, payload records) are not steps of it.
WALKED = ("coldsnap.__main__", "coldsnap.cli", "coldsnap.operation", "coldsnap.activation", "coldsnap.snapshot",
          "coldsnap.agent.client", "coldsnap.hydrate")

_TRACER = """
import sys
visited, out = set(), open(sys.argv[1], "w")
walked = tuple(sys.argv[2].split(","))

def importing(frame):
    # whether frame runs inside an import: a module's body below it (but the tracer's own, outermost)
    frame = frame.f_back
    while frame is not None and frame.f_back is not None:
        if frame.f_code.co_name == "<module>":
            return True
        frame = frame.f_back
    return False

def profile(frame, event, arg):
    if event != "call" or not frame.f_code.co_flags & 0x02:  # (CO_NEWLOCALS: a function, not a module or class body)
        return
    name = frame.f_globals.get("__name__", "")
    if name not in visited and name.startswith(walked) and not importing(frame):
        visited.add(name)
        out.write(name + "\\n")
        out.flush()  # (the program ends with os._exit)

sys.argv = ["coldsnap", "restore", *sys.argv[3:]]
sys.setprofile(profile)
from coldsnap.__main__ import main
main()
"""


def traced_walk(argv: list[str]) -> tuple[list[str], dict]:
    """The modules a ``coldsnap restore ARGV`` calls into on its main thread, in order, and its receipt."""
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "walk.txt"
        done = subprocess.run([sys.executable, "-c", _TRACER, str(trace), ",".join(WALKED), *argv,
                               "--receipt-json", "-"], capture_output=True, cwd=ROOT, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode != 0:
            raise SystemExit(f"the traced restore failed ({done.returncode}): {done.stderr.decode()[-3000:]}")
        return trace.read_text().split(), json.loads(done.stdout)


def summary(module: str) -> str:
    """The first sentence of ``module``'s docstring, on one line."""
    doc = (importlib.import_module(module).__doc__ or "").strip()
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".") if first else ""


def listing(walk: list[str]) -> str:
    return "\n".join(f"{index}. `{module}`: {summary(module)}" for index, module in enumerate(walk, start=1))


def page_walk(page: str) -> list[str]:
    """The modules the page's list names, in its order."""
    _, _, rest = page.partition(START)
    block, _, _ = rest.partition(END)
    return [line.split("`")[1] for line in block.splitlines() if line[:1].isdigit() and "`" in line]


def rendered(page: str, walk: list[str]) -> str:
    head, _, rest = page.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{listing(walk)}\n{END}{tail}"


def main(argv: list[str]) -> int:
    check = argv[:1] == ["--check"]
    argv = argv[1:] if check else argv
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    walk, receipt = traced_walk(argv)
    sys.path.insert(0, str(ROOT))
    from coldsnap.snapshot.process_tree import kill_tree

    restored = next((s for s in receipt["timing"]["spans"] if s["name"] == "restore.criu_restore"), {})
    if "pid" in restored.get("attributes", {}):
        kill_tree(restored["attributes"]["pid"])  # (the walk is what was asked for, not the server)
    early = next(s for s in receipt["timing"]["spans"] if s["name"] == "restore.admission.early")
    if early["attributes"].get("decision") != "taken":
        print(f"the fast entry declined ({early['attributes'].get('reason')}): record the images first "
              "(coldsnap restore --prepare-only DIR)", file=sys.stderr)
        return 1
    page = PAGE.read_text()
    if check:
        if page_walk(page) != walk:
            print(f"{PAGE} is stale: the traced walk is\n  " + "\n  ".join(walk), file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(rendered(page, walk))
    print(f"{PAGE}: {len(walk)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
