"""A tiny Llama-shaped model with seeded random weights and a tokenizer trained on the spot.

    python -m coldsnap_vllm.tiny_model DIR [--seed N]

For tests, ``coldsnap demo --engine vllm`` and the vLLM benchmark on machines without a model hub:
``config.json`` (LlamaConfig), ``model.safetensors`` and a byte-level BPE tokenizer with a chat-free
``tokenizer_config.json``. The same seed gives the same files (the tokenizer's merges are learned from
a fixed text). Needs torch, transformers and tokenizers (vLLM brings them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["build_tiny_llama"]

_CORPUS = (
    "Reply with exactly: coldsnap-cuda-snapshot-ok. The quick brown fox jumps over the lazy dog. "
    "Serving fleets scale to zero and back; every cold start costs imports, weight loading and graph "
    "capture. coldsnap captures a fully initialized serving process once and restores it on demand. "
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-_'\"()[]{}<>/\\|@#$%^&*+=~`"
)


def build_tiny_llama(directory: str | Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """Write the model into ``directory`` (created); returns it. Idempotent for the same seed."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 3, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(directory)

    # head_dim 64: vLLM's CPU attention kernels support 32, 64, 80, 96, 112, 128, 256, not 16.
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                         tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "coldsnap-tiny-model.json").write_text(json.dumps({"seed": seed, "vocab_size": vocab_size}) + "\n")
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coldsnap_vllm.tiny_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build_tiny_llama(args.directory, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
