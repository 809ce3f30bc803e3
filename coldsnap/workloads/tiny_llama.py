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
written tensor by tensor. Its tokenizer covers the whole vocabulary (the 512 trained tokens, then one
`` t<id>`` token per other id: random weights generate any id, and each decodes to text) and has a chat
template. Needs torch, transformers, tokenizers and safetensors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_llama", "build_llama_8b_shape", "SHAPES"]

SHAPES = ("tiny", "8b")
LLAMA_3_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 8192,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
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


def build_llama_8b_shape(directory: str | Path, seed: int = 0, device: str | None = None) -> Path:
    """Write a Llama-3-8B-shaped bf16 model with random weights (N(0, 0.02), norms 1) into ``directory``
    in 5 GB shards; returns it. The same seed and device kind give the same bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fast = _tokenizer(directory, 512, int(LLAMA_3_8B["vocab_size"]))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    LlamaConfig(**LLAMA_3_8B, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="bfloat16",
                # SGLang reads the class from config.json (vLLM infers it); save_pretrained of a bare config omits it
                architectures=["LlamaForCausalLM"]).save_pretrained(directory)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    shards: list[dict[str, Any]] = [{}]
    shard_bytes = 0
    for name, shape in _llama_tensors(LLAMA_3_8B):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=generator).cpu()
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
    (directory / "coldsnap-tiny-model.json").write_text(json.dumps({"seed": seed, "shape": "8b"}) + "\n")
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coldsnap.workloads.tiny_llama", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=SHAPES, default="tiny", help="tiny (default) or 8b (Llama-3-8B geometry)")
    parser.add_argument("--device", help="8b: where the weights are drawn (default cuda when there is one)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="tiny: the checkpoint's dtype (bfloat16: what vLLM runs it in, so its loaders copy the "
                             "files' bytes unchanged; 8b is always bfloat16)")
    args = parser.parse_args(argv)
    if args.shape == "8b":
        print(build_llama_8b_shape(args.directory, args.seed, args.device))
    else:
        print(build_tiny_llama(args.directory, args.seed, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
