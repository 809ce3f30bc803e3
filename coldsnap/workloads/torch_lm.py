"""Reference workload: a Llama-shaped causal LM with seeded random weights, served over HTTP.

    python -m coldsnap.workloads.torch_lm --size tiny|1b|8b --device cpu|cuda --port P
    python -m coldsnap.workloads.torch_lm --size tiny --write-safetensors DIR

It qualifies a host without an engine installed and is what the snapshot tests and benchmarks run.
It uses coldsnap the way an engine plugin does: weights live in the ``weights`` stable region (their
layout is a :class:`~coldsnap.contracts.layout.MemoryLayout`), a static KV cache lives in the
``kv_cache`` region, and when ``COLDSNAP_CONTROL`` is set an in-process agent lets the launcher release
and restore both around a snapshot.

The same size and seed give the same weights on every start. Tokens are bytes (id = byte + 3), so any
prompt works without a tokenizer download. ``POST /v1/completions`` takes ``prompt``, ``max_tokens``
and ``temperature`` (only 0, greedy) and answers with the text and the token ids.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.memory import graph_pool, reserve

__all__ = ["LmShape", "SIZES", "TorchLM", "encode", "decode", "main"]

ALIGN = 4096  # tensor offsets in the weights region (O_DIRECT-friendly pack extents)
BYTE_OFFSET = 3  # 0 pad, 1 bos, 2 eos
GRAPH_REGION_BYTES = 16 << 30  # address space for the decode graph's memory (8b needs ~0.3 GiB)


@dataclass(frozen=True)
class LmShape:
    """Model shape, with the field names of a transformers ``LlamaConfig``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def config_json(self) -> dict:
        """A transformers-compatible ``config.json`` for this shape."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
                "tie_word_embeddings": False, **asdict(self)}


SIZES = {
    "tiny": LmShape(512, 64, 2, 4, 2, 128, 512),
    "1b": LmShape(128256, 2048, 16, 32, 8, 8192, 4096),  # Llama-3.2-1B's shape
    "8b": LmShape(128256, 4096, 32, 32, 8, 14336, 4096),  # Llama-3-8B's shape: 16 GB in bf16
}


def encode(text: str) -> list[int]:
    return [1] + [b + BYTE_OFFSET for b in text.encode("utf-8")]


def decode(ids: list[int]) -> str:
    return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET).decode("utf-8", "replace")


def parameter_shapes(shape: LmShape) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters in a fixed order, named as transformers names Llama's."""
    h, hd = shape.hidden_size, shape.head_dim
    params = [("model.embed_tokens.weight", (shape.vocab_size, h))]
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        params += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (shape.num_attention_heads * hd, h)),
            (p + "self_attn.k_proj.weight", (shape.num_key_value_heads * hd, h)),
            (p + "self_attn.v_proj.weight", (shape.num_key_value_heads * hd, h)),
            (p + "self_attn.o_proj.weight", (h, shape.num_attention_heads * hd)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (shape.intermediate_size, h)),
            (p + "mlp.up_proj.weight", (shape.intermediate_size, h)),
            (p + "mlp.down_proj.weight", (h, shape.intermediate_size)),
        ]
    params += [("model.norm.weight", (h,)), ("lm_head.weight", (shape.vocab_size, h))]
    return params


class TorchLM:
    """The model, its weights in the ``weights`` region and its KV cache in the ``kv_cache`` region."""

    def __init__(self, size: str, device: str, seed: int = 0, max_seq: int | None = None, cuda_graphs: bool = True):
        self.size = size
        self.shape = SIZES[size]
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.seed = seed
        self.max_seq = min(max_seq or self.shape.max_position_embeddings, self.shape.max_position_embeddings)
        self.lock = threading.Lock()  # one generation at a time; the agent holds it across a snapshot
        backend = "host" if self.device.type == "cpu" else "cuda"
        element = torch.empty((), dtype=self.dtype).element_size()

        tensors, offset = [], 0
        for name, dims in parameter_shapes(self.shape):
            length = math.prod(dims) * element
            tensors.append({"name": name, "dtype": str(self.dtype).removeprefix("torch."), "shape": list(dims),
                            "offset": offset, "length": length})
            offset = -(-(offset + length) // ALIGN) * ALIGN
        kv_bytes = self.kv_shape_numel() * element
        self.weights = reserve("weights", offset, backend=backend, device=self.device.index or 0)
        self.kv = reserve("kv_cache", kv_bytes, backend=backend, device=self.device.index or 0)
        regions = [{"tag": "weights", "size_bytes": self.weights.size, "tensors": tensors},
                   {"tag": "kv_cache", "size_bytes": self.kv.size, "tensors": []}]
        # The decode graph's private memory: address space only, mapped as the capture allocates.
        self.graph_memory = (reserve("cudagraph", GRAPH_REGION_BYTES, backend="cuda", device=self.device.index or 0)
                             if cuda_graphs and self.device.type == "cuda" else None)
        if self.graph_memory is not None:
            regions.append({"tag": "cudagraph", "size_bytes": self.graph_memory.size, "tensors": []})
        self.layout = MemoryLayout.model_validate({"format": 1, "regions": regions})
        self.weights.map(offset)
        self.kv.map(kv_bytes)
        self.params = {t["name"]: self.weights.tensor(self.dtype, t["shape"], t["offset"]) for t in tensors}
        self.cache = self.kv.tensor(self.dtype, self.kv_dims(), 0)
        self.initialize_weights()
        self.kv.zero()
        self._graph: torch.cuda.CUDAGraph | None = None
        if cuda_graphs and self.device.type == "cuda":
            self.capture_decode_graph()

    def kv_dims(self) -> tuple[int, ...]:
        s = self.shape
        return (s.num_hidden_layers, 2, s.num_key_value_heads, self.max_seq, s.head_dim)

    def kv_shape_numel(self) -> int:
        return math.prod(self.kv_dims())

    def initialize_weights(self) -> None:
        """Seeded, device-independent in distribution: normal(0, 0.02) matrices, unit norms."""
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        with torch.no_grad():
            for name, tensor in self.params.items():
                if name.endswith("norm.weight"):
                    tensor.fill_(1.0)
                else:
                    tensor.normal_(0.0, 0.02, generator=generator)

    # ---- the forward pass ---------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.shape.rms_norm_eps)).to(x.dtype) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hd = self.shape.head_dim
        inv = 1.0 / (self.shape.rope_theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
        angles = positions.float()[:, None] * inv[None, :]  # [T, hd/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x.float()[..., : hd // 2], x.float()[..., hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def _decoder(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, kv_end: int) -> torch.Tensor:
        """All layers for the tokens at ``positions``: their keys and values go into the cache there, and
        attention reads the cache's first ``kv_end`` positions under ``mask``. Index ops only, no Python
        values from the GPU, so the same code is captured into a CUDA graph."""
        s, p = self.shape, self.params
        steps = x.shape[0]
        groups = s.num_attention_heads // s.num_key_value_heads
        for i in range(s.num_hidden_layers):
            pre = f"model.layers.{i}."
            h = self._rms(x, p[pre + "input_layernorm.weight"])
            q = (h @ p[pre + "self_attn.q_proj.weight"].T).view(steps, s.num_attention_heads, s.head_dim)
            k = (h @ p[pre + "self_attn.k_proj.weight"].T).view(steps, s.num_key_value_heads, s.head_dim)
            v = (h @ p[pre + "self_attn.v_proj.weight"].T).view(steps, s.num_key_value_heads, s.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            self.cache[i, 0].index_copy_(1, positions, k.transpose(0, 1))
            self.cache[i, 1].index_copy_(1, positions, v.transpose(0, 1))
            keys = self.cache[i, 0, :, :kv_end].repeat_interleave(groups, 0)  # [heads, kv_end, hd]
            values = self.cache[i, 1, :, :kv_end].repeat_interleave(groups, 0)
            scores = (q.transpose(0, 1).float() @ keys.float().transpose(1, 2)) / math.sqrt(s.head_dim) + mask
            attn = (scores.softmax(-1) @ values.float()).to(x.dtype).transpose(0, 1).reshape(steps, -1)
            x = x + attn @ p[pre + "self_attn.o_proj.weight"].T
            h = self._rms(x, p[pre + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ p[pre + "mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ p[pre + "mlp.up_proj.weight"].T)) @ p[pre + "mlp.down_proj.weight"].T
        x = self._rms(x[-1:], p["model.norm.weight"])
        return (x @ p["lm_head.weight"].T)[0]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Logits of the last position; writes the keys and values of ``tokens`` at ``start`` (eager)."""
        steps = tokens.numel()
        end = start + steps
        positions = torch.arange(start, end, device=self.device)
        mask = torch.full((steps, end), float("-inf"), device=self.device).triu(start + 1)
        return self._decoder(self.params["model.embed_tokens.weight"][tokens], positions, mask, end)

    @torch.no_grad()
    def _decode_step(self) -> torch.Tensor:
        """One decode step on the static inputs (``_token``, ``_position``) over the whole cache."""
        positions = self._position.view(1)
        visible = torch.arange(self.max_seq, device=self.device) <= self._position
        mask = torch.where(visible, 0.0, float("-inf"))[None, :]
        return self._decoder(self.params["model.embed_tokens.weight"][self._token], positions, mask, self.max_seq)

    def capture_decode_graph(self) -> None:
        """Record the decode step as a CUDA graph (weights and KV are read at their stable addresses,
        so the graph stays valid across unmap/remap and a process snapshot)."""
        self._token = torch.zeros(1, dtype=torch.long, device=self.device)
        self._position = torch.zeros((), dtype=torch.long, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph, as torch requires
                self._decode_step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        try:
            # Relaxed: the region maps physical memory (cuMemCreate/cuMemMap) as the capture allocates.
            with graph_pool("cudagraph") as pool, torch.cuda.graph(self._graph, pool=pool, capture_error_mode="relaxed"):
                self._graph_logits = self._decode_step()
        except RuntimeError as exc:  # still serve, with the graph memory in torch's own pool (and the image)
            sys.stderr.write(f"torch_lm: capturing the decode graph into the cudagraph region failed ({exc}); "
                             "using torch's graph pool\n")
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._graph_logits = self._decode_step()
        self.kv.zero()  # the warm-up wrote position 0

    def _decode(self, token: int, position: int) -> torch.Tensor:
        if self._graph is None:
            return self.forward(torch.tensor([token], device=self.device), position)
        self._token.fill_(token)
        self._position.fill_(position)
        self._graph.replay()
        return self._graph_logits

    def generate(self, prompt: str, max_tokens: int) -> list[int]:
        """Greedy generation; returns the new token ids."""
        ids = encode(prompt)
        if len(ids) + max_tokens > self.max_seq:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds {self.max_seq}")
        with self.lock:
            out: list[int] = []
            logits = self.forward(torch.tensor(ids, device=self.device), 0)
            position = len(ids)
            for _ in range(max_tokens):
                token = int(logits.float().argmax())
                out.append(token)
                logits = self._decode(token, position)
                position += 1
            return out

    def write_safetensors(self, directory: Path) -> Path:
        """The weights as ``model.safetensors`` + ``config.json`` (the recovery source for restores)."""
        from coldsnap.hydrate.replay import SAFETENSORS_DTYPES

        codes = {torch_name: code for code, (torch_name, _) in SAFETENSORS_DTYPES.items()}
        directory.mkdir(parents=True, exist_ok=True)
        header, offset = {}, 0
        for t in self.layout.regions[0].tensors:
            header[t.name] = {"dtype": codes[t.dtype], "shape": t.shape, "data_offsets": [offset, offset + t.length]}
            offset += t.length
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        path = directory / "model.safetensors"
        with open(path, "wb") as handle:
            handle.write(len(encoded).to_bytes(8, "little") + encoded)
            for t in self.layout.regions[0].tensors:
                handle.write(self.params[t.name].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        (directory / "config.json").write_text(json.dumps(self.shape.config_json(), indent=2) + "\n")
        return path


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
            started = time.perf_counter()
            ids = self.model.generate(prompt, max_tokens)
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(400, {"error": str(exc)})
            return
        self._reply(200, {
            "object": "text_completion",
            "model": self.model_name,
            "choices": [{"index": 0, "text": decode(ids), "token_ids": ids, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(encode(prompt)), "completion_tokens": len(ids),
                      "seconds": round(time.perf_counter() - started, 4)},
        })


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coldsnap.workloads.torch_lm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seq", type=int, default=None, help="KV cache length (default: the shape's maximum)")
    parser.add_argument("--write-safetensors", metavar="DIR", help="write the weights as safetensors and exit")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on the GPU too")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU")
    started = time.perf_counter()
    model = TorchLM(args.size, args.device, args.seed, args.max_seq, cuda_graphs=not args.no_cuda_graphs)
    if args.write_safetensors:
        print(model.write_safetensors(Path(args.write_safetensors)))
        return 0
    server = ThreadingHTTPServer((args.host, args.port), _Handler)
    _Handler.model = model
    _Handler.model_name = f"coldsnap-torch-lm-{args.size}"
    if os.environ.get("COLDSNAP_CONTROL"):
        from coldsnap.agent import start_agent
        from coldsnap.agent.memory import ModelMemory

        from coldsnap.agent.server import AgentHooks

        hooks = AgentHooks()
        if model.device.type == "cuda":
            # As vLLM's sleep does: hand torch's cached free blocks back before the CUDA checkpoint
            # copies device memory into the process image. The decode graph's private pool stays.
            hooks.before_release.append(torch.cuda.empty_cache)
        regions = {"weights": model.weights, "kv_cache": model.kv}
        if model.graph_memory is not None:
            regions["cudagraph"] = model.graph_memory
        start_agent(os.environ["COLDSNAP_CONTROL"], ModelMemory(model.layout, regions),
                    serving_lock=model.lock, port=args.port, hooks=hooks)
    sys.stderr.write(f"torch_lm: {args.size} on {args.device} ready on {args.host}:{args.port} "
                     f"in {time.perf_counter() - started:.2f} s\n")
    sys.stderr.flush()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
