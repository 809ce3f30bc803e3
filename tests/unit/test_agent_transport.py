"""The agent's control transport: one JSON line per command, file descriptors riding along in order."""

import json
import os
import socket
import threading

from coldsnap.agent.server import MAX_FDS_PER_MESSAGE, _receive_line, request


def _serve_once(control: str, seen: dict) -> threading.Thread:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(b"\0" + control[1:].encode())
    listener.listen(1)

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            line, fds = _receive_line(connection)
            seen["command"] = json.loads(line)
            seen["payloads"] = [os.read(fd, 16) for fd in fds]
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"ok": True, "count": len(fds)}).encode() + b"\n")

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
    try:
        reply = request(control, {"command": "resume", "adopted": {"weights": count}}, timeout=10,
                        fds=[r for r, _ in pipes])
    finally:
        for read_end, _ in pipes:
            os.close(read_end)  # the sender keeps (and closes) its own copies
    thread.join(5)
    assert reply == {"count": count}
    assert seen["command"] == {"command": "resume", "adopted": {"weights": count}}
    assert seen["payloads"] == [str(i).encode() for i in range(count)]


def test_a_command_without_descriptors_is_one_plain_line():
    seen: dict = {}
    control = f"@coldsnap-test-transport-plain-{os.getpid()}"
    thread = _serve_once(control, seen)
    assert request(control, {"command": "status"}, timeout=10) == {"count": 0}
    thread.join(5)
    assert seen == {"command": {"command": "status"}, "payloads": []}
