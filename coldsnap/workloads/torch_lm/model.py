"""The reference model: a Llama-shaped causal LM with seeded random weights, optionally tensor-parallel.

Weights live in the ``weights`` stable region (their layout is a
:class:`~coldsnap.contracts.layout.MemoryLayout`), a static KV cache in the ``kv_cache`` region, and the
decode CUDA graph's memory in the ``cudagraph`` region. The same size, seed and tensor-parallel world
give the same weights on every start. Tokens are bytes (id = byte + 3), so any prompt works without a
tokenizer download.

Tensor parallel (``world`` > 1, Megatron style): attention heads and MLP columns are split across
ranks, the attention output and MLP down projections are row-parallel and summed with one all-reduce
each per layer; embeddings, norms and the LM head are replicated (drawn from the shared seed, so every
rank computes the same logits and picks the same token).
"""


from __future__ import annotations

import json
import math
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.memory import graph_pool, reserve

__all__ = ["LmShape", "SIZES", "TorchLM", "encode", "decode", "parameter_shapes"]

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


SHARDED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
           "up_proj.weight", "down_proj.weight")
"""Parameters split across tensor-parallel ranks (the rest is replicated)."""


def check_world(shape: LmShape, world: int) -> None:
    for what, count in (("attention heads", shape.num_attention_heads), ("KV heads", shape.num_key_value_heads),
                        ("MLP columns", shape.intermediate_size)):
        if count % world:
            raise ValueError(f"{count} {what} do not split across {world} tensor-parallel ranks")


def parameter_shapes(shape: LmShape, world: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """One rank's parameters in a fixed order, named as transformers names Llama's (the shards of a
    ``world``-way tensor-parallel split: heads and MLP columns divided by ``world``)."""
    check_world(shape, world)
    h, hd = shape.hidden_size, shape.head_dim
    heads, kv_heads, inter = shape.num_attention_heads // world, shape.num_key_value_heads // world, shape.intermediate_size // world
    params: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape.vocab_size, h))]
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        params += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (heads * hd, h)),
            (p + "self_attn.k_proj.weight", (kv_heads * hd, h)),
            (p + "self_attn.v_proj.weight", (kv_heads * hd, h)),
            (p + "self_attn.o_proj.weight", (h, heads * hd)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    params += [("model.norm.weight", (h,)), ("lm_head.weight", (shape.vocab_size, h))]
    return params


class TorchLM:
    """The model (one rank's shard of it), its weights in the ``weights`` region and its KV cache in the
    ``kv_cache`` region. With ``world`` > 1, ``communicator`` sums the row-parallel outputs and
    ``followers`` (rank 0 only) are the channels every request is forwarded on before it runs."""

    def __init__(self, size: str, device: str, seed: int = 0, max_seq: int | None = None, cuda_graphs: bool = True,
                 rank: int = 0, world: int = 1, communicator: Any = None, followers: Iterable[socket.socket] | None = None,
                 weights_file: Path | None = None, native_pack: Path | None = None, defer_graphs: bool = False):
        self.size = size
        self.shape = SIZES[size]
        check_world(self.shape, world)
        if world > 1 and communicator is None:
            raise ValueError("tensor parallel needs a communicator")
        self.rank, self.world, self.communicator = rank, world, communicator
        self.followers = followers or []
        self.heads = self.shape.num_attention_heads // world
        self.kv_heads = self.shape.num_key_value_heads // world
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.seed = seed
        self.max_seq = min(max_seq or self.shape.max_position_embeddings, self.shape.max_position_embeddings)
        self.lock = threading.Lock()  # one generation at a time; the agent holds it across a snapshot
        backend = "host" if self.device.type == "cpu" else "cuda"
        element = torch.empty((), dtype=self.dtype).element_size()

        tensors: list[dict[str, Any]] = []
        offset = 0
        for name, dims in parameter_shapes(self.shape, world):
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
        if native_pack is not None:  # an n580 restore: the capture's pack, hydrated at load time
            from coldsnap.agent.placement import open_fitting_pack
            from coldsnap.hydrate import hydrate_pack

            open_fitting_pack(native_pack, {(t["offset"], t["length"]) for t in tensors})
            stats = hydrate_pack(native_pack, {"weights": self.weights})
            sys.stderr.write(f"torch_lm: {stats.bytes} bytes of weights hydrated from {native_pack.name} "
                             f"at {stats.gb_per_s:.2f} GB/s\n")
        elif weights_file is None:
            self.initialize_weights()
        else:  # by name into the region, as a recovery restore replays them
            from coldsnap.hydrate.replay import replay_safetensors

            replay_safetensors([weights_file], self.layout, {"weights": self.weights})
        self.kv.zero()
        self._graph: torch.cuda.CUDAGraph | None = None
        # Eager first (an n580 restore): decode runs the graph's own step uncaptured — the same kernels, so
        # the same tokens — until the first request has been answered, then the graph is captured.
        self._graph_pending = cuda_graphs and self.device.type == "cuda" and defer_graphs and world == 1
        self._graph_arming = False
        if self._graph_pending:
            self._static_decode_inputs()
        elif cuda_graphs and self.device.type == "cuda":
            self.capture_decode_graph()

    def kv_dims(self) -> tuple[int, ...]:
        s = self.shape
        return (s.num_hidden_layers, 2, self.kv_heads, self.max_seq, s.head_dim)

    def kv_shape_numel(self) -> int:
        return math.prod(self.kv_dims())

    def initialize_weights(self) -> None:
        """Seeded, device-independent in distribution: normal(0, 0.02) matrices, unit norms. Replicated
        tensors come from the shared seed (the same on every rank); shards from a per-rank one."""
        shared = torch.Generator(device=self.device).manual_seed(self.seed)
        local = (torch.Generator(device=self.device).manual_seed(self.seed + 1 + self.rank) if self.world > 1 else shared)
        with torch.no_grad():
            for name, tensor in self.params.items():
                if name.endswith("norm.weight"):
                    tensor.fill_(1.0)
                else:
                    tensor.normal_(0.0, 0.02, generator=local if name.endswith(SHARDED) else shared)

    def _sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            x = x.contiguous()
            self.communicator.all_reduce(x)
        return x

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

    def _decoder(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, kv_end: int,
                 every_position: bool = False) -> torch.Tensor:
        """All layers for the tokens at ``positions``: their keys and values go into the cache there, and
        attention reads the cache's first ``kv_end`` positions under ``mask``. Index ops only, no Python
        values from the GPU, so the same code is captured into a CUDA graph. The logits of the last
        position, or of every one (``every_position``: a row each)."""
        s, p = self.shape, self.params
        steps = x.shape[0]
        groups = self.heads // self.kv_heads
        for i in range(s.num_hidden_layers):
            pre = f"model.layers.{i}."
            h = self._rms(x, p[pre + "input_layernorm.weight"])
            q = (h @ p[pre + "self_attn.q_proj.weight"].T).view(steps, self.heads, s.head_dim)
            k = (h @ p[pre + "self_attn.k_proj.weight"].T).view(steps, self.kv_heads, s.head_dim)
            v = (h @ p[pre + "self_attn.v_proj.weight"].T).view(steps, self.kv_heads, s.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            self.cache[i, 0].index_copy_(1, positions, k.transpose(0, 1))
            self.cache[i, 1].index_copy_(1, positions, v.transpose(0, 1))
            keys = self.cache[i, 0, :, :kv_end].repeat_interleave(groups, 0)  # [heads, kv_end, hd]
            values = self.cache[i, 1, :, :kv_end].repeat_interleave(groups, 0)
            scores = (q.transpose(0, 1).float() @ keys.float().transpose(1, 2)) / math.sqrt(s.head_dim) + mask
            attn = (scores.softmax(-1) @ values.float()).to(x.dtype).transpose(0, 1).reshape(steps, -1)
            x = x + self._sum_over_ranks(attn @ p[pre + "self_attn.o_proj.weight"].T)
            h = self._rms(x, p[pre + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ p[pre + "mlp.gate_proj.weight"].T)
            x = x + self._sum_over_ranks((gate * (h @ p[pre + "mlp.up_proj.weight"].T)) @ p[pre + "mlp.down_proj.weight"].T)
        x = self._rms(x if every_position else x[-1:], p["model.norm.weight"])
        logits = x @ p["lm_head.weight"].T
        return logits if every_position else logits[0]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: int, every_position: bool = False) -> torch.Tensor:
        """Logits of the last position (of every one: a row each); writes the keys and values of
        ``tokens`` at ``start`` (eager)."""
        steps = tokens.numel()
        end = start + steps
        positions = torch.arange(start, end, device=self.device)
        mask = torch.full((steps, end), float("-inf"), device=self.device).triu(start + 1)
        return self._decoder(self.params["model.embed_tokens.weight"][tokens], positions, mask, end, every_position)

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
        self._static_decode_inputs()
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
        self._graph_pending = False

    def _static_decode_inputs(self) -> None:
        self._token = torch.zeros(1, dtype=torch.long, device=self.device)
        self._position = torch.zeros((), dtype=torch.long, device=self.device)

    def _arm_graphs_after_ready(self) -> None:
        """Once, after a request was answered: capture the decode graph in the background, between requests."""
        if not self._graph_pending or self._graph_arming:
            return
        self._graph_arming = True

        def capture() -> None:
            started = time.perf_counter()
            with self.lock, torch.cuda.device(self.device):
                self.capture_decode_graph()
            sys.stderr.write(f"torch_lm: decode graph captured after the first answer in "
                             f"{time.perf_counter() - started:.2f} s (eager until then)\n")

        threading.Thread(target=capture, name="torch-lm-graph-capture", daemon=True).start()

    def release_graphs(self, policy: str) -> list[str]:
        """The agent's graph hook: drop the decode graph unless the policy keeps it and it holds no
        NCCL kernels (tensor parallel on GPU: its all-reduces belong to a communicator that a snapshot
        destroys)."""
        if self._graph is None or (policy == "retain" and self.world == 1):
            return []
        self._graph.reset()
        self._graph = None
        return ["decode"]

    def recapture_graphs(self) -> list[str]:
        with torch.cuda.device(self.device):  # the agent's thread has no current device of its own
            self.capture_decode_graph()
        return ["decode"]

    def _decode(self, token: int, position: int) -> torch.Tensor:
        if self._graph is None and self._graph_pending:  # eager first: the graph's step, uncaptured
            self._token.fill_(token)
            self._position.fill_(position)
            return self._decode_step()
        if self._graph is None:
            return self.forward(torch.tensor([token], device=self.device), position)
        self._token.fill_(token)
        self._position.fill_(position)
        self._graph.replay()
        return self._graph_logits

    def generate(self, prompt: str, max_tokens: int, prompt_argmax: list | None = None) -> list[int]:
        """Greedy generation; returns the new token ids. ``prompt_argmax``, when given, receives the top-1
        next token and its log-probability at every prompt position but the last (the prefill's
        predictions, as an OpenAI server's ``prompt_logprobs`` give them)."""
        ids = encode(prompt)
        if len(ids) + max_tokens > self.max_seq:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds {self.max_seq}")
        with self.lock:
            for follower in self.followers:  # under the lock: followers run requests in this order
                follower.sendall(json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode() + b"\n")
            out: list[int] = []
            logits = self.forward(torch.tensor(ids, device=self.device), 0, every_position=prompt_argmax is not None)
            if prompt_argmax is not None:
                best = torch.log_softmax(logits[:-1].float(), -1).max(-1)
                prompt_argmax.extend(zip(best.indices.tolist(), best.values.tolist()))
                logits = logits[-1]
            position = len(ids)
            for _ in range(max_tokens):
                token = int(logits.float().argmax())
                out.append(token)
                logits = self._decode(token, position)
                position += 1
        self._arm_graphs_after_ready()
        return out

    def write_safetensors(self, directory: Path) -> Path:
        """The weights as ``model.safetensors`` + ``config.json`` (the recovery source for restores)."""
        if self.world > 1:
            raise ValueError("safetensors are written for the unsplit model (--tp 1)")
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
