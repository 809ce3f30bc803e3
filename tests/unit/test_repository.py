"""Checks of the repository as a newcomer meets it: no merge-conflict markers, ruff clean, the snapshot
drivers' step names all methods, the early wake's option table the CLI's, no doc pointing outside."""

import argparse
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    files = []
    for name in filter(None, names):
        path = ROOT / name.decode()
        if path.is_file() and path.suffix not in {".gz", ".png", ".so", ".whl", ".deb", ".tar"}:
            try:
                path.read_text()
            except UnicodeDecodeError:
                continue
            files.append(path)
    return files


def test_no_tracked_text_file_holds_merge_conflict_markers():
    marked = [f"{path.relative_to(ROOT)}:{number}" for path in _tracked_text_files()
              for number, line in enumerate(path.read_text().splitlines(), start=1)
              if re.match(r"(<{7}|>{7})( |$)", line)]
    assert not marked, f"merge-conflict markers committed: {marked}"


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (it is in the dev extra)")
def test_ruff_is_clean():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_every_snapshot_driver_step_is_a_method_of_its_sequence():
    """Capture steps are named methods of the capture's sequence; restore, warm and wake steps are the
    sequence's methods themselves (:class:`coldsnap.activation.restore_steps.Step`), and the canary's barrier
    is named where it stands in the list."""
    from coldsnap.activation import n580, n610
    from coldsnap.activation.capture_steps import CaptureSequence
    from coldsnap.activation.restore_state import Step
    from coldsnap.activation.restore_steps import RestoreSequence

    captures = {n610: CaptureSequence, n580: n580.TemplateCapture}
    restores = {(n610, "RESTORE_STEPS"): RestoreSequence, (n610, "WARM_STEPS"): n610.StandbySequence,
                (n610, "WAKE_STEPS"): RestoreSequence, (n580, "RESTORE_STEPS"): n580.TemplateRestore}
    for module in (n580, n610):  # every *_STEPS tuple of a driver is in the tables
        assert {name for name in vars(module) if name.endswith("_STEPS")} == \
            {"CAPTURE_STEPS"} | {n for m, n in restores if m is module}
        missing = [step for step in module.CAPTURE_STEPS if not callable(getattr(captures[module], step, None))]
        assert not missing, f"{module.__name__}.CAPTURE_STEPS: no method {missing} on {captures[module].__name__}"
    for (module, name), sequence in restores.items():
        steps = getattr(module, name)
        assert all(isinstance(step, Step) for step in steps)
        assert issubclass(sequence, RestoreSequence)
        strangers = [step.run.__qualname__ for step in steps
                     if step.run.__qualname__.split(".")[0] not in {klass.__name__ for klass in sequence.__mro__}]
        assert not strangers, f"{module.__name__}.{name}: {strangers} are not methods of {sequence.__name__}"
    assert [s.barrier for s in n610.RESTORE_STEPS if s.barrier] == ["released"]
    assert [s.barrier for s in n610.WARM_STEPS if s.barrier] == ["parked"]


def test_the_early_wake_knows_every_option_of_wake_that_takes_a_value():
    """``coldsnap wake``'s pre-import fast path parses the arguments itself: an option it does not know
    turns the early weight prefill off (as ``--owner`` once did)."""
    from coldsnap.activation.early_wake import VALUE_OPTIONS
    from coldsnap.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    wake = commands.choices["wake"]
    taking_values = {option for action in wake._actions if action.option_strings and action.nargs != 0
                     for option in action.option_strings if option.startswith("--")}
    not_plain = {"--weights", "--request-json"}  # these turn the early prefill off on purpose
    assert set(VALUE_OPTIONS) == taking_values - not_plain


OUTSIDE = re.compile(r"\.\./shared|\bshared/(DESIGN|seeds|REFERENCE|STYLE|ENGINE|VLLM)|\b(DESIGN|REFERENCE|STYLE|"
                     r"ENGINE-API-FACTS|ENGINE-RESTORE-FACTS|VLLM-SGLANG-HOST-API)\.md\b|\bthe seeds\b|\bseeds'")


def test_no_file_points_outside_the_repository():
    """The design, the engine facts and the formats live in docs/: nothing names the steering notes the
    project was started from, which a clone does not have."""
    found = [f"{path.relative_to(ROOT)}:{number}" for path in _tracked_text_files()
             if path.relative_to(ROOT).parts[:2] != ("tests", "unit") or path.name != "test_repository.py"
             for number, line in enumerate(path.read_text().splitlines(), start=1) if OUTSIDE.search(line)]
    assert not found, f"references to files outside the repository: {found}"


def test_benchmark_results_hold_no_code():
    """Code lives in benchmarks/ (run as ``python -m benchmarks.NAME``); results/ holds what runs wrote."""
    code = [str(p.relative_to(ROOT)) for p in _tracked_text_files()
            if p.is_relative_to(ROOT / "benchmarks" / "results") and p.suffix in {".py", ".sh", ".patch"}]
    assert not code, f"code under benchmarks/results/: {code}"
