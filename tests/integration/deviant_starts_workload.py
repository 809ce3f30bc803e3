"""A stand-in for an engine whose starts do not all compute alike, for the capture's reference check
(tests/integration/test_capture_reference.py): the fault it checks for (a captured vLLM answering unlike
every plain start of its command, seen on some GPU hosts' first start) cannot be made to happen here.

    deviant_starts_workload.py KIND COUNTER -- TORCH_LM_ARGS...

runs ``python -m coldsnap.workloads.torch_lm TORCH_LM_ARGS`` in this process (exec: the tree stays one process)
with ``--seed`` chosen by KIND, counting starts in the file COUNTER (a start under ``coldsnap capture`` is one
with ``COLDSNAP_CONTROL`` set; other weights answer the canary differently):

    fine            every start seed 0
    capture-always  every start under capture seed 1
    capture-first   the first start under capture seed 1, the others 0
    plain-first     the first plain start seed 1, the others 0
    every-start     start N seed N: no two starts alike
"""

import os
import sys
from pathlib import Path

KINDS = ("fine", "capture-always", "capture-first", "plain-first", "every-start")


def main() -> None:
    kind, counter, separator, *rest = sys.argv[1:]
    if kind not in KINDS or separator != "--":
        raise SystemExit(__doc__)
    under_capture = bool(os.environ.get("COLDSNAP_CONTROL"))
    path = Path(counter)
    starts = path.read_text().split() if path.exists() else []
    starts.append("capture" if under_capture else "plain")
    path.write_text(" ".join(starts))
    first_of_its_kind = starts.count(starts[-1]) == 1
    seed = {"fine": 0, "capture-always": int(under_capture), "capture-first": int(under_capture and first_of_its_kind),
            "plain-first": int(not under_capture and first_of_its_kind), "every-start": len(starts)}[kind]
    os.execv(sys.executable, [sys.executable, "-m", "coldsnap.workloads.torch_lm", *rest, "--seed", str(seed)])


if __name__ == "__main__":
    main()
