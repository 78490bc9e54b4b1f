"""Mixed chunks: running requests decode in the same forward as a prefill chunk."""

from __future__ import annotations

import pytest
from model_helpers import make_engine

from radixserve.sched.scheduler import ForwardMode

GREEDY = {"max_new_tokens": 24, "ignore_eos": True}


def staggered(engine) -> dict[str, list[int]]:
    """Two short requests decode while a long prompt arrives and is prefilled in chunks."""
    first = [engine.add_request([5 + i, 6, 7, 8], GREEDY) for i in range(2)]
    engine.step()
    engine.step()
    long = engine.add_request(list(range(10, 90)) * 2, GREEDY)
    tokens: dict[str, list[int]] = {rid: [] for rid in [*first, long]}
    while engine.has_work():
        for chunk in engine.step():
            tokens[chunk.rid] += chunk.token_ids
        engine.check_invariants()
    return tokens


def test_mixed_chunks_give_the_same_greedy_tokens(llama_dir):
    plain = staggered(make_engine(llama_dir, dtype="float64", chunked_prefill_size=32))
    mixed_engine = make_engine(
        llama_dir, dtype="float64", chunked_prefill_size=32, enable_mixed_chunk=True
    )
    mixed = staggered(mixed_engine)
    assert list(mixed.values()) == list(plain.values())
    assert mixed_engine.scheduler.stats.mixed_batches >= 4


@pytest.mark.parametrize("mixed", [False, True])
def test_a_running_stream_gets_tokens_during_a_long_prefill(llama_dir, mixed):
    engine = make_engine(llama_dir, chunked_prefill_size=16, enable_mixed_chunk=mixed)
    running = engine.add_request([5, 6, 7], {"max_new_tokens": 200, "ignore_eos": True})
    engine.step()
    engine.add_request(list(range(10, 90)) * 2, {"max_new_tokens": 1})  # 160 tokens: 10 chunks
    during, chunks = 0, 0
    real_step = engine.scheduler.step

    def step():
        batch = real_step()
        nonlocal chunks
        if batch is not None and batch.mode is ForwardMode.EXTEND:
            chunks += 1
        return batch

    engine.scheduler.step = step
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        for chunk in engine.step():
            if chunk.rid == running:
                during += len(chunk.token_ids)
    assert chunks >= 10
    if mixed:
        assert during >= chunks - 1  # one token per prefill chunk
    else:
        assert during == 0  # prefill first: the stream stalls for the whole prompt
    engine.abort(running)
    while engine.has_work():
        engine.step()
    engine.check_invariants()
