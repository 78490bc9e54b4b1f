"""Write a random-weight Hugging Face checkpoint with a real model's shapes.

    python bench/random_checkpoint.py smollm2-135m /tmp/smollm2-random
    python bench/random_checkpoint.py llama-3.2-1b /tmp/llama-1b-random --dtype bfloat16

For speed figures where the real weights cannot travel: the GPU check's machine takes at most
64 MiB of files, and the embedded GGUF alone is 92 MB. The speed of a forward pass depends on
the shapes, not on the values. The tokenizer is word-level over "t0".."tN", so prompts are
given as token ids. Weights are drawn on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        rope_theta=100_000.0,
        tie_word_embeddings=True,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128_256,
        rope_theta=500_000.0,
        tie_word_embeddings=True,
    ),
}


def write_checkpoint(shape: str, path: Path, dtype: torch.dtype) -> Path:
    """A LlamaForCausalLM of `shape` with random weights and a word-level tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    dims = SHAPES[shape]
    config = transformers.LlamaConfig(
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **dims,
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    vocab = dims["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    path = write_checkpoint(args.shape, args.out, getattr(torch, args.dtype))
    print(f"wrote {args.shape} ({args.dtype}) to {path}")


if __name__ == "__main__":
    main()
