"""The ``--tp N`` supervisor: starts the rank processes, wires rank 0 to the others, ends with them.

Rank 0 gets one end of a socket pair per other rank (its request channels); rank r the other end of
its pair. The supervisor imports no torch and touches no GPU, so it costs the process image little.
When any rank exits, the others are killed and the supervisor exits with that rank's status: a
tensor-parallel group is whole or gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

__all__ = ["supervise"]


def supervise(argv: list[str], world: int, first: int = 0, local: int | None = None, channels: bool = True) -> int:
    """Run ranks ``first .. first+local-1`` of ``world`` (all of them by default); with ``channels``, rank 0's
    request channels to the others are socket pairs made here (one host), else the ranks meet rank 0 at
    ``--master-addr`` (``--nnodes``)."""
    local = world if local is None else local
    pairs = [socket.socketpair() for _ in range(world - 1)] if channels else []
    command = [sys.executable, "-m", "coldsnap.workloads.torch_lm", *argv]
    ranks: list[subprocess.Popen] = []
    try:
        if channels:
            leader_fds = [leader.fileno() for leader, _ in pairs]
            ranks.append(subprocess.Popen(command + ["--rank", "0", "--channels", ",".join(map(str, leader_fds))],
                                          pass_fds=leader_fds))
            for rank, (_, follower) in enumerate(pairs, start=1):
                ranks.append(subprocess.Popen(command + ["--rank", str(rank), "--channels", str(follower.fileno())],
                                              pass_fds=[follower.fileno()]))
        else:
            for rank in range(first, first + local):
                ranks.append(subprocess.Popen(command + ["--rank", str(rank)]))
    except OSError as exc:
        for process in ranks:
            process.kill()
        sys.stderr.write(f"torch_lm: cannot start rank {len(ranks)}: {exc}\n")
        return 1
    finally:
        for leader, follower in pairs:  # the ranks hold them now
            leader.close()
            follower.close()

    def stop(signum: int, _frame: object) -> None:
        for process in ranks:
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    by_pid = {process.pid: first + index for index, process in enumerate(ranks)}
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
        if pid in by_pid:
            break
    code = os.waitstatus_to_exitcode(status)
    sys.stderr.write(f"torch_lm: rank {by_pid[pid]} exited ({code}); stopping the other ranks\n")
    for process in ranks:
        if process.pid != pid and process.poll() is None:
            process.kill()
            process.wait()
    return code if code > 0 else 1
