"""What tests/integration/test_container_image.py runs inside the reference image (bind-mounted there):
cold start, capture and restore of the reference workload, each step's result as JSON in DIR.

    python container_steps.py DIR STEP [STEP...]        STEP: cold | capture | restore | publish | restore-oci

``cold``: start ``python -m coldsnap.workloads.torch_lm --size tiny`` plainly, ask the check prompt
(greedy), stop it; its tokens go to DIR/cold.json. ``capture``: ``coldsnap capture --out DIR/artifact``
of the same command (receipt DIR/capture-receipt.json). ``restore``: ``coldsnap restore DIR/artifact``
(receipt DIR/restore-receipt-HOST.json), ask the restored server the check prompt, stop it; its tokens go
to DIR/restored-HOST.json (HOST: the container's host name, so two containers' restores stay apart).
``publish``: ``coldsnap publish DIR/artifact $COLDSNAP_TEST_REF --json`` (the registry's CA and auth file
from the environment) into DIR/published.json. ``restore-oci``: ``coldsnap restore oci://REF`` of the
reference in DIR/published.json (no artifact in DIR: the registry alone), asked and stopped as ``restore``;
DIR/restored-oci-HOST.json.
Runs with the image's Python, which has coldsnap; exits 1 with the failing step's output on stderr.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from coldsnap.activation.canary import ask_canary
from coldsnap.contracts.receipt import restored_pid
from coldsnap.demo import CHECK_PROMPT, cold_start
from coldsnap.snapshot.process_tree import kill_tree

PORT = 8431  # the container's own network namespace: nothing else listens there
MAX_TOKENS = 8
WORKLOAD = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu", "--port", str(PORT)]


def _coldsnap(*args: str) -> None:
    done = subprocess.run(["coldsnap", *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"container_steps: coldsnap {args[0]} exited {done.returncode}")


def cold(directory: Path) -> None:
    seconds, tokens = cold_start(WORKLOAD, PORT, timeout=300, prompt=CHECK_PROMPT, max_tokens=MAX_TOKENS,
                                 log=directory / "cold.log")
    (directory / "cold.json").write_text(json.dumps({"tokens": tokens, "seconds": seconds}))


def capture(directory: Path) -> None:
    _coldsnap("capture", "--out", str(directory / "artifact"), "--receipt-json", str(directory / "capture-receipt.json"),
              "--", *WORKLOAD)


def restore(directory: Path) -> None:
    host = socket.gethostname()
    receipt_path = directory / f"restore-receipt-{host}.json"
    _coldsnap("restore", str(directory / "artifact"), "--receipt-json", str(receipt_path))
    pid = restored_pid(json.loads(receipt_path.read_text()))
    try:
        tokens = ask_canary(PORT, CHECK_PROMPT, MAX_TOKENS).token_ids
    finally:
        if pid is not None:
            kill_tree(pid)
    (directory / f"restored-{host}.json").write_text(json.dumps({"tokens": tokens, "restored_pid": pid}))


def _ask_and_stop(receipt_path: Path) -> tuple[list[int], int | None]:
    pid = restored_pid(json.loads(receipt_path.read_text()))
    try:
        return ask_canary(PORT, CHECK_PROMPT, MAX_TOKENS).token_ids, pid
    finally:
        if pid is not None:
            kill_tree(pid)


def publish(directory: Path) -> None:
    done = subprocess.run(["coldsnap", "publish", str(directory / "artifact"), os.environ["COLDSNAP_TEST_REF"], "--json"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"container_steps: coldsnap publish exited {done.returncode}")
    (directory / "published.json").write_text(done.stdout)


def restore_oci(directory: Path) -> None:
    host = socket.gethostname()
    reference = json.loads((directory / "published.json").read_text())["reference"]
    receipt_path = directory / f"restore-oci-receipt-{host}.json"
    _coldsnap("restore", f"oci://{reference}", "--receipt-json", str(receipt_path))
    tokens, pid = _ask_and_stop(receipt_path)
    (directory / f"restored-oci-{host}.json").write_text(json.dumps({"tokens": tokens, "restored_pid": pid}))


STEPS = {"cold": cold, "capture": capture, "restore": restore, "publish": publish, "restore-oci": restore_oci}

if __name__ == "__main__":
    directory, steps = Path(sys.argv[1]), sys.argv[2:]
    unknown = [step for step in steps if step not in STEPS]
    if not steps or unknown:
        raise SystemExit(f"usage: container_steps.py DIR {{{'|'.join(STEPS)}}}... (unknown: {unknown})")
    for step in steps:
        STEPS[step](directory)
