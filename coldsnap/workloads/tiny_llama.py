"""Llama-shaped models with seeded random weights and a tokenizer trained on the spot.

    python -m coldsnap.workloads.tiny_llama DIR [--seed N] [--shape tiny|8b] [--device cuda]

For tests, ``coldsnap demo --engine vllm|sglang`` and the engine benchmarks on machines without a model hub:
``config.json`` (LlamaConfig), safetensors weights and a byte-level BPE tokenizer (512 tokens) with a
chat-free ``tokenizer_config.json``. The same seed gives the same files (the tokenizer's merges are
learned from a fixed text).

``--shape tiny`` (default): 2 layers, hidden 128, float32 (``--dtype bfloat16``: bfloat16), one ``model.safetensors``.
``--shape 8b``: Llama-3-8B's geometry (hidden 4096, 32 layers, 32 heads / 8 KV heads, intermediate
14336, vocab 128256), bf16, ~16 GB in 5 GB shards with ``model.safetensors.index.json``; the weights
are drawn on ``--device`` (default cuda when there is one: the 8 billion draws take seconds there) and
written tensor by tensor. ``--shape 8b-spec`` (``small-spec``: hidden 1024, 6 layers) also writes a
two-layer speculative draft to ``DIRECTORY-draft`` that predicts the target's tokens
(:func:`build_llama_shape`). Its tokenizer covers the whole vocabulary (the 512 trained tokens, then one
`` t<id>`` token per other id: random weights generate any id, and each decodes to text) and has a chat
template. Needs torch, transformers, tokenizers and safetensors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_llama", "build_llama_8b_shape", "build_llama_shape", "SHAPES", "SPECULATIVE_SHAPES"]

SHAPES = ("tiny", "8b", "8b-spec", "small-spec")
LLAMA_3_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
SMALL = {**LLAMA_3_8B, "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 6, "num_attention_heads": 8,
         "num_key_value_heads": 8}
"""A 1.3 GB model with Llama-3's vocabulary: quick GPU checks of what does not need the full 8B."""
SHARD_BYTES = 5 * 10**9

_CORPUS = (
    "Reply with exactly: coldsnap-cuda-snapshot-ok. The quick brown fox jumps over the lazy dog. "
    "Serving fleets scale to zero and back; every cold start costs imports, weight loading and graph "
    "capture. coldsnap captures a fully initialized serving process once and restores it on demand. "
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-_'\"()[]{}<>/\\|@#$%^&*+=~`"
)


CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
"""A plain chat template for the 8B-shaped model, so ``/v1/chat/completions`` serves it."""


def _tokenizer(directory: Path, vocab_size: int, model_vocab_size: int | None = None) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on a fixed corpus. With
    ``model_vocab_size`` (the 8B shape's 128256), the vocabulary is filled up to the model's with tokens
    `` t<id>`` that no merge produces: prompts encode as before, and every id the model can generate
    decodes to text (with 512 tokens only, most generated ids decoded to nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 3, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if model_vocab_size is not None:
        document = json.loads(tokenizer.to_str())
        vocab = document["model"]["vocab"]
        for token_id in range(len(vocab), model_vocab_size):
            vocab[f"\u0120t{token_id}"] = token_id  # Ġ: the byte-level alphabet's space
        tokenizer = Tokenizer.from_str(json.dumps(document))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if model_vocab_size is not None:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def build_tiny_llama(directory: str | Path, seed: int = 0, vocab_size: int = 512, dtype: str = "float32") -> Path:
    """Write the model into ``directory`` (created); returns it. Idempotent for the same seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fast = _tokenizer(directory, vocab_size)

    # head_dim 64: vLLM's CPU attention kernels support 32, 64, 80, 96, 112, 128, 256, not 16.
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                         tie_word_embeddings=False, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))  # (drawn in float32 either way: same values, rounded)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "coldsnap-tiny-model.json").write_text(json.dumps({"seed": seed, "vocab_size": vocab_size}) + "\n")
    return directory


def _llama_tensors(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Llama checkpoint, in the order HF writes them."""
    hidden, inter, heads, kv_heads, head_dim = (config["hidden_size"], config["intermediate_size"],
                                                config["num_attention_heads"], config["num_key_value_heads"],
                                                config["head_dim"])
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        tensors += [(f"{prefix}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
                    (f"{prefix}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                    (f"{prefix}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                    (f"{prefix}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
                    (f"{prefix}.mlp.gate_proj.weight", (inter, hidden)),
                    (f"{prefix}.mlp.up_proj.weight", (inter, hidden)),
                    (f"{prefix}.mlp.down_proj.weight", (hidden, inter)),
                    (f"{prefix}.input_layernorm.weight", (hidden,)),
                    (f"{prefix}.post_attention_layernorm.weight", (hidden,))]
    return tensors + [("model.norm.weight", (hidden,)), ("lm_head.weight", (config["vocab_size"], hidden))]


def _write_checkpoint(directory: Path, config: dict[str, Any], tensors: list[tuple[str, Any]], meta: dict[str, Any],
                      fast: Any) -> None:
    """``config.json``, the tensors in 5 GB safetensors shards with their index, and the marker file (last)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    LlamaConfig(**config, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="bfloat16",
                # SGLang reads the class from config.json (vLLM infers it); save_pretrained of a bare config omits it
                architectures=["LlamaForCausalLM"]).save_pretrained(directory)
    shards: list[dict[str, Any]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard_bytes and shard_bytes + nbytes > SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += nbytes
    weight_map, total = {}, 0
    for index, shard in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file_name), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name] = file_name
            total += tensor.numel() * tensor.element_size()
        shard.clear()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    (directory / "coldsnap-tiny-model.json").write_text(json.dumps(meta) + "\n")


def build_llama_shape(directory: str | Path, config: dict[str, Any] = LLAMA_3_8B, seed: int = 0,
                      device: str | None = None, draft_layers: int = 0, shape: str = "8b") -> Path:
    """Write a Llama-shaped bf16 model of ``config`` with random weights (N(0, 0.02), norms 1) into
    ``directory`` in 5 GB shards; returns it. The same seed and device kind give the same bytes.

    ``draft_layers`` > 0 also writes a speculative draft for it into ``DIRECTORY-draft``: the target's
    first ``draft_layers`` layers, embedding, final norm and head (same vocabulary and tokenizer). The
    target's later layers get zero output projections (``o_proj``, ``down_proj``), so they add nothing
    to the residual stream: the target computes a full-size forward whose logits the draft reproduces,
    and a draft whose weights a restore lost would show at once as an acceptance rate near zero."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fast = _tokenizer(directory, 512, int(config["vocab_size"]))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    tensors: list[tuple[str, Any]] = []
    draft: list[tuple[str, Any]] = []
    for name, shape_ in _llama_tensors(config):
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape_, dtype=torch.bfloat16)
        elif draft_layers and layer is not None and layer >= draft_layers and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor = torch.zeros(shape_, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(shape_, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=generator).cpu()
        tensors.append((name, tensor))
        if draft_layers and (layer is None or layer < draft_layers):
            draft.append((name, tensor))
    meta = {"seed": seed, "shape": shape, **({"draft_layers": draft_layers} if draft_layers else {})}
    if draft_layers:
        draft_directory = Path(f"{directory}-draft")
        draft_directory.mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(draft_directory)  # the target's tokenizer: SGLang's STANDALONE compares the vocabularies
        _write_checkpoint(draft_directory, {**config, "num_hidden_layers": draft_layers}, draft,
                          {**meta, "draft_of": str(directory)}, fast)
    _write_checkpoint(directory, config, tensors, meta, fast)
    return directory


def build_llama_8b_shape(directory: str | Path, seed: int = 0, device: str | None = None) -> Path:
    """Write a Llama-3-8B-shaped bf16 model with random weights (N(0, 0.02), norms 1) into ``directory``
    in 5 GB shards; returns it. The same seed and device kind give the same bytes."""
    return build_llama_shape(directory, LLAMA_3_8B, seed, device)


SPECULATIVE_SHAPES = {"8b-spec": (LLAMA_3_8B, 2), "small-spec": (SMALL, 2)}
"""Targets with a speculative draft (``build_llama_shape``'s ``draft_layers``) written beside them."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coldsnap.workloads.tiny_llama", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=SHAPES, default="tiny",
                        help="tiny (default), 8b (Llama-3-8B geometry), or 8b-spec / small-spec: a target with a "
                             "two-layer speculative draft written to DIRECTORY-draft")
    parser.add_argument("--device", help="8b: where the weights are drawn (default cuda when there is one)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="tiny: the checkpoint's dtype (bfloat16: what vLLM runs it in, so its loaders copy the "
                             "files' bytes unchanged; 8b is always bfloat16)")
    args = parser.parse_args(argv)
    if args.shape == "8b":
        print(build_llama_8b_shape(args.directory, args.seed, args.device))
    elif args.shape in SPECULATIVE_SHAPES:
        config, draft_layers = SPECULATIVE_SHAPES[args.shape]
        print(build_llama_shape(args.directory, config, args.seed, args.device, draft_layers, args.shape))
    else:
        print(build_tiny_llama(args.directory, args.seed, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
