"""benchmarks/equality.py's bookkeeping: the prompt set and the comparison of two servers' answers."""

import json
from pathlib import Path

from benchmarks.equality import Answer, compare, equality_prompts, equality_summary, render_summary


def test_the_prompt_set_is_seeded_and_spans_short_to_long():
    prompts = equality_prompts(256)
    assert prompts == equality_prompts(256) and prompts != equality_prompts(256, seed=1)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == 256 and lengths[0] == 8 and lengths[-1] == 1500
    assert 40 < lengths[128] < 400  # log-uniform: as many short as long prefills
    assert all(3 <= t < 512 for p in prompts for t in p)


def test_a_comparison_counts_differing_prompts_and_the_largest_logprob_gap_while_both_agree():
    cold = [Answer([1, 2, 3], [-0.5, -0.25, -1.0]), Answer([4, 5], [-0.1, -0.2])]
    same = [Answer([1, 2, 3], [-0.5, -0.25, -1.0]), Answer([4, 5], [-0.1, -0.2])]
    assert compare(cold, same) == {"prompts": 2, "differing": 0, "largest_logprob_difference": 0.0,
                                   "differing_prompts": []}
    # prompt 1 diverges at token 1: its logprob there still counts, the tokens after it do not
    other = [Answer([1, 2, 3], [-0.5, -0.25, -1.0]), Answer([4, 9], [-0.1, -0.7])]
    result = compare(cold, other)
    assert result["differing"] == 1 and result["differing_prompts"] == [{"prompt": 1, "first_differing_token": 1}]
    assert abs(result["largest_logprob_difference"] - 0.5) < 1e-12


def test_the_summary_names_the_concurrent_spread_of_the_cold_server():
    a = [Answer([1], [-0.5])]
    b = [Answer([2], [-0.4])]
    cold = {"one_at_a_time": [{"ids": [1], "logprobs": [-0.5]}], "concurrent_0": [{"ids": [1], "logprobs": [-0.5]}],
            "concurrent_1": [{"ids": [2], "logprobs": [-0.4]}]}
    restored = {"one_at_a_time": [{"ids": [1], "logprobs": [-0.5]}], "concurrent_0": [{"ids": [2], "logprobs": [-0.4]}]}
    summary = equality_summary(cold, restored)
    assert summary["one at a time: restored vs cold"]["differing"] == 0
    assert summary["concurrency 32: restored vs cold"]["differing"] == 1 == compare(a, b)["differing"]
    assert summary["concurrency 32: cold vs cold (same server, second pass)"]["differing"] == 1
    assert "0/1 prompts differ" in render_summary(summary)


def test_the_startup_table_names_each_artifacts_capture_and_equality():
    from benchmarks.vllm_startup import render

    same = {"prompts": 256, "differing": 0, "largest_logprob_difference": 0.0, "differing_prompts": []}
    capture = {"seconds": 120.0, "image_bytes": 2**31, "image_to_non_model": 0.1, "payload_bytes": 2**34}
    state = {"vllm": "0.26.0", "shape": "8b", "device": "cuda", "runs": [], "capture": capture,
             "capture graphs=recreate": capture,
             "equality": {"prompts": 256, "tokens": 64, "restores": 3, "one at a time: restored vs cold": same,
                          "restore_phases": [{"exec → canary matched": 1.9}]},
             "equality graphs=recreate": {"prompts": 256, "tokens": 64, "restores": 1,
                                          "one at a time: restored vs cold": same}}
    table = render(state)
    assert "capture graphs=recreate 120.0 s" in table and "restored equals cold graphs=recreate" in table
    assert "3 restore(s)" in table and "exec → canary matched (s): 1.9" in table


def test_the_standby_step_times_the_wake_from_its_exec_and_kills_the_warmed_tree(tmp_path, monkeypatch):
    """benchmarks/vllm_startup.py's ``standby`` step, its `coldsnap warm` and `wake` stood in for by a process
    that writes their receipts (the real ones need a GPU): the wake's seconds are its exec → canary, and
    the tree the warm restored is killed, whatever the wake did."""
    import argparse
    import subprocess
    import time

    from benchmarks import vllm_startup

    def receipt(operation: str, pid: int | None) -> dict:
        origin = time.time_ns()
        spans = [{"name": f"{operation}.admission.standby", "start_ns": 1_000_000, "duration_ns": 1_000_000,
                  "clock_id": "controller", "placement": "timeline", "attributes": {}},
                 {"name": f"{operation}.canary", "start_ns": 2_000_000, "duration_ns": 3_000_000,
                  "clock_id": "controller", "placement": "timeline", "attributes": {}}]
        if pid is not None:
            spans.append({"name": f"{operation}.criu_restore", "start_ns": 1_500_000, "duration_ns": 1,
                          "clock_id": "controller", "placement": "timeline", "attributes": {"pid": pid}})
        return {"operation": operation, "finished_unix_ns": origin + 6_000_000,
                "timing": {"clocks": [{"clock_id": "controller", "unix_origin_ns": origin}], "spans": spans}}

    def run(command, **_):
        operation, receipt_path = command[3], command[command.index("--receipt-json") + 1]
        Path(receipt_path).write_text(json.dumps(receipt(operation, 4242 if operation == "warm" else None)))
        return subprocess.CompletedProcess(command, 0, "", "")

    killed = []
    monkeypatch.setattr(vllm_startup.subprocess, "run", run)
    monkeypatch.setattr(vllm_startup, "kill_tree", killed.append)
    monkeypatch.setattr(vllm_startup, "tokens", lambda port: [1, 2, 3])
    monkeypatch.setattr(vllm_startup.time, "sleep", lambda s: None)
    args = argparse.Namespace(dir=str(tmp_path), repeat=2, port=1, graphs=None, restore_args=[], shape="8b",
                              device="cuda", vllm_args=[])
    monkeypatch.setattr(vllm_startup.Bench, "__init__", lambda self, a: None)
    bench = vllm_startup.Bench(args)
    bench.args, bench.work, bench.port, bench.variant, bench.artifact = args, tmp_path, 1, "", tmp_path / "artifact"
    bench.state = {"runs": [{"kind": "cold start", "tokens": [1, 2, 3]}]}
    bench.engine_env, bench.cache = {}, tmp_path / "cache"
    monkeypatch.setattr(vllm_startup.Bench, "save", lambda self: None)
    bench.step_standby()
    wakes = [r for r in bench.state["runs"] if r["kind"] == "wake"]
    assert len(wakes) == 2 and killed == [4242, 4242]
    assert all(r["same_tokens"] and r["warm_s"] >= 0 and 0.004 < r["seconds"] < 5 for r in wakes)
