"""The launcher's own start: `coldsnap restore DIR --prepare-only` beside a bare interpreter start.

    python -m benchmarks.launcher_start --artifact DIR [--repeat 9] [--out launcher-start.json]

What is timed is what a user's process pays before CRIU can start: the interpreter, coldsnap's imports,
the request, admission. Every command runs as a new process with this interpreter and this environment
(PYTHONPATH included), wall clock from spawn to exit, ``--repeat`` times interleaved, medians reported:

  bare interpreter     ``python -c pass``
  import coldsnap.cli  ``python -c "import coldsnap.cli"`` (what any command imports)
  import pydantic      ``python -c "from pydantic import BaseModel"`` (the contract models' base)
  prepare-only         ``python -m coldsnap restore DIR --prepare-only`` (admission, nothing restored)

and, from one ``python -X importtime`` run of the prepare-only command, the modules it imports, how many
of them are pydantic's, and the import time of the largest. The artifact is only read. Writes ``--out``
(JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import check_artifact, finish

COMMANDS = {
    "bare interpreter": ["-c", "pass"],
    "import coldsnap.cli": ["-c", "import coldsnap.cli"],
    "import pydantic": ["-c", "from pydantic import BaseModel"],
}
_IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)")


def _wall(argv: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-1500:]}")
    return seconds


def imports_of(argv: list[str]) -> dict:
    """The modules one run of ``argv`` (a Python command) imports, from ``-X importtime``."""
    done = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    rows = [(int(m[1]), int(m[2]), len(m[3]) // 2, m[4]) for m in map(_IMPORT_LINE.match, done.stderr.splitlines()) if m]
    top = sorted(((cumulative, name) for _, cumulative, depth, name in rows if depth == 0), reverse=True)
    return {"modules": len(rows), "pydantic_modules": sum(name.split(".")[0] in ("pydantic", "pydantic_core")
                                                          for *_, name in rows),
            "top_level_ms": {name: round(cumulative / 1000, 1) for cumulative, name in top[:8]}}


def measure(artifact: Path, repeat: int, python: str = sys.executable) -> dict:
    commands = {label: [python, *argv] for label, argv in COMMANDS.items()}
    commands["prepare-only"] = [python, "-m", "coldsnap", "restore", str(artifact), "--prepare-only"]
    for argv in commands.values():  # once each before timing: byte-compiled files written, page cache warm
        _wall(argv)
    runs: dict[str, list[float]] = {label: [] for label in commands}
    for _ in range(repeat):  # interleaved: the host's noise falls on every command alike
        for label, argv in commands.items():
            runs[label].append(round(_wall(argv), 4))
    medians = {label: round(statistics.median(values), 4) for label, values in runs.items()}
    bare = medians["bare interpreter"]
    return {"benchmark": "launcher_start", "artifact": str(artifact), "python": python, "repeat": repeat,
            "runs_s": runs, "median_s": medians,
            "prepare_only_over_bare": round(medians["prepare-only"] / bare, 2) if bare else None,
            "prepare_only_imports": imports_of(commands["prepare-only"])}


def table(result: dict) -> str:
    lines = [f"launcher start ({result['repeat']} runs each, median seconds, spawn → exit)"]
    bare = result["median_s"]["bare interpreter"]
    for label, seconds in result["median_s"].items():
        lines.append(f"  {label:22s} {seconds:7.4f}  {seconds / bare:5.1f}× bare")
    imports = result["prepare_only_imports"]
    lines.append(f"  prepare-only imports {imports['modules']} modules, {imports['pydantic_modules']} of them pydantic's")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="a captured artifact directory (only read)")
    parser.add_argument("--repeat", type=int, default=9, help="runs of each command (default 9)")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args()
    check_artifact(parser, args.artifact)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    result = measure(args.artifact, args.repeat)
    return finish(result, args.out, table(result))


if __name__ == "__main__":
    sys.exit(main())
