"""A replica's own sockets and GPUs, without CRIU: files.img decoded and rewritten byte for byte, the
port generation and its bind probe, per-replica control names, and the GPU placement's UUID bijection."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from coldsnap.activation.restore_place import gpu_remap
from coldsnap.activation.restore_place import replica_control
from coldsnap.snapshot.criu_images import ImageFormatError, _encode, read_sockets, rewrite_sockets
from coldsnap.snapshot.namespace_init import namespace_socket_names
from coldsnap.snapshot.moved_sockets import (path_socket_names, port_generation,
                                       probe_abstract_names, probe_binds, replica_images)

_VARINT, _LENGTH = 0, 2
_MAGICS = struct.pack("<II", 0x54564319, 0x56213732)


def _inet_entry(ino: int, port: int, state: int = 10, dst_port: int = 0) -> bytes:
    fown = _encode([(1, _VARINT, 0), (2, _VARINT, 0)])
    isk = _encode([(1, _VARINT, ino), (2, _VARINT, ino), (3, _VARINT, socket.AF_INET), (4, _VARINT, socket.SOCK_STREAM),
                   (5, _VARINT, 6), (6, _VARINT, state), (7, _VARINT, port), (8, _VARINT, dst_port),
                   (9, _VARINT, 2), (10, _VARINT, 5), (11, _VARINT, 0x0100007F), (13, _LENGTH, fown),
                   (14, _LENGTH, b""), (99, _LENGTH, b"a field this module does not know")])
    return _encode([(1, _VARINT, 4), (2, _VARINT, ino), (4, _LENGTH, isk)])


def _unix_entry(ino: int, name: bytes) -> bytes:
    usk = _encode([(1, _VARINT, ino), (2, _VARINT, ino), (3, _VARINT, 1), (4, _VARINT, 10), (11, _LENGTH, name)])
    return _encode([(1, _VARINT, 5), (2, _VARINT, ino), (16, _LENGTH, usk)])


def _reg_entry(file_id: int, name: bytes) -> bytes:
    reg = _encode([(1, _VARINT, file_id), (2, _VARINT, 0o100002), (3, _VARINT, 0), (6, _LENGTH, name)])
    return _encode([(1, _VARINT, 1), (2, _VARINT, file_id), (3, _LENGTH, reg)])


def _image(directory, *entries: bytes) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "files.img").write_bytes(_MAGICS + b"".join(struct.pack("<I", len(e)) + e for e in entries))


def test_files_img_sockets_are_read_and_rewritten_keeping_every_other_byte(tmp_path):
    captured, replica = tmp_path / "captured", tmp_path / "replica"
    replica.mkdir()
    # a listener on 8000 (its port's varint grows a byte at 70000), a connection's local port, the agent
    _image(captured, _inet_entry(1, 8000), _inet_entry(2, 41234, state=1, dst_port=8000),
           _unix_entry(3, b"\0coldsnap-agent-0123456789abcdef"), _unix_entry(4, b"/tmp/other.sock"))
    inet, unix = read_sockets(captured)
    assert [(s.src_port, s.bound, s.src_addr) for s in inet] == [(8000, True, b"\x7f\0\0\1"), (41234, False, b"\x7f\0\0\1")]
    assert [u.name for u in unix] == [b"\0coldsnap-agent-0123456789abcdef", b"/tmp/other.sock"] and unix[0].abstract

    assert rewrite_sockets(captured, replica, lambda s: (None, None), {}) == 0
    assert (replica / "files.img").read_bytes() == (captured / "files.img").read_bytes()

    renamed = {b"\0coldsnap-agent-0123456789abcdef": b"\0coldsnap-agent-fedcba9876543210"}
    changed = rewrite_sockets(captured, replica, lambda s: (70000 if s.bound else None, None), renamed)
    inet, unix = read_sockets(replica)
    assert changed == 2 and [s.src_port for s in inet] == [70000, 41234]
    assert [u.name for u in unix] == [b"\0coldsnap-agent-fedcba9876543210", b"/tmp/other.sock"]
    assert b"a field this module does not know" in (replica / "files.img").read_bytes()


def test_a_truncated_image_is_refused_by_name(tmp_path):
    _image(tmp_path, _inet_entry(1, 8000))
    (tmp_path / "files.img").write_bytes((tmp_path / "files.img").read_bytes()[:-3])
    with pytest.raises(ImageFormatError, match="files.img: truncated entry"):
        read_sockets(tmp_path)


def test_the_port_generation_moves_every_local_port_by_one_shift_and_probes_them(tmp_path):
    # listeners on 8000 and 29500; a connection inside the tree (41234 → 8000, accepted on 8000); one to
    # a server outside it (41235 → 443)
    _image(tmp_path / "images", _inet_entry(1, 8000), _inet_entry(2, 29500), _inet_entry(3, 41234, 1, 8000),
           _inet_entry(4, 8000, 1, 41234), _inet_entry(5, 41235, 1, 443))
    sockets = [s for s in read_sockets(tmp_path / "images")[0] if s.src_port]
    generation = port_generation(sockets, 8000, 8100)
    assert generation.shift == 100 and generation.moved == {8000: 8100, 29500: 29600, 41234: 41334, 41235: 41335}
    assert [generation.ports(s) for s in sockets] == [(8100, None), (29600, None), (41334, 8100), (8100, 41334),
                                                      (41335, None)]  # both ends inside move; 443 stays
    with pytest.raises(ValueError, match=r"port\(s\) \[29500\] out of range \(shift \+36100\)"):
        port_generation(sockets, 8000, 44100)  # a listener cannot leave the port range
    wrapped = port_generation(sockets, 8000, 38000)  # a connection's ephemeral port wraps around 1024-65535
    assert wrapped.moved == {8000: 38000, 29500: 59500, 41234: 6722, 41235: 6723}

    with socket.socket() as busy:  # a port taken by another listener: the probe names it
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        listener = sockets[:1]
        taken = probe_binds(listener, port_generation(listener, 8000, port))
        assert len(taken) == 1 and taken[0].startswith(f"tcp 127.0.0.1:{port} (")
    assert probe_binds(listener, port_generation(listener, 8000, port)) == []

    replica = replica_images(tmp_path / "images", tmp_path / "replica", generation, {})
    assert sorted(p.name for p in replica.iterdir()) == ["files.img"] and not (replica / "files.img").is_symlink()
    (tmp_path / "images" / "pages-1.img").write_bytes(b"pages")
    replica = replica_images(tmp_path / "images", tmp_path / "replica", generation, {})  # again: emptied first
    assert (replica / "pages-1.img").is_symlink() and (replica / "pages-1.img").read_bytes() == b"pages"
    # Once more, with a stray file and a link into another image: the right link is kept, everything else goes.
    kept = os.lstat(replica / "pages-1.img").st_ino
    (replica / "stray.img").write_bytes(b"stray")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mm-1.img").write_bytes(b"other")
    (replica / "mm-1.img").symlink_to(tmp_path / "other" / "mm-1.img")
    (tmp_path / "images" / "mm-1.img").write_bytes(b"mm")
    replica = replica_images(tmp_path / "images", tmp_path / "replica", generation, {})
    assert sorted(p.name for p in replica.iterdir()) == ["files.img", "mm-1.img", "pages-1.img"]
    assert os.lstat(replica / "pages-1.img").st_ino == kept and (replica / "mm-1.img").read_bytes() == b"mm"
    assert not (replica / "files.img").is_symlink()
    assert [(s.src_port, s.dst_port) for s in read_sockets(replica)[0]] == [
        (8100, 0), (29600, 0), (41334, 8100), (8100, 41334), (41335, 443)]


def test_a_replica_names_its_control_sockets_with_its_own_id():
    token = "fedcba9876543210"
    assert replica_control("@coldsnap-agent-0123456789abcdef", token) == "@coldsnap-agent-fedcba9876543210"
    assert replica_control("@coldsnap-agent-0123456789abcdef.rank1", token) == "@coldsnap-agent-fedcba9876543210.rank1"
    assert replica_control("@coldsnap-template-0123456789abcdef", token) == "@coldsnap-template-fedcba9876543210"
    assert replica_control("/run/my.sock", token) == "/run/my.sock"


def test_the_gpu_placement_maps_every_captured_gpu_onto_one_of_its_own():
    g0, g1, g2 = "GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000", "GPU-cccc"
    same = gpu_remap([g0, g1], None, [g0, g1], None)
    assert same.pairs == [] and same.launcher_ordinals == {0: 0, 1: 1}
    onto_1 = gpu_remap([g0, g1], "0", [g0, g1], "1")
    assert onto_1.pairs == [(g0, g1), (g1, g0)] and onto_1.launcher_ordinals == {0: 1}
    by_uuid = gpu_remap([g0], None, [g2, g1], g1)  # another host: its GPU named by UUID
    assert by_uuid.pairs == [(g0, g1)] and by_uuid.launcher_ordinals == {0: 1}
    with pytest.raises(ValueError, match="GPU 2 is not among the 2 GPU"):
        gpu_remap([g0], None, [g0, g1], "2")
    with pytest.raises(ValueError, match="used 2 GPU"):
        gpu_remap([g0, g1], None, [g0, g1], "1")
    fewer = gpu_remap([g0, g1], None, [g1], None)  # nothing asked: this host's GPUs by ordinal, as many as there are
    assert fewer.pairs == [(g0, g1)] and fewer.launcher_ordinals == {0: 0}
    with pytest.raises(ValueError, match="names a GPU twice"):
        gpu_remap([g0], None, [g0, g1], "1,1")


def test_the_cuda_drivers_socket_is_named_for_the_replicas_pid_namespace():
    captured = b"\0cuda-uvmfd-4026531836-1798\0"  # as the driver names it (H200, driver 580)
    assert namespace_socket_names([captured, b"\0coldsnap-agent-0123456789abcdef", b"/tmp/x.sock"], 4026532999) == {
        captured: b"\0cuda-uvmfd-4026532999-1798\0"}


def test_a_taken_abstract_name_is_reported_and_a_free_one_is_not():
    name = f"\0coldsnap-test-{os.getpid()}".encode()
    with socket.socket(socket.AF_UNIX) as holder:
        holder.bind(name)
        [taken] = probe_abstract_names([name])
        assert taken.startswith(f"unix @coldsnap-test-{os.getpid()} (")
    assert probe_abstract_names([name]) == []


def test_a_replica_binds_its_path_sockets_at_paths_of_its_own():
    ipc = b"/tmp/2c8997a9-2093-4b6e-b859-13ec373f7996"  # vLLM's ZeroMQ ipc:// endpoint (vLLM 0.26 on the H200)
    too_long = b"/" + b"x" * 100
    assert path_socket_names([ipc, b"\0coldsnap-agent-0123456789abcdef", too_long], "port-8001") == {
        ipc: ipc + b".port-8001"}


def test_a_dual_stack_socket_talking_ipv4_is_probed_on_its_ipv4_address():
    # vLLM 0.26 on the H200: an IPv6 socket on ::ffff:<the host's IPv4> (a V6ONLY probe of that address fails
    # with EINVAL: it used to be reported as taken)
    from coldsnap.snapshot.criu_images import InetSocket

    mapped = InetSocket(1, socket.AF_INET6, socket.SOCK_STREAM, InetSocket.LISTEN, 41234, 0,
                        bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1]))
    assert probe_binds([mapped], port_generation([mapped], 41234, 41234)) == []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = probe_binds([mapped], port_generation([mapped], 41234, port))
    assert len(taken) == 1 and taken[0].startswith(f"tcp 127.0.0.1:{port} (")


def test_a_connections_port_is_not_probed_criu_restores_it_in_repair_mode():
    """A connection's local port that a bare bind cannot take now — a TIME_WAIT an earlier replica on the
    same shift left (its client side had no SO_REUSEADDR), or another process's listener — does not stop
    CRIU's repair-mode bind: the probe does not refuse the replica for it (CI saw two replicas refused on
    "Address already in use" for the tree's connection ports). A listener of the tree on it is probed."""
    from coldsnap.snapshot.criu_images import InetSocket

    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client.connect(server.getsockname())
        accepted, _ = server.accept()
        client.close()  # the client closes first: its port lingers in TIME_WAIT, not reusable by a bare bind
        accepted.close()
        client_port = lingering = None
        for _ in range(100):  # the FIN exchange over loopback: at once, as a rule
            client_port = _time_wait_port(server.getsockname()[1])
            lingering = _bare_bind_error(client_port)
            if lingering:
                break
            time.sleep(0.01)
        connection = InetSocket(1, socket.AF_INET, socket.SOCK_STREAM, 1, 40000, 8000, socket.inet_aton("127.0.0.1"),
                                socket.inet_aton("127.0.0.1"))
        listener = InetSocket(2, socket.AF_INET, socket.SOCK_STREAM, InetSocket.LISTEN, 8000, 0,
                              socket.inet_aton("127.0.0.1"))
        assert client_port is not None and lingering, "the kernel left no TIME_WAIT a bare bind trips on"
        generation = port_generation([connection, listener], 40000, client_port)
        assert probe_binds([connection], generation) == []
        with socket.socket() as busy:  # another process's listener on a connection's port: not a conflict
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            generation = port_generation([connection, listener], 40000, busy.getsockname()[1])
            assert probe_binds([connection], generation) == []
            taken = probe_binds([listener], port_generation([listener], 8000, busy.getsockname()[1]))
            assert len(taken) == 1 and "Address already in use" in taken[0]


def _time_wait_port(server_port: int) -> int | None:
    """The local port of a connection to ``server_port`` lingering in TIME_WAIT (/proc/net/tcp), if any."""
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state == "06" and int(remote.split(":")[1], 16) == server_port:
                return int(local.split(":")[1], 16)
    return None


def _bare_bind_error(port: int | None) -> str | None:
    if port is None:
        return None
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.strerror
    return None


def test_files_deleted_while_open_get_a_path_of_the_replicas_own(tmp_path):
    """CRIU re-creates a ghost at <path>.cr.<id>.ghost, exclusively: two replicas of one image restoring
    at once collided there, so each replica's copy names its ghosts apart (and only them)."""
    captured, replica = tmp_path / "captured", tmp_path / "replica"
    replica.mkdir()
    _image(captured, _reg_entry(7, b"/tmp/deleted-while-open"), _reg_entry(8, b"/usr/lib/libkept.so"),
           _unix_entry(3, b"/tmp/other.sock"))
    remap = _encode([(1, _VARINT, 7), (2, _VARINT, 1), (3, _VARINT, 1)])  # file 7 is ghost 1
    linked = _encode([(1, _VARINT, 8), (2, _VARINT, 9), (3, _VARINT, 0)])  # a link remap is not a ghost
    (captured / "remap-fpath.img").write_bytes(_MAGICS + b"".join(struct.pack("<I", len(e)) + e for e in (remap, linked)))
    assert rewrite_sockets(captured, replica, lambda s: (None, None), {}, b".port-8001") == 1
    data = (replica / "files.img").read_bytes()
    assert b"/tmp/deleted-while-open.port-8001" in data and b"/usr/lib/libkept.so.port" not in data
    assert b"/tmp/other.sock.port" not in data
    assert rewrite_sockets(captured, replica, lambda s: (None, None), {}) == 0  # no suffix asked: unchanged
    assert (replica / "files.img").read_bytes() == (captured / "files.img").read_bytes()


def _addressed_inet_entry(ino: int, port: int, src: bytes, dst: bytes = b"", state: int = 10, packed: bool = False) -> bytes:
    def words(number: int, address: bytes) -> list:
        values = [struct.unpack("<I", address[at:at + 4])[0] for at in range(0, len(address), 4)]
        if packed:
            from coldsnap.snapshot.criu_images import _encode_varint

            return [(number, _LENGTH, b"".join(_encode_varint(v) for v in values))] if values else []
        return [(number, _VARINT, v) for v in values]
    isk = _encode([(1, _VARINT, ino), (2, _VARINT, ino), (3, _VARINT, socket.AF_INET), (4, _VARINT, socket.SOCK_STREAM),
                   (6, _VARINT, state), (7, _VARINT, port), (8, _VARINT, 8000 if dst else 0), *words(11, src),
                   *words(12, dst), (99, _LENGTH, b"kept")])
    return _encode([(1, _VARINT, 4), (2, _VARINT, ino), (4, _LENGTH, isk)])


@pytest.mark.parametrize("packed", [False, True])
def test_a_unit_restored_onto_another_host_gets_its_addresses_mapped(tmp_path, packed):
    captured, restored = tmp_path / "captured", tmp_path / "restored"
    restored.mkdir()
    host_a, host_b = socket.inet_aton("10.232.0.11"), socket.inet_aton("10.232.0.12")
    peer_a, peer_b = socket.inet_aton("10.232.0.21"), socket.inet_aton("10.232.0.22")
    _image(captured, _addressed_inet_entry(1, 8000, host_a, packed=packed),  # a listener bound to host A's address
           _addressed_inet_entry(2, 41234, host_a, peer_a, state=1, packed=packed),  # a connection to the other unit
           _addressed_inet_entry(3, 9000, socket.inet_aton("127.0.0.1"), packed=packed))  # loopback: not placement
    assert rewrite_sockets(captured, restored, lambda s: (None, None), {}, addresses={}) == 0
    assert (restored / "files.img").read_bytes() == (captured / "files.img").read_bytes()

    changed = rewrite_sockets(captured, restored, lambda s: (None, None), {}, addresses={host_a: host_b, peer_a: peer_b})
    inet, _ = read_sockets(restored)
    assert changed == 2
    assert [(s.src_addr, s.dst_addr, s.src_port) for s in inet] == [
        (host_b, b"", 8000), (host_b, peer_b, 41234), (socket.inet_aton("127.0.0.1"), b"", 9000)]
    assert (restored / "files.img").read_bytes().count(b"kept") == 3
    with pytest.raises(ValueError, match="4-byte address onto a 16-byte"):
        rewrite_sockets(captured, restored, lambda s: (None, None), {}, addresses={host_a: bytes(16)})


def test_every_units_address_is_mapped_in_both_forms_and_a_family_change_is_refused():
    from coldsnap.activation.units import moved_addresses, packed_addresses
    from coldsnap.operation import OperationFailed

    moved = moved_addresses({"10.232.0.11": "10.232.0.31", "10.232.0.12": "10.232.0.12", "node-a": "node-c"})
    mapped = bytes(10) + b"\xff\xff"  # a dual-stack listener's accepted connection names its peer so
    assert moved == {socket.inet_aton("10.232.0.11"): socket.inet_aton("10.232.0.31"),
                     mapped + socket.inet_aton("10.232.0.11"): mapped + socket.inet_aton("10.232.0.31")}
    assert packed_addresses({"10.232.0.12", "node-b"}) == {socket.inet_aton("10.232.0.12"),
                                                           mapped + socket.inet_aton("10.232.0.12")}
    with pytest.raises(OperationFailed, match="same family"):
        moved_addresses({"10.232.0.11": "fd00::1"})


def test_the_bind_probe_binds_a_units_sockets_at_its_new_address_and_connections_to_units_are_found(tmp_path):
    from coldsnap.snapshot.criu_images import InetSocket
    from coldsnap.snapshot.moved_sockets import connections_to

    elsewhere, here = socket.inet_aton("10.232.0.11"), socket.inet_aton("127.0.0.1")
    listener = InetSocket(1, socket.AF_INET, socket.SOCK_STREAM, 10, 41235, 0, elsewhere)
    generation = port_generation([listener], 41235, 41235)
    assert "Cannot assign requested address" in probe_binds([listener], generation)[0]  # not this host's address
    assert probe_binds([listener], generation, {elsewhere: here}) == []
    _image(tmp_path, _addressed_inet_entry(1, 8000, elsewhere),
           _addressed_inet_entry(2, 41234, elsewhere, socket.inet_aton("10.232.0.12"), state=1),
           _addressed_inet_entry(3, 41236, elsewhere, socket.inet_aton("10.232.0.99"), state=1))
    found = connections_to(tmp_path, {socket.inet_aton("10.232.0.12")})
    assert [s.src_port for s in found] == [41234]
    assert connections_to(tmp_path, set()) == []


def test_the_replicas_first_process_renames_the_drivers_sockets_in_place_as_the_decoder_would(tmp_path):
    """namespace_init gets the CUDA driver's socket names from the launcher and replaces their bytes in its
    files.img, decoding nothing: the result is byte for byte what decoding and re-encoding gives."""
    from coldsnap.snapshot.moved_sockets import namespace_sockets
    from coldsnap.snapshot.namespace_init import rename_in_place

    engine = b"\0cuda-uvmfd-4026531836-1798\0"
    worker = b"\0cuda-uvmfd-4026531836-1799\0"
    _image(tmp_path, _unix_entry(1, engine), _reg_entry(2, b"/tmp/log"), _unix_entry(3, worker),
                          _unix_entry(4, engine), _unix_entry(5, b"\0coldsnap-agent-0123456789abcdef"),
                          _inet_entry(6, 8000))
    names = namespace_sockets(tmp_path)
    assert sorted(names) == [engine, engine, worker]
    captured = (tmp_path / "files.img").read_bytes()
    renamed = rename_in_place(captured, names, 4026532999)
    decoded = tmp_path / "decoded"
    decoded.mkdir()
    rewrite_sockets(tmp_path, decoded, lambda sock: (None, None), namespace_socket_names(names, 4026532999))
    assert renamed == (decoded / "files.img").read_bytes() != captured
    assert [s.name for s in read_sockets(decoded)[1]][:2] == [b"\0cuda-uvmfd-4026532999-1798\0",
                                                              b"\0cuda-uvmfd-4026532999-1799\0"]
    assert rename_in_place(captured, names, 4026531836) == captured  # (its own namespace's inode again)


def test_where_replacing_bytes_would_not_rename_exactly_the_sockets_the_replica_decodes_instead(tmp_path):
    from coldsnap.snapshot.moved_sockets import namespace_sockets
    from coldsnap.snapshot.namespace_init import rename_in_place

    engine = b"\0cuda-uvmfd-4026531836-17\0"
    _image(tmp_path, _unix_entry(1, engine))
    captured = (tmp_path / "files.img").read_bytes()
    assert rename_in_place(captured, [engine], 402653199) is None  # another length: the entry's lengths change
    _image(tmp_path, _unix_entry(1, engine), _reg_entry(2, b"/x" + engine))  # its bytes elsewhere too
    assert rename_in_place((tmp_path / "files.img").read_bytes(), [engine], 4026532999) is None
    longer = b"\0cuda-uvmfd-4026531836-17"  # (without the NUL: a prefix of the name above)
    _image(tmp_path, _unix_entry(1, engine), _unix_entry(2, longer))
    assert rename_in_place((tmp_path / "files.img").read_bytes(), [engine, longer], 4026532999) is None
    _image(tmp_path, _unix_entry(1, b"\0coldsnap-agent-0123456789abcdef"))
    assert namespace_sockets(tmp_path) == []
    (tmp_path / "files.img").write_bytes(b"cuda-uvmfd but not an image")
    assert namespace_sockets(tmp_path) is None  # (namespace_init then decodes it and says what is wrong)


def test_the_drivers_socket_name_is_told_apart_as_the_pattern_of_its_format_would():
    # namespace_init matches it without `re` (it runs before CRIU starts): the same verdict as the pattern
    import re

    from coldsnap.snapshot.namespace_init import is_namespace_socket

    pattern = re.compile(rb"\0cuda-uvmfd-(\d+)-(\d+)(\0?)")
    for name in [b"\0cuda-uvmfd-4026531836-1798\0", b"\0cuda-uvmfd-4026531836-1798", b"\0cuda-uvmfd-1-2\0\0",
                 b"\0cuda-uvmfd--1798", b"\0cuda-uvmfd-12-", b"\0cuda-uvmfd-12-3-4", b"cuda-uvmfd-1-2",
                 b"\0cuda-uvmfd-1-2x", "\0cuda-uvmfd-\u0661-2".encode(), b"\0cuda-uvmfd-1-\0", b"\0cuda-uvmfd-+1-2",
                 b"\0cuda-uvmfd- 1-2", b"\0coldsnap-agent-0123456789abcdef", b"/tmp/x.sock"]:
        assert is_namespace_socket(name) == bool(pattern.fullmatch(name)), name
