"""One rank of the reference workload: the model, its agent, and HTTP (rank 0) or following (others)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO

import torch

from coldsnap.contracts.placement import GRAPHS_AFTER_READY, GRAPHS_ENV, NATIVE_PACK_ENV, WEIGHTS_MODE_ENV
from coldsnap.workloads.torch_lm.model import TorchLM, decode, encode

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
    collectives = communicator = None
    if world > 1:
        from coldsnap.collective import HostBackend, NcclBackend, RankCollectives

        backend = NcclBackend(torch.device(device).index) if device.startswith("cuda") else HostBackend()
        collectives = RankCollectives(rank, world)
        if rank == 0:
            unique_id = backend.create_unique_id()
            for channel in channels:
                channel.sendall(unique_id.hex().encode() + b"\n")
        else:
            unique_id = bytes.fromhex(_read_line(readers[0], "the communicator id").decode())
        communicator = collectives.connect("tp", backend, unique_id)
    weights_file = Path(args.weights).resolve() / "model.safetensors" if args.weights else None
    # An n580 restore's placement names the capture's native pack (single rank: the pack is rank 0's).
    pack = os.environ.get(NATIVE_PACK_ENV) if os.environ.get(WEIGHTS_MODE_ENV) != "recovery" and world == 1 else None
    model = TorchLM(args.size, device, args.seed, args.max_seq, cuda_graphs=not args.no_cuda_graphs,
                    rank=rank, world=world, communicator=communicator, followers=channels if rank == 0 else None,
                    weights_file=weights_file, native_pack=Path(pack) if pack else None,
                    defer_graphs=os.environ.get(GRAPHS_ENV) == GRAPHS_AFTER_READY)
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
    from coldsnap.agent.server import AgentHooks

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
    gpu = f" (GPU-{torch.cuda.get_device_properties(model.device).uuid})" if model.device.type == "cuda" else ""
    sys.stderr.write(f"torch_lm: {args.size} rank {rank}/{world} on {device}{gpu} ready on {where} "
                     f"in {time.perf_counter() - started:.2f} s\n")
    sys.stderr.flush()
    if server is None:
        return _follow(model, readers[0])
    server.serve_forever()
    return 0
