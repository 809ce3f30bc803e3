"""One rank of the reference workload: the model, its agent, and HTTP (rank 0) or following (others)."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch

from coldsnap.contracts.placement import GRAPHS_AFTER_READY, GRAPHS_ENV, NATIVE_PACK_ENV, WEIGHTS_MODE_ENV
from coldsnap.workloads.torch_lm.model import TorchLM, decode, encode
from coldsnap.settings import SETTINGS

__all__ = ["serve"]


class _Handler(BaseHTTPRequestHandler):
    model: TorchLM
    model_name: str

    def log_message(self, format: str, *args) -> None:  # one line per request on stderr, not stdout noise
        sys.stderr.write(f"torch_lm: {self.command} {self.path} {args[1] if len(args) > 1 else ''}\n")

    def _reply(self, status: int, document: dict) -> None:
        body = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._reply(200, {"object": "list", "data": [{"id": self.model_name, "object": "model"}]})
        else:
            self._reply(404, {"error": "not found"})

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            self._reply(404, {"error": "not found"})
            return
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            prompt = request["prompt"]
            max_tokens = int(request.get("max_tokens", 16))
            if float(request.get("temperature", 0)) != 0:
                raise ValueError("only temperature 0 (greedy) is supported")
            if not isinstance(prompt, str) or not 1 <= max_tokens <= 4096:
                raise ValueError("prompt must be a string and max_tokens in 1..4096")
            want_prompt = request.get("prompt_logprobs") is not None  # top-1 only, whatever the number asked
            started = time.perf_counter()
            predicted: list | None = [] if want_prompt else None
            ids = self.model.generate(prompt, max_tokens, predicted)
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(400, {"error": str(exc)})
            return
        choice: dict = {"index": 0, "text": decode(ids), "token_ids": ids, "finish_reason": "length"}
        if predicted is not None:  # vLLM's shape: per prompt token, None first, then {token id: {logprob, rank}}
            choice["prompt_logprobs"] = [None] + [{str(token): {"logprob": logprob, "rank": 1}}
                                                  for token, logprob in predicted]
        self._reply(200, {
            "object": "text_completion",
            "model": self.model_name,
            "choices": [choice],
            "usage": {"prompt_tokens": len(encode(prompt)), "completion_tokens": len(ids),
                      "seconds": round(time.perf_counter() - started, 4)},
        })


def _read_line(reader: BinaryIO, what: str) -> bytes:
    line = reader.readline()
    if not line:
        raise SystemExit(f"torch_lm: rank 0 closed the channel before sending {what}")
    return line.strip()


BOOTSTRAP_TIMEOUT_S = 600.0
"""How long the ranks of ``--nnodes`` hosts wait for each other at their first meeting."""


def _bootstrap(args: argparse.Namespace, rank: int, world: int, create: list) -> list[bytes]:
    """``--nnodes`` > 1, at the first start only: rank 0 listens on ``--master-addr:--master-port`` until every
    other rank connected and sends each the unique ids of the communicators (``create``: rank 0 makes them);
    then every connection and the listener are closed. Nothing crosses hosts afterwards but those
    communicators, which a snapshot tears down and rebuilds through the activation's coordinator."""
    deadline = time.monotonic() + BOOTSTRAP_TIMEOUT_S
    if rank == 0:
        ids = [make() for make in create]
        line = (" ".join(i.hex() for i in ids) + "\n").encode()
        joined: dict[int, socket.socket] = {}
        with socket.create_server((args.master_addr, args.master_port)) as listener:
            listener.settimeout(BOOTSTRAP_TIMEOUT_S)
            while len(joined) < world - 1:
                connection, _ = listener.accept()
                try:
                    peer = int(_read_line(connection.makefile("rb"), "its rank"))
                except (ValueError, SystemExit, OSError):
                    connection.close()  # not one of ours
                    continue
                connection.sendall(line)
                joined[peer] = connection
        for connection in joined.values():
            connection.close()
        return ids
    while True:
        try:
            connection = socket.create_connection((args.master_addr, args.master_port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"torch_lm: rank {rank}: rank 0 at {args.master_addr}:{args.master_port} did not "
                                 f"answer within {BOOTSTRAP_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
    with connection:
        connection.sendall(f"{rank}\n".encode())
        return [bytes.fromhex(h) for h in _read_line(connection.makefile("rb"), "the communicator ids").decode().split()]


class _RequestChannels:
    """Rank 0's channels to the other ranks across hosts: the connections of the ``requests``
    communicator, whichever generation of it is live (a snapshot rebuilds it)."""

    def __init__(self, requests: Any):
        self.requests = requests

    def __iter__(self) -> Iterator[socket.socket]:
        peers = self.requests._live().peers
        return iter([peers[r] for r in sorted(peers)])


def _lines(connection: socket.socket) -> Iterator[bytes]:
    """Lines from ``connection`` until it ends (EOF, or shut down under this thread by a teardown)."""
    buffered = b""
    while True:
        try:
            chunk = connection.recv(65536)
        except TimeoutError:  # (the communicator's collectives time out; an idle channel is not dead)
            continue
        except OSError:
            return
        if not chunk:
            return
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            yield line


def _follow_requests(model: TorchLM, requests: Any) -> int:
    """Ranks > 0 on ``--nnodes`` hosts: run every request rank 0 forwards, in step with it; when the channel
    ends because a snapshot tore the communicators down, wait for their rebuild and go on."""
    while True:
        communicator = requests.current
        if communicator is None:  # torn down: the process is being snapshotted, or was just restored
            time.sleep(0.02)
            continue
        for line in _lines(communicator.peers[0]):
            request = json.loads(line)
            model.generate(request["prompt"], int(request["max_tokens"]))
        deadline = time.monotonic() + 10  # a teardown sets current to None around the close that ended it
        while requests.current is communicator and time.monotonic() < deadline:
            time.sleep(0.02)
        if requests.current is communicator:
            sys.stderr.write(f"torch_lm: rank {model.rank}: rank 0 closed its channel; exiting\n")
            return 1


def _follow(model: TorchLM, reader: BinaryIO) -> int:
    """Ranks > 0: run every request rank 0 forwards, in order, in step with it."""
    for line in reader:
        request = json.loads(line)
        model.generate(request["prompt"], int(request["max_tokens"]))
    sys.stderr.write(f"torch_lm: rank {model.rank}: rank 0 closed its channel; exiting\n")
    return 1


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    rank, world = args.rank or 0, args.tp
    device = args.device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            parser.error("--device cuda, but torch sees no GPU")
        if world > 1:
            if device != "cuda":
                parser.error("with --tp, give --device cuda: rank r uses cuda:r")
            if torch.cuda.device_count() < world:
                parser.error(f"--tp {world} needs {world} GPUs, torch sees {torch.cuda.device_count()}")
            device = f"cuda:{rank}"
        torch.cuda.set_device(torch.device(device).index or 0)
    started = time.perf_counter()
    channels = [socket.socket(fileno=int(fd)) for fd in args.channels.split(",") if fd]
    readers = [channel.makefile("rb") for channel in channels]
    collectives = communicator = requests = None
    if world > 1:
        from coldsnap.collective import HostBackend, NcclBackend, RankCollectives

        nodes = args.nnodes > 1  # across hosts: rank 0's address, not loopback
        host = HostBackend(args.master_addr) if nodes else HostBackend()
        backend = NcclBackend(torch.device(device).index) if device.startswith("cuda") else host
        collectives = RankCollectives(rank, world)
        if nodes:
            request_backend = HostBackend(args.master_addr)
            tp_id, requests_id = _bootstrap(args, rank, world, [backend.create_unique_id, request_backend.create_unique_id])
            communicator = collectives.connect("tp", backend, tp_id)
            requests = collectives.connect("requests", request_backend, requests_id)
            channels = []
        else:
            if rank == 0:
                unique_id = backend.create_unique_id()
                for channel in channels:
                    channel.sendall(unique_id.hex().encode() + b"\n")
            else:
                unique_id = bytes.fromhex(_read_line(readers[0], "the communicator id").decode())
            communicator = collectives.connect("tp", backend, unique_id)
    weights_file = Path(args.weights).resolve() / "model.safetensors" if args.weights else None
    # An n580 restore's placement names the capture's native pack (single rank: the pack is rank 0's).
    pack = SETTINGS.text(NATIVE_PACK_ENV) if SETTINGS.choice(WEIGHTS_MODE_ENV) != "recovery" and world == 1 else None
    model = TorchLM(args.size, device, args.seed, args.max_seq, cuda_graphs=not args.no_cuda_graphs,
                    rank=rank, world=world, communicator=communicator,
                    followers=(_RequestChannels(requests) if requests is not None else channels) if rank == 0 else None,
                    weights_file=weights_file, native_pack=Path(pack) if pack else None,
                    defer_graphs=SETTINGS.choice(GRAPHS_ENV) == GRAPHS_AFTER_READY)
    if args.write_safetensors:
        print(model.write_safetensors(Path(args.write_safetensors)))
        return 0
    server = None
    if rank == 0:
        server = ThreadingHTTPServer((args.host, args.port), _Handler)
        _Handler.model = model
        _Handler.model_name = f"coldsnap-torch-lm-{args.size}"
    from coldsnap.agent import attach
    from coldsnap.agent.memory import ModelMemory
    from coldsnap.agent.hooks import AgentHooks

    hooks = AgentHooks(release_graphs=model.release_graphs, recapture_graphs=model.recapture_graphs,
                       recovery_files=[str(weights_file)] if weights_file else [])  # replayed by tensor name
    if model.device.type == "cuda":
        # As vLLM's sleep does: hand torch's cached free blocks back before the CUDA checkpoint
        # copies device memory into the process image. The decode graph's private pool stays.
        hooks.before_release.append(torch.cuda.empty_cache)
    regions = {"weights": model.weights, "kv_cache": model.kv}
    if model.graph_memory is not None:
        regions["cudagraph"] = model.graph_memory
    attach(ModelMemory(model.layout, regions), serving_lock=model.lock, port=args.port if rank == 0 else None,
           hooks=hooks, rank=rank, world=world, collectives=collectives)  # starts the agent under coldsnap only
    where = f"{args.host}:{args.port}" if rank == 0 else "rank 0's channel"
    if args.nnodes > 1:
        where += f" (node {args.node_rank} of {args.nnodes})"
    gpu = f" (GPU-{torch.cuda.get_device_properties(model.device).uuid})" if model.device.type == "cuda" else ""
    sys.stderr.write(f"torch_lm: {args.size} rank {rank}/{world} on {device}{gpu} ready on {where} "
                     f"in {time.perf_counter() - started:.2f} s\n")
    sys.stderr.flush()
    if server is None:
        return _follow_requests(model, requests) if requests is not None else _follow(model, readers[0])
    server.serve_forever()
    return 0
