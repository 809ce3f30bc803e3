"""The canary's probes: exact token ids and logprobs, asked of a real local HTTP server in vLLM's shapes."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from coldsnap.activation.canary_probes import (PROBES, ProbeAnswer, ask_probe, bits_of, first_difference, float_of,
                                               probe_prompt)
from coldsnap.contracts.artifact import CanaryProbe, CanaryRecord
from coldsnap.contracts.base import ContractError


class Completions(BaseHTTPRequestHandler):
    """Answers ``/v1/completions`` as ``behaviour`` says: vLLM's shape, or a refusal, or an answer without ids."""

    behaviour = "vllm"
    seen: list[dict] = []

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if self.behaviour == "refuse":
            return self._reply(400, {"error": "prompt longer than the context"})
        if self.behaviour == "broken":
            return self._reply(500, {"error": "engine died"})
        tokens = [sum(body["prompt"]) % 1000 + i for i in range(body["max_tokens"])]
        choice = {"text": "x", "logprobs": {"token_logprobs": [-0.1 * (i + 1) for i in range(len(tokens))]}}
        if self.behaviour == "vllm":
            choice["token_ids"] = tokens
        self._reply(200, {"choices": [choice]})

    def _reply(self, status, document):
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    Completions.seen = []
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()
    Completions.behaviour = "vllm"


def test_probe_prompts_are_fixed_and_of_their_lengths():
    for length, _ in PROBES:
        prompt = probe_prompt(length)
        assert len(prompt) == length and prompt == probe_prompt(length)
        assert all(3 <= t < 500 for t in prompt)
    assert probe_prompt(24) != probe_prompt(24, seed=1)
    assert any(length > 512 for length, _ in PROBES), "one probe must run past vLLM's largest graph size"


def test_a_logprob_travels_as_its_exact_bits():
    for value in (-0.0, -1e-30, -0.15643215179443359, -23.5, float("-inf")):
        assert float_of(bits_of(value)) == value or (value != value)
    assert bits_of(-0.1) != bits_of(-0.1 + 1e-17 - 1e-17 + 2e-17)  # one ulp apart: different bits


def test_a_probe_is_asked_greedily_with_ids_and_logprobs(server):
    answer = ask_probe(server, [5, 6, 7], 3)
    assert answer is not None and answer.token_ids == [18, 19, 20] and answer.logprobs == [-0.1, -0.2, -0.30000000000000004]
    sent = Completions.seen[-1]
    assert sent["prompt"] == [5, 6, 7] and sent["temperature"] == 0 and sent["ignore_eos"] and sent["return_token_ids"]


def test_an_engine_that_refuses_or_gives_no_ids_records_no_probe_and_a_broken_one_fails(server):
    Completions.behaviour = "refuse"
    assert ask_probe(server, [5], 2) is None
    Completions.behaviour = "no-ids"
    assert ask_probe(server, [5], 2) is None
    Completions.behaviour = "broken"
    with pytest.raises(OSError):
        ask_probe(server, [5], 2)


def test_the_first_difference_names_the_token_or_the_logprob():
    answer = ProbeAnswer([1], [7, 8, 9], [-0.5, -0.25, -1.0])
    assert first_difference([7, 8, 9], [-0.5, -0.25, -1.0], answer) is None
    assert first_difference([7, 3, 9], [-0.5, -0.25, -1.0], answer) == "token 1 is 8, captured 3"
    found = first_difference([7, 8, 9], [-0.5, -0.25, -1.0000001], answer)
    assert found is not None and found.startswith("token 2's logprob is -1.0, captured -1.0000001")
    assert first_difference([7, 8], [-0.5, -0.25], answer) == "3 tokens, captured 2"


def test_the_record_keeps_probes_and_reads_descriptors_written_before_them():
    probe = CanaryProbe(prompt_ids=[3, 4], token_ids=[9], logprob_bits=[bits_of(-0.75)])
    record = CanaryRecord(prompt="p", expected_response="r", token_ids=[9], probes=[probe])
    again = CanaryRecord.model_validate_json(record.model_dump_json())
    assert float_of(again.probes[0].logprob_bits[0]) == -0.75
    assert CanaryRecord.model_validate_json('{"prompt": "p", "expected_response": "r", "token_ids": [1]}').probes == []
    with pytest.raises((ContractError, ValueError)):
        CanaryProbe.model_validate_json('{"prompt_ids": [1], "token_ids": [2], "logprob_bits": [-0.5]}')


def test_a_probe_plan_is_len_tokens_pairs_in_the_order_given():
    from coldsnap.activation.canary_probes import parse_probes

    assert parse_probes("136:4, 600:2,183:32") == ((136, 4), (600, 2), (183, 32))
    for bad, says in (("136", "not LEN:TOKENS"), ("136:x", "not LEN:TOKENS"), ("0:4", "1 ≤ LEN"),
                      ("136:0", "1 ≤ TOKENS"), ("136:4,136:8", "given twice"), ("", "not LEN:TOKENS"),
                      (",".join(f"{n}:1" for n in range(1, 34)), "at most 32")):
        with pytest.raises(ValueError, match=says):
            parse_probes(bad)


def test_the_plan_comes_from_the_environment_else_the_default(monkeypatch):
    from coldsnap.activation.canary_probes import PROBES_ENV, probe_plan

    monkeypatch.delenv(PROBES_ENV, raising=False)
    assert probe_plan() == PROBES
    monkeypatch.setenv(PROBES_ENV, "8:32,287:32")
    assert probe_plan() == ((8, 32), (287, 32))


@pytest.mark.parametrize("given", [("--canary-probes", "136:4,x"), ("env", "5:0")])
def test_a_malformed_probe_plan_is_a_usage_error_before_anything_starts(given, tmp_path):
    import subprocess
    import sys

    from coldsnap.activation.canary_probes import PROBES_ENV

    flag, value = given
    env = {"PATH": "/usr/bin:/bin", PROBES_ENV: value} if flag == "env" else {"PATH": "/usr/bin:/bin"}
    flags = [flag, value] if flag != "env" else []
    marker = tmp_path / "started"
    done = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--out", str(tmp_path / "a"), *flags, "--",
                           "touch", str(marker)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (flag if flag != "env" else PROBES_ENV) in done.stderr
    assert not marker.exists() and not (tmp_path / "a").exists()
