"""The agent's control transport: one JSON line per command, file descriptors riding along in order."""

import os
import socket
import threading

from coldsnap.agent.client import AgentClient
from coldsnap.agent.protocol import (
    MAX_FDS_PER_MESSAGE,
    Hydrated,
    Reply,
    Resume,
    ResumeReply,
    decode_command,
    encode,
    receive_line,
)


def _serve_once(control: str, seen: dict) -> threading.Thread:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(b"\0" + control[1:].encode())
    listener.listen(1)

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            line, fds = receive_line(connection)
            seen["command"] = decode_command(line)
            seen["payloads"] = [os.read(fd, 16) for fd in fds]
            for fd in fds:
                os.close(fd)
            reply = ResumeReply(rank=0, hydrate=Hydrated(source="native", bytes=len(fds), staged=True), seconds={},
                                graphs_recaptured=[])
            connection.sendall(encode(Reply(ok=True, reply=reply)))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_descriptors_arrive_in_order_across_batches():
    count = 2 * MAX_FDS_PER_MESSAGE + 7  # three SCM_RIGHTS messages
    pipes = [os.pipe() for _ in range(count)]
    for index, (read_end, write_end) in enumerate(pipes):
        os.write(write_end, str(index).encode())
        os.close(write_end)
    seen: dict = {}
    control = f"@coldsnap-test-transport-{os.getpid()}"
    thread = _serve_once(control, seen)
    command = Resume(layout_digest="d" * 64, adopted={"weights": count})
    try:
        reply = AgentClient(control, timeout=10).resume(command, fds=[r for r, _ in pipes])
    finally:
        for read_end, _ in pipes:
            os.close(read_end)  # the sender keeps (and closes) its own copies
    thread.join(5)
    assert reply.hydrate.bytes == count
    assert seen["command"] == command
    assert seen["payloads"] == [str(i).encode() for i in range(count)]


def test_a_command_without_descriptors_is_one_plain_line():
    seen: dict = {}
    control = f"@coldsnap-test-transport-plain-{os.getpid()}"
    thread = _serve_once(control, seen)
    AgentClient(control, timeout=10).resume(Resume(layout_digest="d" * 64))
    thread.join(5)
    assert seen == {"command": Resume(layout_digest="d" * 64), "payloads": []}
