"""The pure decode step and its compiled path (`EngineConfig.compile`)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from model_helpers import DEVICE, make_engine, run_arrivals

from radixserve.model.compiled import WIDTH_STEP, context_table

GREEDY = {"max_new_tokens": 20, "ignore_eos": True}


def prefilled(engine, prompts):
    """Run each prompt's prefill; returns the requests, each about to decode."""
    rids = [engine.add_request(p, {"max_new_tokens": 50, "ignore_eos": True}) for p in prompts]
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    running = {r.rid: r for r in engine.scheduler.running}
    return [running[rid] for rid in rids]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama-tied-rope3"])
def test_decode_step_equals_the_forward_it_replaces(checkpoints, arch):
    engine = make_engine(checkpoints[arch], dtype="float64")
    reqs = prefilled(engine, [[3, 4, 5, 6, 7], [9, 8], list(range(10, 50))])
    model, kv, dev = engine.model, engine.kv, engine.device
    ids = torch.tensor([r.output_ids[-1] for r in reqs], device=dev)
    prefixes = [r.kv_indices() for r in reqs]
    positions = torch.tensor([len(p) for p in prefixes], device=dev)
    table, mask = (torch.from_numpy(t).to(dev) for t in context_table(prefixes))
    pool_before = kv.k.clone(), kv.v.clone()
    logits, new_k, new_v = model.decode_step(ids, positions, table, mask, kv.k, kv.v)
    assert torch.equal(kv.k, pool_before[0]) and torch.equal(kv.v, pool_before[1])
    # The reference: the engine's own eager forward, which writes the pool.
    new_slots = np.arange(kv.num_slots - len(reqs), kv.num_slots)
    reference = forward_decode(engine, ids, prefixes, new_slots)
    torch.testing.assert_close(logits, reference, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(new_k, kv.k[:, new_slots], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(new_v, kv.v[:, new_slots], rtol=1e-9, atol=1e-12)


def forward_decode(engine, ids, prefixes, new_slots):
    from radixserve.model.attention import AttentionMetadata

    width = max(len(p) for p in prefixes) + 1
    table = np.zeros((len(prefixes), width), dtype=np.int64)
    for row, (prefix, slot) in enumerate(zip(prefixes, new_slots, strict=True)):
        table[row, : len(prefix)] = prefix
        table[row, len(prefix)] = slot
    dev = engine.device
    meta = AttentionMetadata(
        is_decode=True,
        new_slots=torch.from_numpy(new_slots).to(dev),
        sample_indices=torch.arange(len(prefixes), device=dev),
        starts=[],
        new_lens=[],
        prefix_lens=[],
        context_slots=[],
        decode_slots=torch.from_numpy(table).to(dev),
        decode_mask=torch.from_numpy(
            np.arange(width)[None, :] <= np.array([len(p) for p in prefixes])[:, None]
        ).to(dev),
    )
    positions = torch.tensor([len(p) for p in prefixes], device=dev)
    return engine.model(ids, positions, engine.kv, meta, engine.attention)


def test_context_table_pads_to_a_width_step():
    table, mask = context_table([np.array([4, 5, 6]), np.arange(1, 40)])
    assert table.shape == (2, 2 * WIDTH_STEP)
    assert table[0, :3].tolist() == [4, 5, 6] and not table[0, 3:].any()
    assert mask.sum(axis=1).tolist() == [3, 39]
    assert context_table([np.array([1])])[0].shape == (1, WIDTH_STEP)


def staggered(engine) -> list[list[int]]:
    """One request alone, then three that join it: decode batches of 1, 2, 3 and 4."""
    joining = [(step, list(range(10 + step, 30 + 2 * step))) for step in (4, 6, 9)]
    return run_arrivals(engine, [(0, [3, 4, 5, 6]), *joining], GREEDY)


def test_compiled_decode_gives_the_eager_greedy_tokens(llama_dir, caplog):
    eager = staggered(make_engine(llama_dir, dtype="float64"))
    with caplog.at_level(logging.INFO, logger="radixserve.engine"):
        engine = make_engine(
            llama_dir, dtype="float64", compile=True, max_running_requests=4, cuda_graph=False
        )
    assert engine.compiled_decode is not None, caplog.text
    assert "compiled the decode step" in caplog.text
    calls = count_calls(engine)
    kernel, mixed = engine.attention.compiled_rows, []
    on_cpu = DEVICE == "cpu"  # decode attention alone compiles on the CPU only
    assert (kernel is not None) == on_cpu  # mixed steps' decode rows get it there
    if on_cpu:
        engine.attention.compiled_rows = lambda q, *rest: mixed.append(len(q)) or kernel(q, *rest)
    assert staggered(engine) == eager
    assert calls["n"] >= 20  # decode steps went through the graph
    if on_cpu:
        assert mixed and min(mixed) >= 2  # and mixed steps through the compiled attention
    assert engine.compiled_decode is not None


def count_calls(engine) -> dict:
    calls = {"n": 0}
    graph = engine.compiled_decode._graph

    def counted(*args):
        calls["n"] += 1
        return graph(*args)

    engine.compiled_decode._graph = counted
    return calls


def test_a_failing_graph_falls_back_to_eager_without_losing_the_step(llama_dir, caplog):
    eager = staggered(make_engine(llama_dir, dtype="float64"))
    engine = make_engine(llama_dir, dtype="float64")
    from radixserve.model.compiled import CompiledDecode

    broken = CompiledDecode(engine.model, engine.kv, engine.device)

    def fail(*args):
        raise RuntimeError("simulated compiler failure")

    broken._graph = fail
    engine.compiled_decode = broken
    with caplog.at_level(logging.WARNING, logger="radixserve.engine"):
        assert staggered(engine) == eager
    assert engine.compiled_decode is None
    assert "simulated compiler failure" in caplog.text


def test_compiled_decode_reaches_the_onednn_dense_copies(llama_dir, monkeypatch):
    """int8 layers hand batches of 4 rows to their oneDNN-blocked bfloat16 copies, which the
    graph reaches through the `radixserve::dense_linear` op; its logits are the eager
    forward's within bfloat16 rounding. (A threshold of 3 makes dynamo 2.13 fail on the
    nested layer region, with or without the blocked copies; the engine's measured threshold
    is 2, 4, 8, 16 or 32.)"""
    from radixserve.model import quant

    if not quant.onednn_blocks_bfloat16():
        pytest.skip("oneDNN cannot block bfloat16 weights here (no oneDNN, or an AVX2-only CPU)")
    if DEVICE != "cpu":  # it ran past the GPU check's time limit on that machine's CPU
        pytest.skip("a CPU path, which the CPU suite covers")

    monkeypatch.setattr(quant, "dense_rows_threshold", lambda: 4)
    engine = make_engine(llama_dir, weight_format="int8", compile=True, max_running_requests=4)
    assert engine.compiled_decode is not None
    assert engine.model.lm_head.dense_blocked is not None
    reqs = prefilled(engine, [[3, 4, 5, 6, 7], [9, 8], list(range(10, 50)), [1, 2, 3]])
    ids = torch.tensor([r.output_ids[-1] for r in reqs])
    prefixes = [r.kv_indices() for r in reqs]
    lookups = {"n": 0}

    class Counted(dict):
        def __getitem__(self, key):
            lookups["n"] += 1
            return super().__getitem__(key)

    monkeypatch.setattr(quant, "_BLOCKED", Counted(quant._BLOCKED))
    positions = torch.tensor([len(p) for p in prefixes])
    logits, _, _ = engine.compiled_decode._run(ids, positions, prefixes)
    assert lookups["n"] == 9  # 4 layers a block, 2 blocks, and the LM head
    new_slots = np.arange(engine.kv.num_slots - len(reqs), engine.kv.num_slots)
    reference = forward_decode(engine, ids, prefixes, new_slots).float()
    scale = reference.abs().max()
    assert (logits.float() - reference).abs().max() < 2e-2 * scale


@pytest.mark.skipif(DEVICE != "cpu", reason="thread counts size inductor's CPU loops only")
def test_graphs_compile_under_the_threads_they_will_run_with(llama_dir, monkeypatch):
    """Inductor sizes its parallel loops to the thread count at compile time: the batch-1
    graph compiles under `threads`, larger ones under `threads_batch`."""
    from radixserve.model import compiled

    seen = []

    def recording_compile(fn, **options):
        def graph(input_ids, *args):
            seen.append((len(input_ids), torch.get_num_threads()))
            return fn(input_ids, *args)

        return graph

    before = torch.get_num_threads()
    monkeypatch.setattr(compiled.torch, "compile", recording_compile)
    try:
        make_engine(llama_dir, compile=True, threads=1, threads_batch=2, max_running_requests=4)
    finally:
        torch.set_num_threads(before)
    # (Decode attention's kernels warm up on larger batches, under threads_batch too.)
    assert {threads for rows, threads in seen if rows == 1} == {1}
    assert {threads for rows, threads in seen if rows > 1} == {2}


def test_compiled_cpu_attention_form_equals_the_matmul_form():
    """Under inductor on the CPU, decode attention runs as fused products and sums; it must
    give the matmul form's numbers, with GQA, padded widths and a row with no context."""
    from radixserve.model.attention import single_query_attention

    gen = torch.Generator().manual_seed(5)
    rows, width, heads, kv_heads, dim = 4, 40, 6, 2, 16

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k_new, v_new = draw(rows, heads, dim), draw(rows, kv_heads, dim), draw(rows, kv_heads, dim)
    k_ctx, v_ctx = draw(rows, width, kv_heads, dim), draw(rows, width, kv_heads, dim)
    lengths = torch.tensor([40, 17, 0, 1])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    eager = single_query_attention(q, k_ctx, v_ctx, k_new, v_new, mask)
    compiled = torch.compile(single_query_attention, dynamic=False)(
        q, k_ctx, v_ctx, k_new, v_new, mask
    )
    torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)
    # The empty row attends to its own key alone.
    torch.testing.assert_close(eager[2], v_new[2].repeat_interleave(heads // kv_heads, 0))


def test_mixed_batches_decode_rows_through_the_compiled_kernel():
    """TorchAttention.compile_decode: decode rows of eager batches go through the compiled
    kernel and give the eager numbers, at widths and row counts it was not warmed on; one row
    stays eager."""
    from radixserve.model.attention import AttentionMetadata, TorchAttention

    gen = torch.Generator().manual_seed(7)
    slots_total, kv_heads, heads, dim = 300, 2, 6, 16
    k_pool = torch.randn(slots_total, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_pool = torch.randn(slots_total, kv_heads, dim, generator=gen, dtype=torch.float64)
    eager, compiled = TorchAttention(), TorchAttention()
    compiled.compile_decode(k_pool, v_pool, heads)
    calls = []
    kernel = compiled.compiled_rows
    compiled.compiled_rows = lambda *a: calls.append(a[0].shape[0]) or kernel(*a)
    for rows, width in ((3, 41), (9, 130), (1, 20)):
        table = torch.randint(0, slots_total, (rows, width), generator=gen)
        lengths = torch.randint(1, width + 1, (rows,), generator=gen)
        meta = AttentionMetadata(
            is_decode=True,
            new_slots=table[:, 0],
            sample_indices=torch.arange(rows),
            starts=[],
            new_lens=[],
            prefix_lens=[],
            context_slots=[],
            decode_slots=table,
            decode_mask=torch.arange(width)[None, :] < lengths[:, None],
        )
        q = torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen, dtype=torch.float64)
        q = q[:, :heads]  # a view, as the projection hands it over
        with torch.inference_mode():
            want = eager.forward(q, k_pool, v_pool, meta)
            got = compiled.forward(q, k_pool, v_pool, meta)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert calls == [3, 9]
