"""The engine's greedy output equals transformers' on the same weights, whatever the settings."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import hf_greedy, make_engine

from radixserve.engine import Engine

PROMPTS = [
    [5, 9, 13, 17, 21, 3, 7],
    [5, 9, 13, 17, 21, 3, 7, 40, 41, 42, 43, 44, 45],
    [60, 61],
    [*range(10, 40)],
    [*range(10, 30), 90, 91, 92],
]


def leak_free(engine: Engine) -> None:
    engine.check_invariants()
    assert not engine.has_work()
    assert engine.cache.protected_size() == 0
    assert engine.allocator.available_size() + engine.cache.total_size() == engine.allocator.size


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-tied-rope3"])
def test_single_requests_match_transformers(checkpoints, arch):
    engine = make_engine(checkpoints[arch], dtype="float64")
    for prompt in PROMPTS[:3]:
        (result,) = engine.generate([prompt], {"max_new_tokens": 12})
        assert result.token_ids == hf_greedy(checkpoints[arch], prompt, 12), prompt
        assert result.finish_reason == "length"
    leak_free(engine)


def test_batches_of_different_lengths_match_transformers(checkpoints):
    path = checkpoints["qwen2"]
    expected = [hf_greedy(path, p, 10) for p in PROMPTS]
    engine = make_engine(path, dtype="float64")
    results = engine.generate(PROMPTS, {"max_new_tokens": 10})
    assert [r.token_ids for r in results] == expected
    leak_free(engine)


SETTINGS = {
    "radix-off": {"enable_radix_cache": False},
    "page-16": {"page_size": 16},
    "many-chunks": {"chunked_prefill_size": 4},
    "many-chunks-page-16": {"chunked_prefill_size": 16, "page_size": 16},
    "tiny-kv": {
        "kv_cache_tokens": 96,
        "scheduler_options": {"init_new_token_ratio": 0.1, "min_new_token_ratio": 0.1},
    },
    "lpm-lfu": {"schedule_policy": "lpm", "eviction_policy": "lfu"},
    "tiny-kv-wgd": {
        "kv_cache_tokens": 96,
        "eviction_policy": "wgd",
        "scheduler_options": {"init_new_token_ratio": 0.1, "min_new_token_ratio": 0.1},
    },
}


@pytest.fixture(scope="module")
def reference(llama_dir):
    engine = make_engine(llama_dir, dtype="float64")
    outputs = [r.token_ids for r in engine.generate(PROMPTS, {"max_new_tokens": 24})]
    # The same prompts again hit the cache; outputs must not change.
    again = [r.token_ids for r in engine.generate(PROMPTS, {"max_new_tokens": 24})]
    assert again == outputs
    return outputs


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_outputs_are_identical_across_engine_settings(llama_dir, reference, name):
    engine = make_engine(llama_dir, dtype="float64", **SETTINGS[name])
    for _ in range(2):  # the second round runs against a warm cache
        results = engine.generate(PROMPTS, {"max_new_tokens": 24})
        assert [r.token_ids for r in results] == reference
        leak_free(engine)
    if name.startswith("tiny-kv"):
        assert engine.scheduler.stats.retractions > 0
        assert engine.scheduler.stats.evicted_tokens > 0


def test_reuse_is_real(llama_dir):
    engine = make_engine(llama_dir, dtype="float64")
    computed = []
    forward = engine._forward

    def counting_forward(batch):
        if batch.mode.value == "extend":
            computed.append(sum(len(e.token_ids) for e in batch.entries))
        return forward(batch)

    engine._forward = counting_forward
    shared = list(range(10, 50))
    first = engine.generate([[*shared, 1, 2]], {"max_new_tokens": 4})[0]
    assert first.usage.cached_tokens == 0 and computed == [42]
    key = np.array([*shared, 3, 4], dtype=np.int32)
    in_tree = engine.cache.peek_prefix(key[:-1])
    second = engine.generate([key.tolist()], {"max_new_tokens": 4})[0]
    assert second.usage.cached_tokens == in_tree == 40
    assert computed[-1] == 42 - 40, "the forward computed only the uncached tokens"
    leak_free(engine)


def test_float32_engine_agrees_with_float64_on_a_short_run(llama_dir, reference):
    engine = make_engine(llama_dir)
    results = engine.generate(PROMPTS[:2], {"max_new_tokens": 6})
    assert [r.token_ids for r in results] == [ref[:6] for ref in reference[:2]]


def test_one_token_steps_use_threads_and_larger_ones_threads_batch(llama_dir, reference):
    """As llama.cpp's -t and -tb; the outputs do not depend on either."""
    import torch

    before = torch.get_num_threads()
    engine = make_engine(llama_dir, dtype="float64", threads=1, threads_batch=2)
    seen: dict[bool, set[int]] = {}
    forward = engine.model.forward

    def recording(input_ids, *args, **kwargs):
        seen.setdefault(len(input_ids) == 1, set()).add(torch.get_num_threads())
        return forward(input_ids, *args, **kwargs)

    engine.model.forward = recording
    try:
        results = engine.generate(PROMPTS, {"max_new_tokens": 24})
        engine.generate(PROMPTS[:1], {"max_new_tokens": 8})  # a lone stream: one-token steps
    finally:
        torch.set_num_threads(before)
    assert [r.token_ids for r in results] == reference
    assert seen == {True: {1}, False: {2}}
