#!/usr/bin/env python3
"""Regenerate what is written from ``benchmarks/results/``: the folder index (``benchmarks/results/README.md``),
the status tables of ``docs/status.md`` (between ``<!-- status tables -->`` and ``<!-- end -->``) and the
README's measured table (between ``<!-- measured:begin -->`` and ``<!-- measured:end -->``).
tests/unit/test_results_index.py compares the three with :func:`rendered`, so a stale page fails the tests.

Every run is a folder ``YYYY-MM-DD-ENGINE-MACHINE-TOPIC`` with a ``README.md`` whose first line is its title;
a run that carries a headline figure also has a ``figures.json`` (:data:`FIGURE_KEYS`).

    python scripts/docs-results.py           rewrite the three
    python scripts/docs-results.py --check   exit 1 when one is stale
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
STATUS = ROOT / "docs" / "status.md"
README = ROOT / "README.md"
STATUS_MARKERS = ("<!-- status tables -->", "<!-- end -->")
README_MARKERS = ("<!-- measured:begin -->", "<!-- measured:end -->")

sys.path.insert(0, str(ROOT))
from benchmarks.common import RUN_ENGINES, RUN_MACHINES, RUN_NAME as NAME  # noqa: E402

ENGINES = {"vllm": "vLLM", "sglang": "SGLang", "torch-lm": "reference workload", "none": "no engine"}
MACHINES = {"h100": "one H100", "h100x2": "two H100s", "h100x4": "four H100s", "h100x8": "eight H100s",
            "h200": "one H200", "h200x2": "two H200s", "h200x4": "four H200s", "h200x8": "eight H200s",
            "cpu": "the 2-core CPU machine"}
assert tuple(ENGINES) == RUN_ENGINES and tuple(MACHINES) == RUN_MACHINES, "a display name for every engine and machine"

# What one figure in a run's figures.json says; the keys marked * are required.
FIGURE_KEYS = {
    "workload": "* what ran, short: the model and engine version (`8B-shaped Llama, vLLM 0.26`)",
    "metric": "* what was timed (`restore`: `coldsnap restore`'s exec → the canary's match, unless `timed` says "
              "otherwise; `wake`; ...)",
    "value": "* the figure (a median when `runs` > 1)",
    "unit": "* `s`, `ms`, `GB/s`, ...",
    "runs": "* how many runs the figure is the median of",
    "timed": "from where to where, when not the metric's usual span",
    "cold_start": "the engine's own cold start in the same run, same unit (median)",
    "cold_starts": "how many cold starts `cold_start` is the median of (the ratio divides by it; ≥ 3 for a "
                   "headline figure measured from 2026-12-08 on)",
    "headline": "true: the README's measured table shows the newest such figure per engine and machine",
    "changed_since": "the code on the figure's path that changed after the run (the figure is then marked)",
    "note": "anything else a reader of the table needs",
}


@dataclass(frozen=True)
class Run:
    """One folder of benchmarks/results."""

    name: str
    date: str
    engine: str
    machine: str
    topic: str
    title: str
    commit: str
    recorded: str
    figures: tuple[dict, ...] = field(default=())


def runs() -> list[Run]:
    """Every run folder, newest first (same date: by the time its figures were recorded, then by name)."""
    found = []
    for path in sorted(RESULTS.iterdir(), reverse=True):
        match = NAME.match(path.name)
        if not path.is_dir() or not match:
            continue
        readme = path / "README.md"
        title = readme.read_text().splitlines()[0].lstrip("# ").strip() if readme.exists() else ""
        figures_file = path / "figures.json"
        data = json.loads(figures_file.read_text()) if figures_file.exists() else {}
        found.append(Run(path.name, match["date"], match["engine"], match["machine"], match["topic"], title,
                         data.get("commit", ""), data.get("recorded", ""), tuple(data.get("figures", ()))))
    return sorted(found, key=lambda run: (run.date, run.recorded, run.name), reverse=True)


def _number(value: float) -> str:
    return f"{value:g}"


def figure_text(figure: dict) -> str:
    """`1.39 s (median of 3)`."""
    runs_ = figure["runs"]
    return f"{_number(figure['value'])} {figure['unit']}" + (f" (median of {runs_})" if runs_ > 1 else " (one run)")


def cold_start_text(figure: dict) -> str:
    """`67.3 s, 48.4× (÷ 1 cold start)`, or a dash when the run had no cold start."""
    if "cold_start" not in figure:
        return "—"
    n = figure["cold_starts"]
    ratio = figure["cold_start"] / figure["value"]
    return (f"{_number(figure['cold_start'])} {figure['unit']} → **{ratio:.1f}×** "
            f"(÷ {'the median of ' + str(n) + ' cold starts' if n > 1 else '1 cold start'})")


def note_text(figure: dict) -> str:
    parts = []
    if figure.get("timed"):
        parts.append(f"timed {figure['timed']}")
    if figure.get("changed_since"):
        parts.append(f"**code path changed since:** {figure['changed_since']}")
    if figure.get("note"):
        parts.append(figure["note"])
    return "; ".join(parts)


def index(all_runs: list[Run]) -> str:
    rows = ["| date | engine | machine | run | what ran | headline figures |", "|---|---|---|---|---|---|"]
    for run in all_runs:
        figures = "; ".join(f"{f['metric']} {figure_text(f)}" + (f", {cold_start_text(f)}" if "cold_start" in f else "")
                            for f in run.figures)
        rows.append(f"| {run.date} | {ENGINES[run.engine]} | {MACHINES[run.machine]} | [{run.topic}]({run.name}/) "
                    f"| {run.title} | {figures} |")
    keys = "\n".join(f"- `{key}`: {what}" for key, what in FIGURE_KEYS.items())
    return f"""# Benchmark results, run by run

<!-- generated by scripts/docs-results.py from the folders below; do not edit by hand -->

One folder per run, named `YYYY-MM-DD-ENGINE-MACHINE-TOPIC`: the date of the run (its first result's commit),
the engine (`vllm`, `sglang`, `torch-lm` for the reference workload `coldsnap.workloads.torch_lm`, `none` when
no engine ran), the machine (`cpu` for this project's 2-core CPU machine, `h100`, `h200`, `h200x2` for two H200s of
one host, and so on) and what it measured. Each folder's `README.md` says what ran, the command, the code it ran and its
figures; a run with a headline figure also has a `figures.json`, from which `scripts/docs-results.py` writes this
index, the tables of [docs/status.md](../../docs/status.md) and the README's measured table. `restore_latency`, `vllm_startup`
and `sglang_startup` make a new run's folder with `--results MACHINE-TOPIC` (`benchmarks.common.run_folder`: README
stub, then `figures.json`). The summary tables
are in [docs/benchmarks.md](../../docs/benchmarks.md).

A figure of `figures.json` (`{{"commit": "...", "recorded": "YYYY-MM-DDTHH:MM", "figures": [...]}}`: the commit that
recorded the run and its time, which orders the runs of one day):

{keys}

{len(all_runs)} runs, newest first:

{chr(10).join(rows)}
"""


def _current(all_runs: list[Run]) -> list[tuple[Run, dict]]:
    """The newest figure of each engine, machine, workload and metric (runs are newest first)."""
    seen, current = set(), []
    for run in all_runs:
        for figure in run.figures:
            key = (figure.get("engine", run.engine), figure.get("machine", run.machine), figure["workload"],
                   figure["metric"], figure.get("timed", ""))
            if key not in seen:
                seen.add(key)
                current.append((run, figure))
    return current


def status_tables(all_runs: list[Run]) -> str:
    groups: dict[tuple[str, str], list[tuple[Run, dict]]] = {}
    for run, figure in _current(all_runs):
        groups.setdefault((figure.get("engine", run.engine), figure.get("machine", run.machine)), []).append((run, figure))
    out = []
    for engine, machine in sorted(groups, key=lambda key: (list(ENGINES).index(key[0]), list(MACHINES).index(key[1]))):
        out.append(f"### {ENGINES[engine]}, {MACHINES[machine]}\n")
        out.append("| what ran | metric | figure | cold start in the same run → ratio | date | commit | results | note |")
        out.append("|---|---|---|---|---|---|---|---|")
        for run, figure in groups[(engine, machine)]:
            out.append(f"| {figure['workload']} | {figure['metric']} | **{figure_text(figure)}** | {cold_start_text(figure)} "
                       f"| {run.date} | {run.commit} | [{run.name}](../benchmarks/results/{run.name}/README.md) "
                       f"| {note_text(figure)} |")
        out.append("")
    return "\n".join(out).rstrip()


def measured_table(all_runs: list[Run]) -> str:
    seen, rows = set(), []
    for run in all_runs:
        for figure in run.figures:
            key = (figure.get("engine", run.engine), figure.get("machine", run.machine))
            if figure.get("headline") and key not in seen:
                seen.add(key)
                rows.append((run, figure))
    lines = ["| engine, workload | machine | measured | cold start → first token | `coldsnap restore` → first validated "
             "token | ratio |", "|---|---|---|---|---|---|"]
    for run, figure in sorted(rows, key=lambda row: (list(ENGINES).index(row[0].engine), list(MACHINES).index(row[0].machine))):
        n = figure["cold_starts"]
        changed = " (code path changed since: [status](docs/status.md))" if figure.get("changed_since") else ""
        lines.append(f"| {figure['workload']} | {MACHINES[figure.get('machine', run.machine)]} | "
                     f"[{run.date}](benchmarks/results/{run.name}/README.md), commit {run.commit}{changed} | "
                     f"{_number(figure['cold_start'])} {figure['unit']} ({'median of ' + str(n) if n > 1 else 'one'}) | "
                     f"**{_number(figure['value'])} {figure['unit']}** (median of {figure['runs']}) | "
                     f"{figure['cold_start'] / figure['value']:.1f}× ÷ {n} cold start{'s' if n > 1 else ''} |")
    return "\n".join(lines)


def _between(page: str, markers: tuple[str, str], body: str) -> str:
    start, end = markers
    head, found, rest = page.partition(start)
    if not found:
        raise SystemExit(f"marker {start} not found")
    _, _, tail = rest.partition(end)
    return f"{head}{start}\n{body}\n{end}{tail}"


def rendered() -> dict[Path, str]:
    """Each generated page as it should read now."""
    all_runs = runs()
    return {
        INDEX: index(all_runs),
        STATUS: _between(STATUS.read_text(), STATUS_MARKERS, status_tables(all_runs)),
        README: _between(README.read_text(), README_MARKERS, measured_table(all_runs)),
    }


def main() -> int:
    stale = []
    for path, text in rendered().items():
        if path.read_text() != text:
            stale.append(path)
            if "--check" not in sys.argv[1:]:
                path.write_text(text)
                print(f"rewrote: {path.relative_to(ROOT)}")
    if stale and "--check" in sys.argv[1:]:
        print(f"stale: {', '.join(str(p.relative_to(ROOT)) for p in stale)}: python scripts/docs-results.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
