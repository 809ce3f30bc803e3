"""Dump and restore a live server tree with real CRIU: TCP (listening and established), unix sockets,
an unlinked /dev/shm file, an appended log; restore twice from one image; faults leave nothing running."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.criu_binary import CriuError
from coldsnap.snapshot.criu_options import SnapshotOptions
from coldsnap.snapshot.process_tree import kill_tree, namespace_pid
from tests.helpers import free_port

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU dump/restore needs root"),
]
REPO = Path(__file__).resolve().parents[2]



def _ask(port: int, timeout: float = 10.0, command: bytes = b"inc") -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(command + b"\n")
                return conn.recv(256).decode().strip()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture
def workload_args() -> list[str]:
    return []


@pytest.fixture
def server(tmp_path, workload_args):
    port = free_port()
    state = tmp_path / "state"
    state.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.tree_workload", str(port), str(state), *workload_args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=open(state / "stdout.log", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own session: CRIU needs no --shell-job
    )
    roots = [process.pid]
    yield port, state, process, roots
    for root in roots:
        kill_tree(root)
    if process.poll() is None:
        process.wait(timeout=10)
    Path(f"/dev/shm/coldsnap-tree-named-{process.pid}").unlink(missing_ok=True)


def _dump(snapshotter, process, images):
    result = snapshotter.dump(process.pid, images)
    process.wait(timeout=10)  # reap: the restore reuses its pid
    return result


def test_dump_restore_twice_keeps_sockets_state_and_logs(server, tmp_path):
    port, state, process, roots = server
    assert _ask(port) == "count 1 tcp-ok unix-ok"
    assert _ask(port) == "count 2 tcp-ok unix-ok"
    snapshotter = CriuSnapshotter()
    images = tmp_path / "images"
    dumped = _dump(snapshotter, process, images)
    assert len(dumped.pids) == 2 and dumped.image_bytes > 2 << 20  # the unlinked 2 MiB shm file is in it
    named = Path(f"/dev/shm/coldsnap-tree-named-{process.pid}")
    assert (images / "devshm" / named.name).read_bytes() == b"named"  # the linked one, saved with the image
    assert not named.exists()  # and taken out of /dev/shm: the dumped tree is gone
    log_at_dump = (state / "server.log").read_text()

    for _ in range(2):  # one image, restored twice
        restored = snapshotter.restore(images, tmp_path / "restore-state")
        roots.append(restored.pid)
        assert namespace_pid(restored.pid) == process.pid  # its captured pid, in a namespace of its own
        assert _ask(port) == "count 3 tcp-ok unix-ok"  # state from the image, channels alive
        assert _ask(port) == "count 4 tcp-ok unix-ok"
        kill_tree(restored.pid)
        named.unlink(missing_ok=True)  # gone with the incarnation (a cleanup, another host): restore brings it back
    assert (state / "server.log").read_text() == log_at_dump + "inc 3\ninc 4\n"
    set_aside = sorted(state.glob("server.log.coldsnap-*"))
    assert len(set_aside) == 1 and set_aside[0].read_text() == "inc 3\ninc 4\n"  # nothing lost


_COUNTING_WRITER = """
import sys, time
with open(sys.argv[1], "a", buffering=1) as log:
    count = 0
    while True:
        count += 1
        log.write(f"{count}\\n")
        time.sleep(0.0005)
"""


def test_a_log_the_tree_appends_to_until_the_freeze_restores_without_a_gap(tmp_path):
    """The tree writes until CRIU freezes it, after the dump's scan of its files: the image keeps the size
    the frozen tree left, so a restore cuts nothing the restored process believes written (the echo pair of
    test_unit_connections.py once lost a line that way)."""
    log = tmp_path / "counter.log"
    writer = subprocess.Popen([sys.executable, "-c", _COUNTING_WRITER, str(log)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    roots = [writer.pid]
    try:
        time.sleep(1.0)
        snapshotter = CriuSnapshotter(options=SnapshotOptions(tcp="none"))
        _dump(snapshotter, writer, tmp_path / "images")
        at_dump = log.read_text().splitlines()
        restored = snapshotter.restore(tmp_path / "images", tmp_path / "restore-state")
        roots.append(restored.pid)
        time.sleep(0.5)
        kill_tree(restored.pid)
        counts = [int(line) for line in log.read_text().splitlines()]
        assert counts[:len(at_dump)] == [int(line) for line in at_dump]
        assert counts == list(range(1, len(counts) + 1)) and len(counts) > len(at_dump)  # no gap, no repeat
        assert not list(tmp_path.glob("counter.log.coldsnap-*"))  # nothing set aside: nothing was past the image
    finally:
        for root in roots:
            kill_tree(root)


def test_connections_inside_the_tree_are_dumped_without_a_network_lock(server, tmp_path, monkeypatch):
    """The tree's TCP link joins two of its own processes (no peer outside), so capture dumps it without a
    network lock (``skip``): CRIU keeps the method in the image and uses it at restore whatever the
    restore's flag says, so restores run no nftables at all (with ``nftables`` each restore deletes the
    dump's table: a failing command after the first restore) — and the link works after each of two
    restores."""
    from coldsnap.snapshot.process_tree import tcp_connections, tree_pids

    port, state, process, roots = server
    assert _ask(port) == "count 1 tcp-ok unix-ok"
    # The server closes its end of _ask's connection after the answer reaches us: until it has, that end
    # is still an established connection with a peer outside the tree (a race CI once lost).
    deadline = time.monotonic() + 10
    while (connections := tcp_connections(tree_pids(process.pid))).outside and time.monotonic() < deadline:
        time.sleep(0.02)
    assert connections.connected == 2 and connections.outside == (), connections
    images = tmp_path / "images"
    _dump(CriuSnapshotter(options=SnapshotOptions(network_lock="skip")), process, images)
    monkeypatch.setenv("COLDSNAP_CRIU_LOG_LEVEL", "3")
    for attempt in range(2):
        restore_state = tmp_path / f"restore-state-{attempt}"
        restored = CriuSnapshotter().restore(images, restore_state)  # (its --network-lock nftables: ignored)
        roots.append(restored.pid)
        assert _ask(port) == "count 2 tcp-ok unix-ok"
        log = "".join(p.read_text() for p in (restore_state / "criu").glob("restore-*.log"))
        assert "Unlock network" in log and "delete table" not in log and "CRIU-" not in log
        kill_tree(restored.pid)


@pytest.mark.parametrize("workload_args", [["--no-internal-tcp"]])
def test_tcp_close_mode_drops_outside_connections(server, tmp_path):
    # Close mode is for trees whose live connections all lead outside (clients): they are dropped.
    # Connections inside the tree need the established mode (restored closed, their ports would still
    # be in TIME_WAIT and the rebind fails).
    port, state, process, roots = server
    assert _ask(port) == "count 1 tcp-none unix-ok"
    client = socket.create_connection(("127.0.0.1", port), timeout=5)  # open across the snapshot
    snapshotter = CriuSnapshotter(options=SnapshotOptions(tcp="close"))
    images = tmp_path / "images"
    _dump(snapshotter, process, images)
    restored = snapshotter.restore(images, tmp_path / "restore-state")
    roots.append(restored.pid)
    assert _ask(port) == "count 2 tcp-none unix-ok"
    with client:
        client.sendall(b"inc\n")
        try:
            answer = client.recv(64)
        except OSError:
            answer = b""
    assert answer == b""  # the old connection did not survive


def test_corrupt_image_fails_typed_and_leaves_nothing_running(server, tmp_path):
    port, state, process, roots = server
    _ask(port)
    snapshotter = CriuSnapshotter()
    images = tmp_path / "images"
    _dump(snapshotter, process, images)
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    pages.write_bytes(b"")  # the memory pages are gone
    core = sorted(images.glob("core-*.img"))[0]
    core.write_bytes(b"\0" * 16)
    with pytest.raises(CriuError) as caught:
        snapshotter.restore(images, tmp_path / "restore-state")
    assert caught.value.op == "restore" and caught.value.errno not in (None, 0)
    assert caught.value.log_tail  # the reason from restore.log
    assert not os.path.exists(f"/proc/{process.pid}")  # CRIU killed what it had restored


def test_a_restore_in_the_hosts_namespace_is_refused_while_its_pids_are_taken(server, tmp_path):
    port, state, process, roots = server
    _ask(port)
    snapshotter = CriuSnapshotter()
    images = tmp_path / "images"
    _dump(snapshotter, process, images)
    restored = snapshotter.restore(images, tmp_path / "restore-state", replica=False)
    roots.append(restored.pid)
    assert restored.pid == process.pid and restored.host_pids == {}  # the captured pids, on the host itself
    with pytest.raises(CriuError, match="still in use"):
        snapshotter.restore(images, tmp_path / "restore-state", wait_for_pids_s=0.2, replica=False)
    assert _ask(port) == "count 2 tcp-ok unix-ok"  # the running incarnation is untouched


def test_dump_refuses_non_empty_image_dir_and_missing_process(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "something").write_text("x")
    with pytest.raises(CriuError, match="not empty"):
        CriuSnapshotter().dump(os.getpid(), images)
    with pytest.raises(CriuError, match="no process"):
        CriuSnapshotter().dump(2**22 + 12345, tmp_path / "other")


def _tree_state(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_files_of_the_owned_root_stay_untouched_and_the_root_can_move(server, tmp_path):
    """The tree's logs inside ``owned_root`` (an artifact's ``logs/``) are dumped as external files: a
    restore from a moved root writes nothing into it or the images; the restored tree appends to a
    copy of each log (its captured bytes first) in the state directory."""
    port, state, process, roots = server
    assert _ask(port) == "count 1 tcp-ok unix-ok"
    snapshotter = CriuSnapshotter()
    images = tmp_path / "images"
    snapshotter.dump(process.pid, images, owned_root=state)
    process.wait(timeout=10)
    log_at_dump = (state / "server.log").read_text()
    moved = tmp_path / "moved-elsewhere"
    state.rename(moved)  # the artifact was moved (or copied to another disk)
    before = {"root": _tree_state(moved), "images": _tree_state(images)}
    restore_state = tmp_path / "restore-state"

    restored = snapshotter.restore(images, restore_state, owned_root=moved)
    roots.append(restored.pid)
    assert _ask(port) == "count 2 tcp-ok unix-ok"
    kill_tree(restored.pid)
    assert {"root": _tree_state(moved), "images": _tree_state(images)} == before  # not a byte written
    assert (restore_state / "server.log").read_text() == log_at_dump + "inc 2\n"
    assert sorted(p.name for p in (restore_state / "criu").iterdir() if p.suffix == ".log")  # CRIU's log is there

    restored = snapshotter.restore(images, restore_state, owned_root=moved)  # again: the last log set aside
    roots.append(restored.pid)
    assert _ask(port) == "count 2 tcp-ok unix-ok"
    kill_tree(restored.pid)
    assert (restore_state / "server.log.previous").read_text() == log_at_dump + "inc 2\n"
    assert (restore_state / "server.log").read_text() == log_at_dump + "inc 2\n"


def _digests(port: int) -> str:
    return _ask(port, command=b"digest")


def test_zero_pages_left_out_restore_the_same_memory(tmp_path):
    """A dump leaves the zero pages of private anonymous memory out; the restored parent and its
    copy-on-write child hold the same bytes as before (zeros the child wrote over its parent's pages,
    zeros written over a file-backed private mapping's bytes, short and long zero runs)."""
    from coldsnap.snapshot.criu_pages import image_census

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.integration.zero_pages_workload", str(port)], cwd=REPO,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    roots = [process.pid]
    try:
        before = _digests(port)
        images = tmp_path / "images"
        snapshotter = CriuSnapshotter()
        result = _dump(snapshotter, process, images)
        census = result.census
        assert census is not None and census.dropped_bytes >= 2 * (12 << 20)  # each process's long zero runs
        assert all(p.comm == "python" or p.comm.startswith("python") for p in census.processes)
        assert image_census(images).zero_bytes == 0  # nothing droppable is left
        for attempt in range(2):  # the compacted image restores more than once
            restored = snapshotter.restore(images, tmp_path / f"state-{attempt}")
            roots.append(restored.pid)
            assert _digests(port) == before
            kill_tree(restored.pid)
    finally:
        for root in roots:
            kill_tree(root)


def _mapping(pid: int, start: int) -> dict[str, str]:
    """The smaps fields of ``pid``'s mapping that starts at ``start``."""
    fields: dict[str, str] = {}
    with open(f"/proc/{pid}/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == start
            elif inside:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return fields


def _present_pages(pid: int, start: int, pages: int) -> int:
    """How many of ``pages`` pages from ``start`` are mapped in ``pid`` (/proc/PID/pagemap's bit 63)."""
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        pagemap.seek(start // PAGE * 8)
        entries = pagemap.read(pages * 8)
    return sum(int.from_bytes(entries[i:i + 8], "little") >> 63 for i in range(0, len(entries), 8))


PAGE = 4096


def test_huge_page_fill_gives_the_same_memory_and_takes_back_its_advice(tmp_path, monkeypatch):
    """This project's CRIU (scripts/build-criu.sh) with the host's THP mode ``madvise``: a restore fills a
    big private mapping into huge pages, with the same bytes, maps the zeros the image left out (to the
    huge zero page, so later reads do not fault page by page) and leaves the mapping advised
    MADV_NOHUGEPAGE (no huge pages for memory touched later, as before the dump);
    COLDSNAP_CRIU_THP_FILL=0 fills 4 KiB pages and leaves the zeros unmapped. (Forced on: the default,
    auto, leaves it off on a VM that reports free pages to its host, as CI's machine does.)"""
    from coldsnap.snapshot.criu_binary import Criu
    from coldsnap.snapshot.thp import thp_mode

    monkeypatch.setenv("COLDSNAP_CRIU_THP_FILL", "1")
    if not Criu().version().fills_huge_pages:
        pytest.fail("the installed CRIU is not the one scripts/build-criu.sh builds (run scripts/install-criu.sh)")
    if thp_mode() != "madvise":
        pytest.skip(f"the host's THP mode is {thp_mode()!r}: the fill only changes anything under 'madvise'")
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.integration.thp_fill_workload", str(port)], cwd=REPO,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    roots = [process.pid]
    try:
        digest, start = _digests(port).split()
        assert "hg" not in _mapping(process.pid, int(start, 16))["VmFlags"].split()
        snapshotter = CriuSnapshotter()
        _dump(snapshotter, process, tmp_path / "images")
        restored = snapshotter.restore(tmp_path / "images", tmp_path / "state-huge", replica=False)
        roots.append(restored.pid)
        zeros = int(start, 16) + (16 << 20)  # the last 16 MiB: zeros, left out of the compacted image
        assert _present_pages(restored.pid, zeros, 4096) == 4096  # (before the digest reads them)
        assert _digests(port) == f"{digest} {start}"
        mapping = _mapping(restored.pid, int(start, 16))
        flags = mapping["VmFlags"].split()
        assert "nh" in flags and "hg" not in flags, flags
        assert int(mapping["AnonHugePages"].split()[0]) >= 2048, mapping  # (a page short of memory falls back)
        kill_tree(restored.pid)

        monkeypatch.setenv("COLDSNAP_CRIU_THP_FILL", "0")
        restored = snapshotter.restore(tmp_path / "images", tmp_path / "state-small", replica=False)
        roots.append(restored.pid)
        assert _present_pages(restored.pid, zeros, 4096) == 0
        assert _digests(port) == f"{digest} {start}"
        mapping = _mapping(restored.pid, int(start, 16))
        assert int(mapping["AnonHugePages"].split()[0]) == 0 and "nh" not in mapping["VmFlags"].split()
    finally:
        for root in roots:
            kill_tree(root)


def _namespace_tids(pid: int) -> list[int]:
    """``pid``'s threads by their ids in its own pid namespace (what a dump records)."""
    return sorted(namespace_pid(int(tid)) for tid in os.listdir(f"/proc/{pid}/task"))


def test_parallel_fill_gives_the_same_memory_threads_and_pids(tmp_path, monkeypatch):
    """This project's CRIU (parallel-fill.patch) with ``CRIU_FILL_THREADS=3``: a process with 256 MiB of
    pages and four threads of its own is filled on four threads (CRIU's log says so) in a pid namespace
    of its own (a replica), on as many as the host's namespace leaves pids free for (a helper whose pid
    another process holds is not started: its share is read by the process itself), and comes back with
    the same bytes and the same thread ids both times — the helpers, whose pids lie above the tree's,
    are gone."""
    import re

    from coldsnap.snapshot.criu_binary import Criu

    monkeypatch.setenv("COLDSNAP_CRIU_FILL_THREADS", "3")
    monkeypatch.setenv("COLDSNAP_CRIU_LOG_LEVEL", "3")  # (info: the fill's line)
    if not Criu().version().fills_in_parallel:
        pytest.fail("the installed CRIU is not the one scripts/build-criu.sh builds (run scripts/install-criu.sh)")
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.integration.thp_fill_workload", str(port), "512", "4"],
                               cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    roots = [process.pid]
    try:
        digest = _digests(port)
        tids = _namespace_tids(process.pid)
        assert len(tids) == 5
        snapshotter = CriuSnapshotter()
        _dump(snapshotter, process, tmp_path / "images")
        for replica in (True, False):
            state = tmp_path / f"state-{'replica' if replica else 'host'}"
            restored = snapshotter.restore(tmp_path / "images", state, replica=replica)
            roots.append(restored.pid)
            assert restored.fill_threads == 3
            log = "".join(path.read_text() for path in (state / "criu").glob("restore-*.log"))
            filled = re.findall(r"Parallel fill: (\d+) bytes on (\d) threads", log)
            assert filled and int(filled[0][0]) >= 256 << 20, log[-2000:]
            assert filled[0][1] == "4" if replica else 1 <= int(filled[0][1]) <= 4, filled
            assert _digests(port) == digest
            assert _namespace_tids(restored.pid) == tids
            kill_tree(restored.pid)
    finally:
        for root in roots:
            kill_tree(root)
