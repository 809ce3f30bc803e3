"""benchmarks/sglang_speculative.py's bookkeeping without a GPU: a run is compared with its variant's cold
start (token ids, and the draft's acceptance per prompt), and the table says what the H200 run recorded."""

import json
from argparse import Namespace
from pathlib import Path

from benchmarks import sglang_speculative as bench

ROOT = Path(__file__).resolve().parents[2]

RESULT = ROOT / "benchmarks" / "results" / "2026-12-02-sglang-h200-speculative" / "sglang-speculative-8b.json"


def _bench(tmp_path: Path) -> bench.SpeculativeBench:
    args = Namespace(dir=str(tmp_path), shape="8b-spec", port=1, policy="retain", out=None, sglang_args=[], repeat=1)
    return bench.SpeculativeBench(args)


def test_runs_are_checked_against_their_variants_cold_start(tmp_path):
    b = _bench(tmp_path)
    acceptance = {"spec_accept_rate": [0.5], "spec_accept_length": [2.0], "spec_verify_ct": [10.0]}
    b.variant = "spec"
    b.record("cold start", 60.0, {"tokens": [[1, 2, 3]], **acceptance})
    b.record("restore", 2.0, {"tokens": [[1, 2, 3]], **acceptance})
    b.record("restore", 2.1, {"tokens": [[1, 2, 3]], **{**acceptance, "spec_verify_ct": [11.0]}})
    b.variant = "plain"
    b.record("cold start", 55.0, {"tokens": [[1, 2, 4]]})
    b.record("restore", 1.5, {"tokens": [[1, 2, 5]]})
    runs = b.state["runs"]
    assert [r.get("same_tokens") for r in runs] == [None, True, True, None, False]  # a cold start is the reference
    assert [r.get("same_acceptance") for r in runs[:3]] == [None, True, False]  # a changed verify count is a change
    assert "same_acceptance" not in runs[4]  # no speculation, no acceptance
    assert b.state["summary"] == {"spec: cold start": 60.0, "spec: restore (retain)": 2.05, "plain: cold start": 55.0,
                                  "plain: restore (retain)": 1.5}
    assert json.loads((tmp_path / "sglang-speculative.json").read_text())["runs"] == runs  # saved as it goes


def test_the_h200_runs_table():
    table = bench.render(json.loads(RESULT.read_text()))
    assert "spec: restore (retain)                      1.901" in table
    assert "plain: restore (retain)                     1.644" in table
    assert "spec: every restore's greedy token ids = the cold start's: True; acceptance unchanged: True" in table
    assert "HTTP 400" in table and "first prompt's tokens after it unchanged: True" in table
