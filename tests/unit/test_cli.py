"""The CLI as a user and a manager see it: real subprocesses, exit codes, stdout/stderr split."""

import json
import subprocess
import sys

import pytest

from tests.conftest import make_request


def coldsnap(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coldsnap", *args], input=stdin, capture_output=True, timeout=120)


def test_capabilities_is_json_naming_formats_and_drivers():
    result = coldsnap("capabilities")
    assert result.returncode == 0 and result.stderr == b""
    caps = json.loads(result.stdout)
    assert caps["protocol"]["request_formats"] == [4]
    assert caps["protocol"]["artifact_formats"] == [9]
    assert caps["protocol"]["receipt_format"] == 2
    assert caps["protocol"]["timing_event_format"] == 1
    assert {d["name"]: (d["minimum_nvidia_driver"], d["operations"]) for d in caps["snapshot_drivers"]} == {
        "n580": (580, ["capture", "restore"]), "n610": (610, ["capture", "restore", "warm", "wake"])}
    assert caps["operations"] == {"capture": "conflicts-with-existing-output", "restore": "replacement-oriented",
                                  "warm": "convergent", "wake": "replacement-oriented"}
    assert {e["name"]: e["native_materialization"] for e in caps["engines"]} == {"vllm": ["off"], "sglang": ["off"],
                                                                                   "torch-lm": ["off"]}
    canonical = coldsnap("capabilities", "--canonical").stdout
    assert json.loads(canonical) == caps and b" " not in canonical.replace(b"coldsnap 0", b"").split(b'"boundary"')[0]


def test_version_names_the_extension():
    result = coldsnap("version")
    assert result.returncode == 0
    assert b"coldsnap 0." in result.stdout and b"coldsnap._C" in result.stdout


@pytest.mark.parametrize("command", [[], ["capabilities"], ["version"], ["doctor"], ["validate"]])
def test_help_on_every_command(command):
    result = coldsnap(*command, "--help")
    assert result.returncode == 0 and b"usage: coldsnap" in result.stdout


MALFORMED = {
    "unknown-field.json": (json.dumps(make_request(colour="blue")), ["colour: unknown field"]),
    "wrong-format.json": (json.dumps(make_request(format=3)), ["format: unsupported format 3 (supported: 4)"]),
    "missing-field.json": (
        json.dumps({k: v for k, v in make_request().items() if k != "operation_id"}),
        ["operation_id: missing required field"],
    ),
    "wrong-type.json": (json.dumps(make_request(prepare_only=1)), ["prepare_only: input should be a valid boolean, got 1"]),
    "not-json.json": ("format: 4\n", ["not JSON: Expecting value at line 1 column 1"]),
    "empty.json": ("", ["not JSON: Expecting value at line 1 column 1"]),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_validate_request_malformed_exits_2_one_line_each(tmp_path, name):
    text, expected = MALFORMED[name]
    path = tmp_path / name
    path.write_text(text)
    result = coldsnap("validate", "request", str(path))
    assert result.returncode == 2
    assert result.stdout == b""
    assert b"Traceback" not in result.stderr
    assert result.stderr.decode().splitlines() == [f"{path}: {line}" for line in expected]


def test_validate_request_valid_from_stdin():
    result = coldsnap("validate", "request", "-", stdin=json.dumps(make_request()).encode())
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(b"<stdin>: valid request format 4, restore op-1, sha256 ")


def test_validate_missing_file_and_bad_kind():
    missing = coldsnap("validate", "receipt", "/nonexistent/receipt.json")
    assert missing.returncode == 2 and missing.stderr.strip() == b"/nonexistent/receipt.json: cannot read: No such file or directory"
    bad_kind = coldsnap("validate", "capsule", "x")
    assert bad_kind.returncode == 2 and b"Traceback" not in bad_kind.stderr


def test_validate_artifact_and_receipt_wrong_format(tmp_path):
    for kind, supported in (("artifact", 9), ("receipt", 2)):
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps({"format": 1}))
        result = coldsnap("validate", kind, str(path))
        assert result.returncode == 2
        assert result.stderr.decode().strip() == f"{path}: format: unsupported format 1 (supported: {supported})"


def test_validate_truncated_timing_events(tmp_path):
    path = tmp_path / "events.ndjson"
    path.write_text('{"timing_event_format": 1')
    result = coldsnap("validate", "timing-events", str(path))
    assert result.returncode == 2 and b"Traceback" not in result.stderr
    assert b"truncated" in result.stderr


@pytest.mark.parametrize("command, ranks", [
    (["python", "-m", "coldsnap.workloads.torch_lm", "--port", "8000"], 1),
    (["python", "-m", "coldsnap.workloads.torch_lm", "--tp", "2", "--port", "8000"], 2),
    (["vllm", "serve", "m", "--tensor-parallel-size=4", "--port", "8000"], 4),
    (["vllm", "serve", "m", "-tp", "2", "--port", "8000"], 2),
    (["python", "-m", "sglang.launch_server", "--tp-size", "8", "--port", "8000"], 8),
])
def test_capture_request_has_one_worker_per_rank(command, ranks):
    import argparse

    from coldsnap.cli import _capture_request

    args = argparse.Namespace(out="/tmp/a", command=["--", *command], port=None, engine=None, model=None, ranks=None, preload=None, placement_abi=None,
                              operation_id="op", driver="n610", graphs=None)
    workers = _capture_request(args)["units"][0]["workers"]
    assert [(w["rank"], w["device_slot"], w["worker_id"]) for w in workers] == [(r, r, f"worker-{r}") for r in range(ranks)]


def test_capture_ranks_errors_are_usage_errors():
    bad = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--out", "/tmp/x", "--", "serve", "--tp", "two",
                          "--port", "1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--ranks" in bad.stderr
    zero = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--out", "/tmp/x", "--ranks", "0", "--", "serve",
                           "--port", "1"], capture_output=True, text=True)
    assert zero.returncode == 2 and "at least 1" in zero.stderr


@pytest.mark.parametrize("command, model", [
    (["vllm", "serve", "/models/llama", "--port", "8000"], "/models/llama"),
    (["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/models/llama", "--port", "8000"], "/models/llama"),
    (["vllm", "serve", "--model", "m2", "--port", "8000"], "m2"),
])
def test_capture_request_names_the_served_model(command, model):
    import argparse

    from coldsnap.cli import _capture_request

    args = argparse.Namespace(out="/tmp/a", command=["--", *command], port=None, engine=None, model=None, ranks=None, preload=None, placement_abi=None,
                              operation_id="op", driver="n610", graphs=None)
    request = _capture_request(args)
    assert request["model"]["name"] == model and request["engine"] == "vllm"


N580_WARM_REFUSED = "operation: warm is not implemented in snapshot driver n580 (implemented: capture, restore)"


def test_an_operation_the_snapshot_driver_does_not_run_is_refused_before_anything_starts(tmp_path):
    # n580 has no warm boundary (seeds): the engine starts only once the template is placed.
    path = tmp_path / "request.json"
    path.write_text(json.dumps(make_request(operation="warm", snapshot_driver="n580", artifact=str(tmp_path / "a"))))
    warm = subprocess.run([sys.executable, "-m", "coldsnap", "warm", "--request-json", str(path), "--receipt-json", "-"],
                          capture_output=True, text=True, timeout=60)
    receipt = json.loads(warm.stdout)
    assert warm.returncode == 1 and receipt["error"] == {"code": "request.unsupported", "message": N580_WARM_REFUSED}
    assert not (tmp_path / "a").exists()


def test_friendly_flags_naming_what_is_not_built_get_one_line_and_no_traceback(tmp_path):
    artifact = tmp_path / "a"
    artifact.mkdir()
    (artifact / "request.json").write_text(json.dumps(make_request(snapshot_driver="n580", artifact=str(artifact))))
    result = coldsnap("warm", str(artifact))
    assert result.returncode == 1 and result.stdout == b""
    assert result.stderr.decode().splitlines() == [
        f"coldsnap warm [vllm/n580]: failed: request.unsupported: {N580_WARM_REFUSED}"]


def test_validate_request_names_what_this_build_does_not_implement(tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(make_request(operation="sleep", snapshot_driver="n580")))
    result = coldsnap("validate", "request", str(path))
    assert result.returncode == 2 and result.stdout == b""
    assert result.stderr.decode().splitlines() == [
        f"{path}: operation: sleep is not implemented in this build (implemented: capture, restore, warm, wake)"]


def _capture_args(command: list[str], engine: str | None = None):
    import argparse

    return argparse.Namespace(out="/tmp/a", command=["--", *command], port=None, engine=engine, model=None, ranks=None,
                              preload=None, placement_abi=None, operation_id="op", driver="n610", graphs=None)


@pytest.mark.parametrize("command, engine", [
    (["python", "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--port", "8000"], "torch-lm"),
    (["/usr/bin/python3", "/src/coldsnap/workloads/torch_lm/__main__.py", "--port", "8000"], "torch-lm"),
    (["vllm", "serve", "m", "--port", "8000"], "vllm"),
    (["/opt/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"], "vllm"),
    (["python3", "-m", "sglang.launch_server", "--port", "8000"], "sglang"),
])
def test_capture_names_the_engine_its_command_runs(command, engine):
    from coldsnap.cli import _capture_request

    assert _capture_request(_capture_args(command))["engine"] == engine


def test_a_command_of_no_known_engine_needs_engine_and_is_not_labelled_torch_lm(tmp_path):
    from coldsnap.cli import _capture_request

    result = coldsnap("capture", "--out", str(tmp_path / "a"), "--port", "8000", "--", "python3", "-m", "http.server", "8000")
    assert result.returncode == 2 and result.stdout == b"" and not (tmp_path / "a").exists()
    assert result.stderr.decode().splitlines() == [
        "coldsnap capture: cannot tell the engine of `python3 -m http.server 8000`: pass --engine, one of the engines "
        "this build knows: sglang, torch-lm, vllm"]
    # named, it is the engine asked for
    assert _capture_request(_capture_args(["python3", "-m", "http.server", "--port", "8000"], "vllm"))["engine"] == "vllm"


def test_restore_of_what_is_not_an_artifact_says_so_in_plain_words(tmp_path):
    missing = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "artifact.json").write_text("{}")
    expected = {
        missing: f"{missing} does not exist",
        empty: f"{empty} is not a coldsnap artifact (no artifact.json): capture one with "
               f"`coldsnap capture --out {empty} -- CMD ...`",
        a_file: f"{a_file} is not a directory: give the artifact directory `coldsnap capture --out` wrote",
        damaged: f"{damaged} is a damaged artifact: its request.json cannot be read (No such file or directory); "
                 "capture it again",
    }
    for path, message in expected.items():
        for command in ("restore", "warm"):
            result = coldsnap(command, str(path))
            assert result.returncode == 2 and result.stdout == b""
            assert result.stderr.decode().splitlines() == [f"coldsnap {command}: {message}"]
            assert b"Errno" not in result.stderr


@pytest.mark.parametrize("argv, line", [
    (["restore", "--port", "x", "DIR"], "coldsnap restore: error: argument --port: a port must be a number from 1 to "
                                        "65535, not 'x'"),
    (["capture", "--driver", "n999"], "coldsnap capture: error: argument --driver: invalid choice: 'n999' "
                                      "(choose from 'n580', 'n610')"),
    (["payload", "verify"], "coldsnap payload verify: error: the following arguments are required: FILE"),
    (["restore", "--no-such-flag"], "coldsnap: error: unrecognized arguments: --no-such-flag"),
    ([], "coldsnap: error: the following arguments are required: COMMAND"),
])
def test_a_bad_argument_is_one_line_and_a_pointer_to_help(argv, line):
    result = coldsnap(*argv)
    assert result.returncode == 2 and result.stdout == b""
    prog = line.split(": error:")[0]
    assert result.stderr.decode().splitlines() == [line, f"see {prog} --help"]


TORCH_LM = ["python", "-m", "coldsnap.workloads.torch_lm"]
BAD_INPUTS = [
    ["capture", "--out", "X", "--", *TORCH_LM, "--port", "abc"],
    ["capture", "--out", "X", "--", *TORCH_LM, "--port", "0"],
    ["capture", "--out", "X", "--", *TORCH_LM, "--port", "70000"],
    ["capture", "--out", "X", "--port", "0", "--", *TORCH_LM],
    ["capture", "--out", "X", "--port", "-5", "--", *TORCH_LM],
    ["capture", "--out", "X", "--", *TORCH_LM],
    ["capture", "--out", "X", "--ranks", "-1", "--", *TORCH_LM, "--port", "8000"],
    ["capture", "--out", "X", "--engine", "nope", "--", *TORCH_LM, "--port", "8000"],
    ["capture", "--out", "X", "--owner", "abc", "--", *TORCH_LM, "--port", "8000"],
    ["capture", "--out", "X", "--owner", "1:x", "--", *TORCH_LM, "--port", "8000"],
    ["capture", "--out", "X", "--placement-abi", "7", "--", *TORCH_LM, "--port", "8000"],
    ["capture", "--out", "X", "--request-json", "bad.json"],
    ["capture", "--request-json", "missing.json"],
    ["capture", "--out", "X", "--timing-events", "t.ndjson", "--", *TORCH_LM, "--port", "8000"],
    ["capture", "--out", "X"],
    ["capture", "--", *TORCH_LM, "--port", "8000"],
    ["capture", "--out", "X", "--port", "8000", "--", "python3", "-m", "http.server"],
    ["restore", "emptydir"],
    ["restore", "missing"],
    ["restore", "file.txt"],
    ["restore", "emptydir", "--port", "abc"],
    ["restore", "emptydir", "--port", "0"],
    ["restore", "emptydir", "--port", "99999"],
    ["restore", "emptydir", "--weights", "bogus"],
    ["restore", "emptydir", "--owner", "nobody"],
    ["restore", "--request-json", "bad.json"],
    ["restore", "oci://"],
    ["warm", "emptydir", "--ttl", "-3"],
    ["warm", "emptydir", "--ttl", "abc"],
    ["wake", "missing"],
    ["wake", "emptydir", "--owner", "U:G"],
    ["validate", "request", "bad.json"],
    ["validate", "artifact", "missing"],
    ["validate", "receipt", "file.txt"],
    ["payload", "verify", "file.txt"],
    ["coordinator", "--ranks", "0", "--listen", "127.0.0.1:0", "--token-file", "t"],
    ["coordinator", "--ranks", "abc"],
    ["publish", "emptydir", "registry.example/x:v1"],
    ["demo", "--engine", "nope"],
    ["doctor", "--bogus"],
]


@pytest.fixture()
def bad_input_dir(tmp_path, monkeypatch):
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "emptydir").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv", BAD_INPUTS, ids=lambda argv: " ".join(argv)[:60])
def test_every_bad_input_is_a_short_error_with_no_traceback(argv, bad_input_dir):
    """A newcomer's mistakes (bad flag values, missing files, what is not an artifact) end with exit 2, at
    most one line and a pointer to --help on stderr, nothing on stdout, and nothing started or written."""
    result = coldsnap(*argv)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr and result.stdout == b""
    lines = stderr.splitlines()
    assert 1 <= len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("see coldsnap")), stderr
    assert not (bad_input_dir / "X").exists()


@pytest.mark.parametrize("graphs", [None, "retain", "recreate"])
def test_capture_graphs_flag_sets_the_requests_graph_policy(graphs):
    from coldsnap.cli import capture_request
    from coldsnap.contracts.request import OperationRequest

    flags = ["--graphs", graphs] if graphs else []
    request = capture_request(["--out", "/tmp/a", *flags, "--", "vllm", "serve", "m", "--port", "8000"])
    decoded = OperationRequest.model_validate_json(json.dumps(request))
    assert decoded.policy.graphs.mode == graphs  # None: the driver's default, chosen at resolution


def test_capture_graphs_flag_refuses_an_unknown_policy():
    bad = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--out", "/tmp/x", "--graphs", "keep", "--",
                          "vllm", "serve", "m", "--port", "1"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--graphs" in bad.stderr and "Traceback" not in bad.stderr


def test_capture_of_one_unit_of_several_lists_its_own_ranks_and_selection(tmp_path):
    from coldsnap.cli import capture_request
    from coldsnap.contracts.request import OperationRequest

    token = tmp_path / "token"
    command = ["python", "-m", "coldsnap.workloads.torch_lm", "--tp", "4", "--nnodes", "2", "--port", "8000"]
    unit1 = capture_request(["--out", str(tmp_path / "a"), "--units", "2", "--unit", "1", "--rendezvous", "10.0.0.1:29600",
                             "--rendezvous-token-file", str(token), "--", *command, "--node-rank", "1"])
    decoded = OperationRequest.model_validate_json(json.dumps(unit1))
    assert decoded.partial and decoded.unit.index == 1 and decoded.unit.unit_id == "unit-1"
    # --tp 4 over 2 units: ranks 2 and 3 here; only unit 0 serves (the command's --port is not unit 1's to serve)
    assert [w.rank for w in decoded.units[0].workers] == [2, 3] and decoded.units[0].serving_port is None
    unit0 = capture_request(["--out", str(tmp_path / "a"), "--units", "2", "--unit", "0", "--serve-rendezvous",
                             "0.0.0.0:29600", "--address", "10.0.0.1", "--rendezvous-token-file", str(token), "--", *command])
    decoded = OperationRequest.model_validate_json(json.dumps(unit0))
    assert decoded.unit.rendezvous == "10.0.0.1:29600" and decoded.units[0].serving_port == 8000
    assert "unit" not in OperationRequest.model_validate_json(json.dumps({**unit0, "unit": None})).to_json_value()


@pytest.mark.parametrize("flags, message", [
    (["--unit", "1"], "--unit is for one unit of several"),
    (["--units", "1", "--unit", "0"], "2 or more"),
    (["--units", "2"], "--unit K with K in 0..1"),
    (["--units", "2", "--unit", "2"], "--unit K with K in 0..1"),
    (["--units", "2", "--unit", "0", "--rendezvous", "h:1"], "--rendezvous-token-file"),
    (["--units", "2", "--unit", "0", "--rendezvous-token-file", "/t"], "--rendezvous HOST:PORT"),
    (["--units", "2", "--unit", "0", "--rendezvous-token-file", "/t", "--serve-rendezvous", "0.0.0.0:29600"], "--address"),
])
def test_unit_flags_that_do_not_add_up_are_usage_errors(flags, message):
    bad = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--out", "/tmp/x", *flags, "--", "vllm", "serve",
                          "m", "--port", "1"], capture_output=True, text=True)
    assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr


def _unit_request(tmp_path, unit: int, command: list[str]):
    from coldsnap.cli import capture_request
    from coldsnap.contracts.request import OperationRequest

    request = capture_request(["--out", str(tmp_path / "a"), "--units", "2", "--unit", str(unit), "--rendezvous",
                               "10.0.0.1:29600", "--rendezvous-token-file", str(tmp_path / "token"), "--", *command])
    return OperationRequest.model_validate_json(json.dumps(request))


def test_sglang_node_1_of_2_is_unit_1_with_its_half_of_the_tensor_parallel_ranks(tmp_path):
    """SGLang's own multi-node flags (``--tp-size 2 --nnodes 2 --node-rank 1 --dist-init-addr``): node 1 holds
    rank 1 on its first GPU and serves nothing the canary asks (its --port is a health check only)."""
    decoded = _unit_request(tmp_path, 1, ["python", "-m", "sglang.launch_server", "--model-path", "m", "--tp-size", "2",
                                          "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000",
                                          "--port", "30000"])
    assert decoded.engine == "sglang" and decoded.unit.unit_id == "unit-1"
    assert [(w.rank, w.device_slot) for w in decoded.units[0].workers] == [(1, 0)]
    assert decoded.units[0].serving_port is None


def test_pipeline_parallel_ranks_split_over_the_units(tmp_path):
    """vLLM ``--pipeline-parallel-size 2 --nnodes 2``: one stage, one rank, per unit; TP × PP in general."""
    command = ["vllm", "serve", "m", "--port", "8000", "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2",
               "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"]
    assert [w.rank for w in _unit_request(tmp_path, 1, command).units[0].workers] == [2, 3]
    command[command.index("--tensor-parallel-size") + 1] = "1"
    assert [w.rank for w in _unit_request(tmp_path, 1, command).units[0].workers] == [1]


@pytest.mark.parametrize("flags, command, message", [
    ([], ["--nnodes", "2", "--node-rank", "0"], "capture it as one unit of several"),
    (["--units", "2", "--unit", "1"], ["--nnodes", "2", "--node-rank", "0"], "--node-rank of its --unit"),
    (["--units", "2", "--unit", "1"], ["--nnodes", "2"], "--node-rank of its --unit"),
    (["--units", "2", "--unit", "0"], ["--nnodes", "3", "--node-rank", "0"], "--nnodes 3"),
])
def test_a_command_whose_nodes_are_not_the_units_is_a_usage_error(tmp_path, flags, command, message):
    """The engine's --nnodes/--node-rank and coldsnap's --units/--unit must name the same unit: a capsule
    recorded as unit 1 of a node-0 process would be restored in the wrong place."""
    token = tmp_path / "token"
    token.write_text("t")
    rendezvous = ["--rendezvous", "10.0.0.1:29600", "--rendezvous-token-file", str(token)] if flags else []
    bad = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--out", str(tmp_path / "x"), *flags, *rendezvous,
                          "--", "vllm", "serve", "m", "--port", "8000", "--tensor-parallel-size", "2", *command],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    assert not (tmp_path / "x").exists()
