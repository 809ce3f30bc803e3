"""The CSKV coordinator on loopback: barriers, key/value, authentication and failure semantics."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
from hypothesis import given, settings, strategies as st  # noqa: E402

from coldsnap.coord import Coordinator, CoordinatorClient, CoordinatorError  # noqa: E402
from coldsnap.coord.frames import MAX_FRAME_BYTES, Frame, FrameError, Kind, decode_frame, encode_frame  # noqa: E402

TOKEN = b"activation-token-0123456789abcdef"


@pytest.fixture
def coordinator():
    started = []

    def start(ranks: int, ttl: float = 60.0, units: int = 0) -> Coordinator:
        server = Coordinator("127.0.0.1:0", TOKEN, ranks, ttl, units=units)
        result = {}
        thread = threading.Thread(target=lambda: result.setdefault("reason", server.serve()), daemon=True)
        thread.start()
        started.append((server, thread))
        server.result = result
        server.thread = thread
        return server

    yield start
    for server, thread in started:
        server.stop()
        thread.join(timeout=5)


def test_64_ranks_repeated_barriers_and_values(coordinator):
    server = coordinator(64)
    errors = []

    def rank(r):
        try:
            with CoordinatorClient(server.endpoint, TOKEN, r) as client:
                for round_ in range(5):
                    client.barrier("step", timeout=20)  # one name, reused every round
                if r == 0:
                    client.put("nccl_unique_id", "x" * 128)
                assert client.get("nccl_unique_id", timeout=20) == "x" * 128
                client.barrier("done", timeout=20)
        except Exception as exc:  # collected: a failing thread must fail the test
            errors.append((r, repr(exc)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    server.thread.join(5)
    assert server.result["reason"] == "complete" and server.rejected == 0


def test_missing_rank_times_out_with_its_name(coordinator):
    server = coordinator(3)
    with CoordinatorClient(server.endpoint, TOKEN, 0) as first:
        started = time.monotonic()
        with pytest.raises(CoordinatorError, match=r"timed out: missing ranks \[1, 2\]"):
            first.barrier("network-unlock", timeout=0.5)
        assert time.monotonic() - started < 3


def test_wrong_token_is_never_answered(coordinator):
    server = coordinator(1, ttl=10)
    with pytest.raises(CoordinatorError, match="no answer"):
        CoordinatorClient(server.endpoint, b"a-different-token-of-32-bytes-xx", 0, connect_timeout=0.2)
    assert server.rejected >= 1


def _raw(server) -> "zmq.Socket":
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(server.endpoint)
    return socket


def test_replayed_reordered_and_oversized_frames_are_dropped(coordinator):
    server = coordinator(2, ttl=10)
    raw = _raw(server)
    hello = encode_frame(Frame(Kind.HELLO, 1, 0, {}), TOKEN)
    raw.send(hello)
    assert decode_frame(raw.recv(), TOKEN).kind == Kind.OK
    raw.send(hello)  # replayed
    raw.send(encode_frame(Frame(Kind.PUT, 1, 7, {"key": "k", "value": "v"}), TOKEN))  # reordered
    raw.send(b"CSKV" + b"\0" * (MAX_FRAME_BYTES + 10))  # oversized
    assert not raw.poll(500)  # none of them acted on or answered
    assert server.rejected == 3
    big = "v" * (64 * 1024 + 1)
    raw.send(encode_frame(Frame(Kind.PUT, 1, 1, {"key": "k", "value": big}), TOKEN))
    reply = decode_frame(raw.recv(), TOKEN)
    assert reply.kind == Kind.ERROR and "at most 65536 bytes" in reply.body["reason"]
    raw.close()
    with CoordinatorClient(server.endpoint, TOKEN, 0, connect_timeout=2) as client:
        with pytest.raises(CoordinatorError, match="exceeds"):
            client.put("k", big)
        with pytest.raises(CoordinatorError, match="no value"):
            client.get("k", timeout=0.3)  # the oversized put stored nothing


def test_duplicate_rank_is_refused(coordinator):
    server = coordinator(2, ttl=10)
    with CoordinatorClient(server.endpoint, TOKEN, 0):
        with pytest.raises(CoordinatorError, match="duplicate rank"):
            CoordinatorClient(server.endpoint, TOKEN, 0)


def _participant_in_a_process(server, arguments: str, then: str) -> subprocess.Popen:
    """A participant in a process of its own (to be killed), joined with ``CoordinatorClient(endpoint, token,
    ARGUMENTS)`` and then running ``then``."""
    victim = subprocess.Popen([sys.executable, "-c", (
        "import time; from coldsnap.coord import CoordinatorClient\n"
        f"c = CoordinatorClient({server.endpoint!r}, {TOKEN!r}, {arguments})\n"
        f"print('in', flush=True); {then}")], stdout=subprocess.PIPE)
    assert victim.stdout.readline().strip() == b"in"
    return victim


def test_rank_killed_mid_barrier_fails_the_others_fast(coordinator):
    server = coordinator(3, ttl=60)
    victim = _participant_in_a_process(server, "2", "c.barrier('cuda-restored', timeout=60)")
    outcome = {}

    def waiter():
        with CoordinatorClient(server.endpoint, TOKEN, 0) as client:
            started = time.monotonic()
            try:
                client.barrier("cuda-restored", timeout=60)
            except CoordinatorError as exc:
                outcome.update(error=str(exc), seconds=time.monotonic() - started)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    thread.join(20)
    assert "rank [2] stopped responding" in outcome["error"]
    assert outcome["seconds"] < 5  # not the 60 s barrier timeout


def test_coordinator_killed_clients_fail_fast(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    endpoint_file = tmp_path / "endpoint.json"
    server = subprocess.Popen([sys.executable, "-m", "coldsnap", "coordinator", "--listen", "127.0.0.1:0", "--token-file",
                               str(token_file), "--ranks", "2", "--ttl", "60", "--endpoint-file", str(endpoint_file)],
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not endpoint_file.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        endpoint = json.loads(endpoint_file.read_text())["endpoint"]
        client = CoordinatorClient(endpoint, TOKEN, 0)
        threading.Timer(0.5, lambda: os.kill(server.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(CoordinatorError, match="went away"):
            client.barrier("release", timeout=60)
        assert time.monotonic() - started < 5
        client.close(completed=False)
    finally:
        server.kill()
        server.wait()


def test_ttl_ends_the_coordinator(coordinator):
    server = coordinator(2, ttl=0.3)
    server.thread.join(5)
    assert server.result["reason"] == "ttl"


def test_cli_usage_errors(tmp_path):
    short = tmp_path / "short"
    short.write_bytes(b"tiny")
    result = subprocess.run([sys.executable, "-m", "coldsnap", "coordinator", "--listen", "127.0.0.1:0",
                             "--token-file", str(short), "--ranks", "2"], capture_output=True, timeout=60)
    assert result.returncode == 2 and b"at least 16 bytes" in result.stderr and b"Traceback" not in result.stderr


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_decoder_fuzz_raises_only_frame_errors(data):
    try:
        decode_frame(data, TOKEN)
    except FrameError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(Kind)), st.integers(0, 2**32 - 1), st.integers(0, 2**63 - 1),
       st.dictionaries(st.text(max_size=8), st.text(max_size=32), max_size=4), st.integers(0, 200))
def test_roundtrip_and_any_flipped_byte_is_caught(kind, rank, sequence, body, flip):
    encoded = encode_frame(Frame(kind, rank, sequence, body), TOKEN)
    assert decode_frame(encoded, TOKEN) == Frame(kind, rank, sequence, body)
    position = flip % len(encoded)
    altered = encoded[:position] + bytes([encoded[position] ^ 0x01]) + encoded[position + 1:]
    with pytest.raises(FrameError):
        decode_frame(altered, TOKEN)


def test_golden_frames(corpus):
    for case in corpus["cskv_frames"]["cases"]:
        token = bytes.fromhex(case["token_hex"])
        frame = Frame(Kind[case["kind"]], case["rank"], case["sequence"], case["body"])
        assert encode_frame(frame, token).hex() == case["frame_hex"], case["name"]
        assert decode_frame(bytes.fromhex(case["frame_hex"]), token) == frame


def test_the_last_bye_is_answered_although_the_coordinator_then_closes(coordinator):
    """Every rank's BYE completes the activation and the coordinator closes at once: its last reply and
    the disconnect reach the last rank together, and the reply wins (a race seen in a vLLM TP2 capture)."""
    for _ in range(20):
        server = coordinator(2)
        errors = []

        def rank(r):
            try:
                client = CoordinatorClient(server.endpoint, TOKEN, r)
                client.barrier("done", timeout=10)
                client.close(completed=True)
            except Exception as exc:  # collected: asserted below
                errors.append(repr(exc))

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert errors == []
        server.thread.join(5)
        assert server.result["reason"] == "complete"


def test_units_and_ranks_meet_at_barriers_of_their_own(coordinator):
    """Two units' launchers and their four ranks: a unit barrier waits for both units only, a rank
    barrier of the same name for all four ranks; a rank that said BYE joins again (a restored process);
    the coordinator ends when both units said BYE, not when the ranks did."""
    server = coordinator(4, units=2)
    errors = []
    ranks_done = threading.Barrier(4 + 2)  # a unit's launcher ends after its ranks did

    def participant(role, index):
        try:
            if role == "unit":  # one connection for the whole operation
                with CoordinatorClient(server.endpoint, TOKEN, index, role=role, keepalive=True) as client:
                    for _ in range(2):
                        client.barrier("dumped", timeout=20)
                    ranks_done.wait(20)
                    client.barrier("committed", timeout=20)
                return
            for _ in range(2):  # capture, then the capture's check restore: the ranks connect again
                with CoordinatorClient(server.endpoint, TOKEN, index, role=role) as client:
                    client.barrier("dumped", timeout=20)
            ranks_done.wait(20)
        except Exception as exc:
            errors.append((role, index, repr(exc)))

    threads = [threading.Thread(target=participant, args=("rank", r)) for r in range(4)]
    threads += [threading.Thread(target=participant, args=("unit", u)) for u in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    server.thread.join(10)
    assert errors == []
    assert server.result["reason"] == "complete"


def test_a_coordinator_without_units_refuses_a_unit(coordinator):
    server = coordinator(2, units=0)
    with pytest.raises(CoordinatorError, match="has no units"):
        CoordinatorClient(server.endpoint, TOKEN, 0, role="unit")


def test_a_unit_that_aborts_fails_every_other_participant_at_once(coordinator):
    server = coordinator(2, units=2)
    outcome = {}

    def waiter(role):
        with CoordinatorClient(server.endpoint, TOKEN, 0, role=role) as client:
            started = time.monotonic()
            try:
                client.barrier("restored", timeout=60)
            except CoordinatorError as exc:
                outcome[role] = (str(exc), time.monotonic() - started)

    threads = [threading.Thread(target=waiter, args=(role,)) for role in ("unit", "rank")]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    with CoordinatorClient(server.endpoint, TOKEN, 1, role="unit") as failing:
        failing.abort("admission.port: serving port 8000 is taken")
        with pytest.raises(CoordinatorError, match="unit 1 aborted"):
            failing.barrier("restored", timeout=60)  # later barriers answer it too
    for thread in threads:
        thread.join(10)
    for role in ("unit", "rank"):
        message, seconds = outcome[role]
        assert "unit 1 aborted the activation: admission.port: serving port 8000 is taken" in message
        assert seconds < 2


def test_a_unit_killed_during_its_own_work_fails_the_others_within_two_seconds(coordinator):
    """The victim is in no barrier (a unit's CRIU restore): only its keepalive tells it is alive."""
    server = coordinator(2, units=2)
    victim = _participant_in_a_process(server, "1, role='unit', keepalive=True", "time.sleep(60)")
    outcome = {}

    def waiter():
        with CoordinatorClient(server.endpoint, TOKEN, 0, role="unit", keepalive=True) as client:
            time.sleep(2.5)  # longer than LOST_AFTER_S outside any call: the keepalive keeps this one alive
            started = time.monotonic()
            try:
                client.barrier("restored", timeout=60)
            except CoordinatorError as exc:
                outcome.update(error=str(exc), seconds=time.monotonic() - started)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)
    killed = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    thread.join(20)
    assert "unit 1 stopped responding" in outcome["error"]
    assert time.monotonic() - killed < 5 and outcome["seconds"] < 2
