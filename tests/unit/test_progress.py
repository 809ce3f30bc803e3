"""Progress output: in-place bar on a terminal, quarter lines otherwise; agent progress lines reach the launcher."""

import io
import threading

from coldsnap.agent.client import AgentClient
from coldsnap.agent.protocol import Hydrated, Reply, Resume, ResumeReply, encode
from coldsnap.agent.progress_lines import ProgressLines
from coldsnap.progress import PhaseProgress, ProgressBar


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_plain_stream_gets_a_line_per_quarter():
    out = io.StringIO()
    bar = ProgressBar("hydrating", out)
    for done in range(0, 101, 5):
        bar.update(done * 10**7, 10**9)
    bar.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 and lines[0].startswith("hydrating   0.0%") and "100.0%" in lines[-1]


def test_terminal_redraws_in_place():
    out = _Tty()
    phases = PhaseProgress("restore: ", out)
    phases("hydrating weights", 1, 2)
    phases("hydrating weights", 2, 2)
    phases.finish()
    assert out.getvalue().count("\r") == 2 and out.getvalue().endswith("\n") and "[####" in out.getvalue()


def test_agent_progress_lines_reach_the_launcher(tmp_path):
    import socket

    name = f"@coldsnap-progress-test-{id(tmp_path)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(b"\0" + name[1:].encode())
    listener.listen(1)

    def agent():
        connection, _ = listener.accept()
        with connection:
            connection.makefile("rb").readline()
            report = ProgressLines(connection).phase("hydrating weights")
            report(5, 10)
            report(10, 10)
            reply = ResumeReply(rank=0, hydrate=Hydrated(source="none"), seconds={"hydrate": 1.0}, graphs_recaptured=[])
            connection.sendall(encode(Reply(ok=True, reply=reply)))

    thread = threading.Thread(target=agent)
    thread.start()
    seen = []
    reply = AgentClient(name).resume(Resume(layout_digest="d" * 64), on_progress=lambda *update: seen.append(update))
    thread.join(5)
    listener.close()
    assert reply.seconds == {"hydrate": 1.0}
    assert seen == [("hydrating weights", 5, 10), ("hydrating weights", 10, 10)]
