"""What the benchmarks share: page-cache drops, a restore's timeline from its receipt, charts, how a run ends.

The benchmark scripts import from here and from :mod:`benchmarks.equality` (the restored-equals-cold
prompts and comparison); nothing here imports an engine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["RUN_ENGINES", "RUN_MACHINES", "RUN_NAME", "check_artifact", "cold_start_figure", "drop_caches",
           "draw_medians", "empty_compile_caches", "finish", "pyplot", "receipt_timeline", "results_argument",
           "run_folder", "write_figures"]

RESULTS = Path(__file__).resolve().parent / "results"
# A run's folder under benchmarks/results: YYYY-MM-DD-ENGINE-MACHINE-TOPIC (scripts/docs-results.py indexes them).
RUN_ENGINES = ("vllm", "sglang", "torch-lm", "none")
RUN_MACHINES = ("h100", "h100x2", "h100x4", "h100x8", "h200", "h200x2", "h200x4", "h200x8", "cpu")
RUN_NAME = re.compile(rf"^(?P<date>\d{{4}}-\d{{2}}-\d{{2}})-(?P<engine>{'|'.join(RUN_ENGINES)})"
                      rf"-(?P<machine>{'|'.join(RUN_MACHINES)})-(?P<topic>[a-z0-9]+(?:-[a-z0-9]+)*)$")


def empty_compile_caches(directory: Path) -> dict[str, str]:
    """Environment for an engine start that compiles anew: vLLM's compile cache and Inductor's and Triton's
    in empty folders under ``directory`` (as a host's first start finds them)."""
    return {"VLLM_CACHE_ROOT": str(directory / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(directory / "inductor"),
            "TRITON_CACHE_DIR": str(directory / "triton")}


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def receipt_timeline(receipt: dict, exec_ns: int, exit_ns: int) -> dict[str, float]:
    """A restore (or wake) process's timeline in seconds, placed on the wall clock by the receipt's clock
    origins: ``exec → admission start`` (interpreter start, imports, request decoding), ``exec → CRIU start``
    (the launcher's whole share before the tree's restore begins), each ``restore.*``
    (``wake.*``) phase (admission summed), ``exec → canary matched`` (the restore as the user sees it: the
    goal figure), ``canary → receipt`` and ``receipt → process exit`` (after the goal, but the process's
    own time)."""
    op = receipt["operation"]
    origins = {c["clock_id"]: c["unix_origin_ns"] for c in receipt["timing"]["clocks"]}
    spans = [s for s in receipt["timing"]["spans"] if s["placement"] == "timeline"]

    def at(span: dict, end: bool = False) -> int:
        return origins[span["clock_id"]] + span["start_ns"] + (span["duration_ns"] if end else 0)

    admission = [s for s in spans if s["name"].startswith(f"{op}.admission.")]
    canary = next(s for s in spans if s["name"] == f"{op}.canary")
    timeline = {"exec → admission start": (min(at(s) for s in admission) - exec_ns) / 1e9,
                f"{op}.admission": sum(s["duration_ns"] for s in admission) / 1e9}
    criu = next((s for s in spans if s["name"] == f"{op}.criu_restore"), None)
    if criu is not None:  # (a wake restores no tree)
        timeline["exec → CRIU start"] = (at(criu) - exec_ns) / 1e9
    timeline.update({s["name"]: s["duration_ns"] / 1e9 for s in spans
                     if s["name"].startswith(f"{op}.") and not s["name"].startswith(f"{op}.admission.")})
    timeline["exec → canary matched"] = (at(canary, end=True) - exec_ns) / 1e9
    timeline["canary → receipt"] = (receipt["finished_unix_ns"] - at(canary, end=True)) / 1e9
    timeline["receipt → process exit"] = (exit_ns - receipt["finished_unix_ns"]) / 1e9
    return {name: round(value, 4) for name, value in timeline.items()}


def pyplot() -> Any:
    """matplotlib's pyplot (Agg), or None with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (draw it later with --png-from)", file=sys.stderr)
        return None
    return plt


def draw_medians(summary: dict[str, float], title: str, png: Path) -> bool:
    """Median seconds per label as bars on a log scale, restores in red (False without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(10, 0.5 + 0.45 * len(summary)))
    axis.barh(list(summary), list(summary.values()), color=["#d62728" if "restore" in k else "#999999" for k in summary])
    for y, value in enumerate(summary.values()):
        axis.text(value, y, f" {value:.2f} s", va="center", fontsize=8)
    axis.set_xscale("log")
    axis.invert_yaxis()
    axis.set_xlabel("seconds to the first (validated) token, median, log scale")
    axis.set_title(title, fontsize=9)
    axis.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    figure.savefig(png, dpi=120)
    return True


def check_artifact(parser: argparse.ArgumentParser, artifact: Path) -> None:
    """A usage error (``parser.error``) unless ``artifact`` is a committed artifact directory."""
    if not (artifact / "artifact.json").is_file():
        parser.error(f"{artifact} holds no artifact.json")


def finish(result: dict, out: Path | None, table: str) -> int:
    """How a benchmark ends: ``result`` as JSON in ``out`` (when given), ``table`` on stdout; exit status 0."""
    if out:
        out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(table)
    return 0


def _commit() -> str:
    """The checkout's commit (with ``+`` when its tree has changes), or ``unknown`` outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=RESULTS.parent, capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def results_argument(parser: argparse.ArgumentParser) -> None:
    """``--results MACHINE-TOPIC``: the run's JSON goes into its folder under benchmarks/results (:func:`run_folder`)."""
    parser.add_argument("--results", metavar="MACHINE-TOPIC",
                        help=f"write the JSON, a README stub and figures.json into benchmarks/results/"
                        f"TODAY-ENGINE-MACHINE-TOPIC/ (MACHINE one of {', '.join(RUN_MACHINES)})")


def run_folder(engine: str, machine_topic: str, *, day: datetime.date | None = None, results: Path = RESULTS) -> Path:
    """A run's folder, ``results/YYYY-MM-DD-ENGINE-MACHINE-TOPIC`` (today's date), made with a README stub that
    names the command and the code's commit; what ran and what it showed are the author's to add."""
    name = f"{(day or datetime.date.today()).isoformat()}-{engine}-{machine_topic}"
    if not RUN_NAME.match(name):
        raise ValueError(f"{name!r}: a run folder is YYYY-MM-DD-ENGINE-MACHINE-TOPIC, ENGINE one of {RUN_ENGINES}, "
                         f"MACHINE one of {RUN_MACHINES}, TOPIC lower-case words joined by '-'")
    folder = results / name
    folder.mkdir(parents=True, exist_ok=True)
    readme = folder / "README.md"
    if not readme.exists():
        command = shlex.join(["python", "-m", f"benchmarks.{Path(sys.argv[0]).stem}",
                              *sys.argv[1:]])
        readme.write_text(f"# {engine}, {machine_topic} ({name[:10]}): WHAT RAN, IN ONE LINE\n\n"
                          f"The code of commit {_commit()}. Command:\n\n    {command}\n\n"
                          "What ran (engine version, model, host, driver), what it showed, the headline figures and "
                          "how many cold starts each ratio divides by; the files.\n")
    return folder


def cold_start_figure(workload: str, metric: str, values: list[float], cold_starts: list[float],
                      unit: str = "s") -> dict:
    """A figure for figures.json: the median of ``values`` against the median of ``cold_starts`` in the same run,
    naming how many cold starts the ratio divides by (a headline figure wants ≥ 3)."""
    import statistics

    figure: dict[str, Any] = {"workload": workload, "metric": metric, "value": round(statistics.median(values), 3),
                              "unit": unit, "runs": len(values)}
    if cold_starts:
        figure.update(cold_start=round(statistics.median(cold_starts), 3), cold_starts=len(cold_starts))
    return figure


def write_figures(folder: Path, figures: list[dict]) -> Path:
    """``folder/figures.json``, which scripts/docs-results.py reads for the index and the status tables."""
    now = datetime.datetime.now()
    path = folder / "figures.json"
    path.write_text(json.dumps({"commit": _commit(), "recorded": now.strftime("%Y-%m-%dT%H:%M"), "figures": figures},
                               indent=1, ensure_ascii=False) + "\n")
    return path
