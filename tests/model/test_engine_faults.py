"""A failing model step ends only its own batch's requests, and leaves no slot behind."""

from __future__ import annotations

import pytest
from model_helpers import make_engine

from radixserve.errors import EngineError

GREEDY = {"max_new_tokens": 12, "ignore_eos": True}


def pool_is_whole(engine) -> None:
    engine.check_invariants()
    assert engine.cache.protected_size() == 0
    assert engine.allocator.available_size() + engine.cache.total_size() == engine.allocator.size


def fail_when(engine, condition):
    """Make the forward raise whenever `condition(batch)` holds; returns the failure count."""
    real = engine._forward
    failures = []

    def forward(batch):
        if condition(batch):
            failures.append(batch)
            raise RuntimeError("injected fault")
        return real(batch)

    engine._forward = forward
    return failures


def run_to_end(engine) -> dict:
    results = {}
    while engine.has_work():
        for chunk in engine.step():
            if chunk.finished:
                results[chunk.rid] = chunk.result
        engine.check_invariants()
    return results


@pytest.mark.parametrize("mixed", [False, True])
def test_a_failed_prefill_ends_only_its_request(llama_dir, mixed):
    # Mixed: `keep` decodes in the failing batch itself and is spared.
    reference = make_engine(llama_dir).generate([[5, 6, 7, 8]], GREEDY)[0]
    engine = make_engine(llama_dir, enable_mixed_chunk=mixed)
    keep = engine.add_request([5, 6, 7, 8], GREEDY)
    engine.step()  # `keep` is prefilled and decodes from here on
    doomed = engine.add_request([9, 10, 11, 12, 13, 14, 15], GREEDY)
    failures = fail_when(engine, lambda b: any(e.req.rid == doomed for e in b.entries))
    results = run_to_end(engine)
    assert len(failures) == 1
    bad = results[doomed]
    assert bad.finish_reason == "abort" and bad.abort_cause == "error"
    assert "RuntimeError: injected fault" in bad.error
    assert results[keep].finish_reason == "length"
    assert results[keep].token_ids == reference.token_ids
    pool_is_whole(engine)


def test_a_failed_decode_step_ends_its_batch_and_the_engine_serves_on(llama_dir):
    engine = make_engine(llama_dir, kv_cache_tokens=256)
    rids = [engine.add_request([5 + i, 6, 7, 8, 9, 10], GREEDY) for i in range(3)]
    fail_when(engine, lambda b: b.mode.value == "decode" and len(b.entries) == 3)
    results = run_to_end(engine)
    assert all(results[r].abort_cause == "error" for r in rids)
    pool_is_whole(engine)
    engine._forward = type(engine)._forward.__get__(engine)
    again = engine.generate([[5, 6, 7, 8, 9, 10]], GREEDY)[0]
    assert again.finish_reason == "length" and len(again.token_ids) == 12
    assert again.usage.cached_tokens > 0  # the failed requests' computed prefixes were kept
    pool_is_whole(engine)


def test_a_failing_chunked_prefill_frees_every_chunk(llama_dir):
    engine = make_engine(llama_dir, chunked_prefill_size=8)
    rid = engine.add_request(list(range(5, 45)), GREEDY)
    engine.step()  # the first chunk of eight succeeds
    fail_when(engine, lambda b: True)
    results = run_to_end(engine)
    assert results[rid].abort_cause == "error"
    pool_is_whole(engine)


def test_generate_reports_a_failed_request_instead_of_raising(llama_dir):
    engine = make_engine(llama_dir)
    fail_when(engine, lambda b: True)
    [result] = engine.generate([[5, 6, 7]], GREEDY)
    assert result.finish_reason == "abort" and result.abort_cause == "error"
    pool_is_whole(engine)


def test_generate_raises_on_a_lost_request_instead_of_looping(llama_dir):
    engine = make_engine(llama_dir)
    real_add = engine.scheduler.add_request
    engine.scheduler.add_request = lambda req: (real_add(req), engine.scheduler.waiting.remove(req))
    with pytest.raises(EngineError, match="lost"):
        engine.generate([[5, 6, 7]], GREEDY)


def test_recover_after_a_scheduler_failure_ends_everything_cleanly(llama_dir):
    engine = make_engine(llama_dir)
    rids = [engine.add_request([5 + i, 6, 7], GREEDY) for i in range(2)]
    engine.step()
    real_step = engine.scheduler.step

    def broken_step():
        real_step()  # admits and allocates, then blows up before the batch is returned
        raise RuntimeError("scheduler bug")

    engine.scheduler.step = broken_step
    engine.add_request([20, 21, 22], GREEDY)
    with pytest.raises(RuntimeError, match="scheduler bug"):
        engine.step()
    chunks = engine.recover(RuntimeError("scheduler bug"))
    assert {c.rid for c in chunks if c.finished} >= set(rids)
    assert all(c.result.abort_cause == "error" for c in chunks if c.finished)
    assert not engine.has_work()
    pool_is_whole(engine)


def test_a_decode_that_breaks_the_model_is_spared_once_not_forever(llama_dir):
    """A running request whose own decode fails the model: the first mixed failure spares it
    (the prefill beside it is blamed), the second ends it, and the engine serves on."""
    engine = make_engine(llama_dir, enable_mixed_chunk=True)
    culprit = engine.add_request([5, 6, 7], {"max_new_tokens": 50, "ignore_eos": True})
    engine.step()
    fail_when(engine, lambda b: any(e.is_decode and e.req.rid == culprit for e in b.entries))
    results = {}
    for i in range(6):  # a new prompt arrives every step
        engine.add_request([20 + i, 21, 22], GREEDY)
        for chunk in engine.step():
            if chunk.finished:
                results[chunk.rid] = chunk.result
        engine.check_invariants()
    assert results[culprit].abort_cause == "error"
    results.update(run_to_end(engine))
    errors = [r for r in results.values() if r.abort_cause == "error"]
    assert len(errors) <= 3  # the culprit and at most the two prompts beside its failures
    assert sum(r.finish_reason == "length" for r in results.values()) >= 4
    pool_is_whole(engine)
