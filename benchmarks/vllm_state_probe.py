"""A vLLM worker extension that fingerprints a serving worker's GPU state, for comparing a restored
server with a cold start tensor by tensor (the restored-equals-cold diagnosis).

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --worker-extension-cls benchmarks.vllm_state_probe.StateProbe
    curl -X POST localhost:8000/collective_rpc -d '{"method": "coldsnap_state_digest"}'

``coldsnap_state_digest`` hashes, on the GPU, every parameter and buffer of the model (per 8 MiB block,
so a difference is located to a block), every CUDA tensor reachable from the model runner's attributes
(input buffers, attention metadata builders, graph managers; the KV cache is summarized as its count
of nonzero bytes, since it holds request history), and the process-wide numeric settings that change
kernels (TF32, reduced-precision reductions, deterministic algorithms, cuBLAS workspace). Two
processes that load the same model and serve the same requests give the same digest wherever their
state is the same; vLLM's request-history buffers differ and are reported apart (``runner``).
Only read: nothing in the worker changes, so the extension can ride along a capture.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["StateProbe", "tensor_digest"]

BLOCK_BYTES = 8 << 20
_MULT = 0x9E3779B1  # odd: position-weighted sums tell permutations apart


def tensor_digest(tensor: Any) -> list[int]:
    """One 64-bit value per 8 MiB block of ``tensor``'s bytes (computed where the tensor is)."""
    import torch

    raw = tensor.detach()
    if not raw.is_contiguous():
        raw = raw.contiguous()
    flat = raw.reshape(-1).view(torch.uint8)
    out = []
    for start in range(0, max(flat.numel(), 1), BLOCK_BYTES):
        block = flat[start:start + BLOCK_BYTES]
        if block.numel() % 4 == 0 and block.numel():
            words = block.view(torch.int32).to(torch.int64)
        else:
            words = block.to(torch.int64)
        index = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
        weighted = (words * ((index * _MULT) % 2147483647 + 1)).sum()
        out.append(int(((weighted * 1000003) + words.sum()).item()) & (2**63 - 1))
    return out


SMALL_INTEGER_ELEMENTS = 8192
"""Integer runner tensors up to this size are also reported by value (:func:`nonzero_entries`): a digest says
that FlashAttention's scheduler metadata (per-request split plans, then its tile semaphore) differs, the values say how."""


SCHEDULE_CASES = (
    ("decode-1", [1], [137]), ("decode-1-long", [1], [1500]), ("decode-4", [1, 1, 1, 1], [100, 200, 300, 601]),
    ("prefill-183", [183], [183]), ("prefill-287", [287], [287]), ("prefill-600", [600], [600]),
)
"""(name, query lengths, sequence lengths) of the requests :meth:`StateProbe.coldsnap_attention_schedule` schedules:
single decodes, a batch of four, and the prompt lengths where the bad capture's answers parted (183, 287)."""


def _fa3_builder(runner: Any) -> Any:
    """The model runner's first attention metadata builder that schedules FA3 ahead of time, or None."""
    for groups in getattr(runner, "attn_groups", None) or []:
        for group in groups if isinstance(groups, (list, tuple)) else [groups]:
            for builder in getattr(group, "metadata_builders", None) or []:
                if getattr(builder, "aot_schedule", False):
                    return builder
    return None


def nonzero_entries(tensor: Any, most: int = 32) -> list[list[int]]:
    """The first ``most`` nonzero entries of an integer (or bool) tensor as [flat index, value] pairs.

    torch has no ``nonzero`` for its unsigned 16-, 32- and 64-bit types (CPU or CUDA: vLLM's runner holds
    uint64 tensors, and the probe's HTTP call failed on them), so those are searched as the signed type of
    the same width, bits unchanged, and their values read back unsigned."""
    import torch

    signed_of = {torch.uint16: (torch.int16, 16), torch.uint32: (torch.int32, 32), torch.uint64: (torch.int64, 64)}
    flat = tensor.detach().reshape(-1)
    signed, bits = signed_of.get(flat.dtype, (None, 0))
    searched = flat.view(signed) if signed is not None else flat
    where = searched.nonzero().reshape(-1)[:most]
    values = [v & ((1 << bits) - 1) if bits else v for v in searched[where].tolist()]
    return [[int(i), int(v)] for i, v in zip(where.tolist(), values)]


def _walk(root: Any, prefix: str, seen: set[int], found: dict[str, Any], depth: int) -> None:
    import torch

    if depth < 0 or id(root) in seen:
        return
    seen.add(id(root))
    if isinstance(root, torch.Tensor):
        if root.is_cuda:
            found[prefix] = root
        return
    if isinstance(root, torch.nn.Module):
        return  # the model's own tensors are hashed by name
    if isinstance(root, dict):
        items = [(str(k), v) for k, v in list(root.items())[:256]]
    elif isinstance(root, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(root[:256])]
    elif hasattr(root, "__dict__") and not isinstance(root, type):
        items = list(vars(root).items())
    else:
        return
    for name, value in items:
        _walk(value, f"{prefix}.{name}", seen, found, depth - 1)


class StateProbe:
    """Mixed into vLLM's worker by ``--worker-extension-cls``; ``self`` is the worker."""

    def coldsnap_state_digest(self) -> dict[str, Any]:
        import torch

        runner = getattr(self, "model_runner", None)
        model = getattr(runner, "model", None)
        document: dict[str, Any] = {"pid": os.getpid(), "params": {}, "buffers": {}, "runner": {}, "runner_values": {},
                                    "kv_nonzero_bytes": 0}
        if model is None:
            return {"error": "no model runner with a model in this worker"}
        with torch.no_grad():
            for name, tensor in model.named_parameters(remove_duplicate=False):
                document["params"][name] = tensor_digest(tensor)
            for name, tensor in model.named_buffers(remove_duplicate=False):
                if tensor.is_cuda:
                    document["buffers"][name] = tensor_digest(tensor)
            kv_ids: set[int] = set()
            for tensor in _kv_tensors(runner):
                kv_ids.add(tensor.untyped_storage().data_ptr())
            kv_seen: set[int] = set()
            for tensor in _kv_tensors(runner):
                key = tensor.untyped_storage().data_ptr()
                if key in kv_seen:
                    continue
                kv_seen.add(key)
                storage = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
                for start in range(0, storage.numel(), 64 << 20):  # in slices: no full-size temporary
                    document["kv_nonzero_bytes"] += int(storage[start:start + (64 << 20)].count_nonzero().item())
            found: dict[str, Any] = {}
            _walk(runner, "runner", set(), found, depth=6)
            for name, tensor in sorted(found.items()):
                if tensor.numel() and tensor.untyped_storage().data_ptr() not in kv_ids:
                    document["runner"][name] = [list(tensor.shape), str(tensor.dtype), tensor_digest(tensor)]
                    if not tensor.is_floating_point() and tensor.numel() <= SMALL_INTEGER_ELEMENTS:
                        document["runner_values"][name] = nonzero_entries(tensor)
        backends = torch.backends
        document["flags"] = {
            "allow_tf32": backends.cuda.matmul.allow_tf32,
            "bf16_reduced_precision": backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "fp16_reduced_precision": backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_allow_tf32": backends.cudnn.allow_tf32,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "preferred_blas": str(backends.cuda.preferred_blas_library()),
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("CUBLAS", "CUDA_", "NVIDIA_TF32", "TORCH_", "PYTORCH_", "VLLM_"))},
            "allocated_bytes": torch.cuda.memory_allocated(),
            "reserved_bytes": torch.cuda.memory_reserved(),
        }
        return document

    def coldsnap_kernel_digest(self) -> dict[str, Any]:
        """The model's own layers run eagerly on fixed inputs (the same seed in every process): each
        distinct linear layer (cuBLAS / cuBLASLt with the process's workspaces) at several row counts,
        and the RMSNorm layers. Same weights (``coldsnap_state_digest``) but other outputs here mean the
        kernels compute differently in this process."""
        import torch

        runner = getattr(self, "model_runner", None)
        model = getattr(runner, "model", None)
        if model is None:
            return {"error": "no model"}
        out: dict[str, Any] = {}
        seen: set[tuple[str, tuple[int, ...]]] = set()
        generator = torch.Generator(device="cuda").manual_seed(1234)
        with torch.no_grad():
            for name, module in model.named_modules():
                weight = getattr(module, "weight", None)
                kind = type(module).__name__
                if weight is None or not getattr(weight, "is_cuda", False) or weight.dim() != 2:
                    continue
                if "Embedding" in kind and "ParallelLMHead" not in kind:
                    continue
                key = (kind, tuple(weight.shape))
                if key in seen:
                    continue
                seen.add(key)
                for rows in (1, 8, 33, 256, 600):
                    x = torch.randn(rows, weight.shape[1], generator=generator, device="cuda", dtype=weight.dtype)
                    y = torch.nn.functional.linear(x, weight)
                    out[f"{name}@{rows}"] = tensor_digest(y)[0]
            for name, module in model.named_modules():
                if type(module).__name__ == "RMSNorm":
                    hidden = module.weight.shape[0]
                    x = torch.randn(33, hidden, generator=generator, device="cuda", dtype=module.weight.dtype)
                    out[f"{name}(rmsnorm)"] = tensor_digest(module(x.clone()))[0]
                    break
        return out


    def coldsnap_kernel_configs(self) -> dict[str, list[str]]:
        """The launch configuration each of Inductor's Triton kernels in this process runs with (what its
        autotuning chose, by timing, when it first ran): kernel name and source hash → the configs its
        launchers hold. Two processes of one compiled model can choose differently."""
        import gc
        import hashlib

        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        out: dict[str, list[str]] = {}
        for obj in gc.get_objects():
            if not isinstance(obj, CachingAutotuner):
                continue
            fn = getattr(obj, "fn", None)
            source = getattr(fn, "src", "") or ""
            name = (getattr(obj, "inductor_meta", None) or {}).get("kernel_name") or getattr(fn, "__name__", "?")
            key = f"{name}:{hashlib.sha256(source.encode()).hexdigest()[:12]}"
            launched = sorted(str(getattr(launcher, "config", "?")) for launcher in getattr(obj, "launchers", []) or [])
            out.setdefault(key, []).append(f"{len(getattr(obj, 'configs', []) or [])} configs; runs {launched}")
        if not out:  # this torch keeps its kernels in other objects: name what there is, for the next probe
            kinds: dict[str, int] = {}
            for obj in gc.get_objects():
                module = type(obj).__module__ or ""
                if module.startswith(("torch._inductor", "triton")):
                    kind = f"{module}.{type(obj).__qualname__}"
                    kinds[kind] = kinds.get(kind, 0) + 1
            return {"no CachingAutotuner; objects by type": [f"{k}: {n}" for k, n in sorted(kinds.items())]}
        return {key: sorted(values) for key, values in sorted(out.items())}

    def coldsnap_attention_schedule(self) -> dict[str, Any]:
        """FlashAttention 3's scheduler metadata for fixed requests, computed now in this process with the
        attention builder's own settings (``get_scheduler_metadata``: per-request plans from the sequence
        lengths, the SM count and constants), and the SM count this process sees. The same in every process on
        one kind of GPU, unless this process schedules attention differently: a bad restore's FULL-graph
        metadata differed from every good process's after the same requests."""
        import itertools
        import sys

        import torch

        builder = _fa3_builder(getattr(self, "model_runner", None))
        if builder is None:
            return {"error": "no attention metadata builder with FA3's ahead-of-time scheduling"}
        # (the function the builder's own module calls)
        get_scheduler_metadata = getattr(sys.modules[type(builder).__module__], "get_scheduler_metadata", None)
        if get_scheduler_metadata is None:
            return {"error": f"{type(builder).__module__} has no get_scheduler_metadata"}
        device = torch.cuda.current_device()
        window = getattr(builder, "aot_sliding_window", None) or (-1, -1)
        out: dict[str, Any] = {"multi_processor_count": torch.cuda.get_device_properties(device).multi_processor_count,
                               "max_num_splits": builder.max_num_splits, "window": list(window)}
        for name, query_lens, seq_lens in SCHEDULE_CASES:
            cu_seqlens_q = torch.tensor(list(itertools.accumulate(query_lens, initial=0)), dtype=torch.int32, device="cuda")
            for splits in sorted({builder.max_num_splits, 0}):
                metadata = get_scheduler_metadata(
                    batch_size=len(seq_lens), max_seqlen_q=max(query_lens), max_seqlen_k=max(seq_lens),
                    num_heads_q=builder.num_heads_q * getattr(builder, "dcp_world_size", 1),
                    num_heads_kv=builder.num_heads_kv, headdim=builder.headdim,
                    cache_seqlens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                    qkv_dtype=builder.kv_cache_dtype, cu_seqlens_q=cu_seqlens_q, page_size=builder.block_size,
                    causal=True, window_size=window, num_splits=splits)
                out[f"{name}/splits={splits}"] = metadata.tolist() if metadata is not None else None
        return out


def _kv_tensors(runner: Any) -> list[Any]:
    caches = getattr(runner, "kv_caches", None)
    if isinstance(caches, dict):
        caches = list(caches.values())
    return [t for t in (caches or []) if hasattr(t, "untyped_storage")]
