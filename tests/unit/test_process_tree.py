"""Restore preparation without CRIU: appended logs, shrunk files, taken pids, saved /dev/shm files."""

import os
import subprocess

import pytest

from coldsnap.snapshot.process_tree import ImageStateError, TreeFiles, prepare_restore, scan_tree, tree_pids


def test_appended_log_is_cut_back_and_the_extra_kept(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("captured\n")
    TreeFiles(pids=[], appended={str(log): 9}).save(tmp_path)
    with open(log, "a") as handle:
        handle.write("written by the last incarnation\n")
    prepare_restore(tmp_path)
    assert log.read_text() == "captured\n"
    (aside,) = tmp_path.glob("server.log.coldsnap-*")
    assert aside.read_text() == "written by the last incarnation\n"


def test_shm_files_are_put_back_as_captured_even_when_a_previous_incarnation_left_its_own(tmp_path):
    name = f"coldsnap-test-shm-{os.getpid()}"
    (tmp_path / "devshm").mkdir()
    (tmp_path / "devshm" / name).write_bytes(b"captured queue state")
    TreeFiles(pids=[], shm=[name]).save(tmp_path)
    live = f"/dev/shm/{name}"
    try:
        with open(live, "wb") as handle:  # what a killed restored tree leaves behind
            handle.write(b"advanced by the last incarnation")
        with open(live, "rb") as held:  # a process still holding the old file keeps its bytes
            prepare_restore(tmp_path)
            assert held.read() == b"advanced by the last incarnation"
        with open(live, "rb") as handle:
            assert handle.read() == b"captured queue state"
        os.unlink(live)
        prepare_restore(tmp_path)  # and a missing one is put back too
        with open(live, "rb") as handle:
            assert handle.read() == b"captured queue state"
    finally:
        if os.path.exists(live):
            os.unlink(live)


def test_shrunk_or_missing_file_is_refused(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("x")
    TreeFiles(pids=[], appended={str(log): 100}).save(tmp_path)
    with pytest.raises(ImageStateError, match="shrank"):
        prepare_restore(tmp_path)
    log.unlink()
    with pytest.raises(ImageStateError, match="no longer exists"):
        prepare_restore(tmp_path)


def test_taken_pid_is_waited_for_then_refused(tmp_path):
    TreeFiles(pids=[os.getpid()]).save(tmp_path)
    with pytest.raises(ImageStateError, match="still in use"):
        prepare_restore(tmp_path, wait_for_pids_s=0.1)


def test_missing_state_file_is_a_clear_error(tmp_path):
    with pytest.raises(ImageStateError, match="coldsnap-tree-files.json"):
        prepare_restore(tmp_path)


def test_scan_sees_children_and_written_files(tmp_path):
    target = tmp_path / "out.log"
    child = subprocess.Popen(["sh", "-c", f"exec 3>>{target}; sleep 30"])
    try:
        for _ in range(100):
            pids, written, _ = scan_tree(os.getpid())
            if str(target) in written:
                break
        assert child.pid in tree_pids(os.getpid()) and pids[0] == os.getpid()
        assert written[str(target)] == 0
    finally:
        child.kill()
        child.wait()


def test_tcp_connections_counts_connections_not_listeners_and_names_those_with_peers_outside():
    import socket
    import subprocess
    import sys

    from coldsnap.snapshot.process_tree import TcpConnection, tcp_connections

    me = [os.getpid()]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        before = tcp_connections(me)
        with socket.create_connection(listener.getsockname()):
            server, _ = listener.accept()
            with server:
                now = tcp_connections(me)
                # both ends live in this process: connected, none with a peer outside
                assert (now.connected, now.outside) == (before.connected + 2, before.outside)
        # an AF_INET6 client (its address ::ffff:127.0.0.1) in another process: one end here, its peer outside
        client = subprocess.Popen([sys.executable, "-c", "import socket, sys; s = socket.socket(socket.AF_INET6); "
                                   f"s.connect(('::ffff:127.0.0.1', {port})); print(s.getsockname()[1], flush=True); "
                                   "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            client_port = int(client.stdout.readline())
            server, _ = listener.accept()
            with server:
                now = tcp_connections(me)
                # named as people write it: the holder, this end, the peer (the mapped address as IPv4)
                assert now.connected == before.connected + 1
                assert now.outside == (*before.outside, TcpConnection(os.getpid(), f"127.0.0.1:{port}",
                                                                      f"127.0.0.1:{client_port}"))
                assert str(now.outside[-1]) == f"pid {os.getpid()} holds 127.0.0.1:{port} -> 127.0.0.1:{client_port}"
                both = tcp_connections(me + [client.pid])  # the client's process in the tree too: inside
                assert (both.connected, both.outside) == (before.connected + 2, before.outside)
        finally:
            client.communicate("", timeout=10)
    assert tcp_connections(me) == before


def test_tcp_connections_names_ipv6_ends_in_brackets():
    import socket

    from coldsnap.snapshot.process_tree import tcp_connections

    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with socket.socket(socket.AF_INET6) as listener:
        try:
            listener.bind(("::1", 0))
        except OSError as exc:
            pytest.skip(f"no IPv6 loopback here: {exc}")
        listener.listen(1)
        port = listener.getsockname()[1]
        before = tcp_connections([os.getpid()])
        with socket.create_connection(("::1", port)) as client:
            # the accepted end is still in the listener's queue, held by no process: the peer is outside
            outside = set(tcp_connections([os.getpid()]).outside) - set(before.outside)
            assert [str(c) for c in outside] == [f"pid {os.getpid()} holds [::1]:{client.getsockname()[1]} -> [::1]:{port}"]


def test_copy_sparse_keeps_the_bytes_and_writes_only_data(tmp_path):
    from coldsnap.snapshot.shm import copy_sparse

    source = tmp_path / "queue"
    with open(source, "wb") as handle:
        handle.truncate(64 << 20)  # a hole
        handle.seek(5 << 20)
        handle.write(b"\0" * (2 << 20))  # written zeros: data to the file system, zeros to us
        handle.seek((9 << 20) + 17)
        handle.write(b"message")
        handle.seek((64 << 20) - 3)
        handle.write(b"end")
    os.chmod(source, 0o600)
    target = tmp_path / "copy"
    written = copy_sparse(source, target)
    assert target.read_bytes() == source.read_bytes()
    assert written <= 2 << 20 and oct(target.stat().st_mode & 0o777) == "0o600"
    assert target.stat().st_blocks * 512 <= 4 << 20  # a sparse copy, not 64 MiB


def test_killing_a_tree_removes_the_socket_files_it_bound_and_not_the_ones_it_connected_to(tmp_path):
    import socket
    import sys
    import time

    from coldsnap.snapshot.process_tree import bound_socket_files, kill_tree

    outside = tmp_path / "outside.sock"  # a listener of someone else's (a journal, a launcher)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(outside))
    listener.listen()
    own = tmp_path / "own.sock"  # what a SIGKILLed vLLM leaves: its ZeroMQ ipc:// endpoint
    child = subprocess.Popen([sys.executable, "-c", f"""
import socket, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.bind({str(own)!r}); s.listen()
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); c.connect({str(outside)!r})
print("ready", flush=True); time.sleep(600)
"""], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout.readline() == b"ready\n"
        accepted, _ = listener.accept()
        assert bound_socket_files([child.pid]) == [own]
        kill_tree(child.pid)
        deadline = time.monotonic() + 5
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not own.exists() and outside.exists()
        accepted.close()
    finally:
        if child.poll() is None:
            child.kill()
        listener.close()
