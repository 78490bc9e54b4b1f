"""Tiny random-weight Llama-family checkpoints, built by the tests themselves.

A checkpoint is a Hugging Face directory: config.json, model.safetensors (written by
transformers' save_pretrained) and a word-level tokenizer.json over tokens "t0".."tN".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from radixserve.engine import Engine

DEVICE = os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu")
"""bench/gpu_check.sh runs these tests with the engine on CUDA by setting this variable."""


CPU_ONLY_FORMATS = ("int4", "int8")


def make_engine(model=None, **options) -> Engine:
    """An engine on the test device (CPU unless RADIXSERVE_TEST_DEVICE says otherwise); int4
    and int8 weights run on the CPU only, so an engine with them stays there."""
    cpu_only = options.get("weight_format") in CPU_ONLY_FORMATS
    options.setdefault("device", "cpu" if cpu_only else DEVICE)
    return Engine(None if model is None else str(model), **options)


def run_arrivals(engine, arrivals: list[tuple[int, list[int]]], params) -> list[list[int]]:
    """Step `engine` until it is idle, adding each `(step, prompt)` of `arrivals` (in step
    order) at that step and checking the cache's invariants after every step; returns each
    request's tokens, in arrival order."""
    pending, rids, tokens, step = list(arrivals), [], {}, 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            rid = engine.add_request(pending.pop(0)[1], params)
            rids.append(rid)
            tokens[rid] = []
        for chunk in engine.step():
            tokens[chunk.rid] += chunk.token_ids
        engine.check_invariants()
        step += 1
    return [tokens[r] for r in rids]


def needs_embedded_model() -> None:
    """Skip when the embedded GGUF is missing on a GPU check's machine, where its 92 MB do not
    travel. On the CPU a missing model stays an error: the README's set-up installs it."""
    from radixserve.model.loader import ModelNotFoundError, default_model_path

    try:
        default_model_path()
    except ModelNotFoundError:
        if DEVICE == "cpu":
            raise
        pytest.skip("the embedded model does not travel to the GPU check's machine")


VOCAB = 96


def word_tokenizer(path: Path, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}t1{% endif %}",
            }
        )
    )


def tiny_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a tiny random model of `arch` (llama, qwen2, qwen3) into `path`."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    common.update(overrides)
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # random init gives near-uniform logits; sharpen them for stable argmax
        for p in model.parameters():
            p.mul_(4.0 if p.ndim > 1 else 1.0)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer(path)
    return path


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` on the checkpoint, in float64."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template that knows nothing of tools (as SmolLM2's)."""

CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Functions:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Qwen2.5-style template: tools in the system turn, calls in <tool_call> tags."""


def byte_checkpoint(path: Path, chat_template: str = CHATML, seed: int = 0) -> Path:
    """A tiny random Llama over a byte-level BPE tokenizer (256 byte tokens, no merges, and
    the special tokens <|im_start|> and <|im_end|>, the latter the end of sequence), so that
    it can write any text: JSON, tool calls."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    tiny_checkpoint(
        path, "llama", seed=seed, vocab_size=264, eos_token_id=257, max_position_embeddings=4096
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": chat_template, "eos_token": "<|im_end|>"})
    )
    return path
