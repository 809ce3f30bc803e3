"""Collectives of CPU tensors over loopback TCP, with NCCL's life cycle (unique id → connect → close).

Rank 0's :meth:`HostBackend.create_unique_id` opens a listening socket, as ``ncclGetUniqueId`` makes
its process the rendezvous root; the id is ``host:port:nonce`` and joiners prove they got it by
sending the nonce. All-reduce is a star through rank 0 (sum, then the result back), which is plenty
for the reference workload's few-kilobyte activations. Closing drops every connection, so a torn-down
rank holds no TCP connection a process snapshot would have to carry.
"""

from __future__ import annotations

import secrets
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from coldsnap.collective.base import CollectiveError

__all__ = ["HostBackend", "HostCommunicator"]

_HELLO = struct.Struct("<16sI")  # nonce, rank


def _receive_exactly(connection: socket.socket, length: int) -> bytes:
    data = bytearray()
    while len(data) < length:
        chunk = connection.recv(length - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


@dataclass
class HostCommunicator:
    rank: int
    world: int
    peers: dict[int, socket.socket] = field(default_factory=dict)  # rank 0: every other rank; others: rank 0

    def all_reduce(self, tensor: Any) -> None:
        array = tensor.numpy()  # a view: the sum lands in the tensor itself
        try:
            if self.rank == 0:
                for peer in self.peers.values():
                    array += _frombuffer(_receive_exactly(peer, array.nbytes), array)
                result = array.tobytes()
                for peer in self.peers.values():
                    peer.sendall(result)
            else:
                self.peers[0].sendall(array.tobytes())
                array[...] = _frombuffer(_receive_exactly(self.peers[0], array.nbytes), array)
        except OSError as exc:
            raise CollectiveError(f"rank {self.rank}: host all-reduce failed: {exc}") from None

    def close(self) -> None:
        for peer in self.peers.values():
            try:  # wakes a thread of this process blocked reading it (a follower's request channel)
                peer.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            peer.close()
        self.peers.clear()

    abort = close  # nothing to wait for: closing is already local


def _frombuffer(data: bytes, like: Any) -> Any:
    import numpy

    return numpy.frombuffer(data, dtype=like.dtype).reshape(like.shape)


class HostBackend:
    name = "host"

    def __init__(self, host: str = "127.0.0.1", timeout: float = 120.0):
        self.host = host
        self.timeout = timeout
        self._listeners: dict[bytes, tuple[socket.socket, bytes]] = {}

    def relocate(self, address: str) -> None:
        self.host = address

    def create_unique_id(self) -> bytes:
        listener = socket.create_server((self.host, 0))
        nonce = secrets.token_bytes(16)
        unique_id = f"{self.host}:{listener.getsockname()[1]}:{nonce.hex()}".encode()
        self._listeners[unique_id] = (listener, nonce)
        return unique_id

    def connect(self, unique_id: bytes, world: int, rank: int) -> HostCommunicator:
        try:
            host, port, nonce_hex = unique_id.decode().rsplit(":", 2)
            nonce = bytes.fromhex(nonce_hex)
        except ValueError:
            raise CollectiveError(f"rank {rank}: {unique_id[:64]!r} is not a host communicator id") from None
        communicator = HostCommunicator(rank, world)
        try:
            if rank == 0:
                if unique_id not in self._listeners:
                    raise CollectiveError("rank 0 must join the communicator whose unique id it created")
                listener, _ = self._listeners.pop(unique_id)
                with listener:
                    listener.settimeout(self.timeout)
                    while len(communicator.peers) < world - 1:
                        peer, _ = listener.accept()
                        peer.settimeout(self.timeout)
                        got_nonce, peer_rank = _HELLO.unpack(_receive_exactly(peer, _HELLO.size))
                        if got_nonce != nonce or not 0 < peer_rank < world or peer_rank in communicator.peers:
                            peer.close()  # not one of ours: never counted
                            continue
                        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        communicator.peers[peer_rank] = peer
            else:
                peer = socket.create_connection((host, int(port)), timeout=self.timeout)
                peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peer.sendall(_HELLO.pack(nonce, rank))
                communicator.peers[0] = peer
        except OSError as exc:
            communicator.close()
            raise CollectiveError(f"rank {rank} of {world}: joining host communicator {host}:{port} failed: {exc}") from None
        return communicator
