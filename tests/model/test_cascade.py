"""Cascade attention: decode rows that share a prefix attend to it once (`attention.cascade_*`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_helpers import DEVICE, make_engine, run_arrivals

from radixserve.model.attention import (
    AttentionMetadata,
    TorchAttention,
    cascade_attention,
    plan_cascade,
    pooled_decode_attention,
)

POOL, KV_HEADS, HEADS, DIM = 3_000, 2, 6, 16


def _table(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(r) for r in rows])
    table = np.zeros((len(rows), lengths.max()), dtype=np.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table, lengths


def _contexts(seed: int = 0) -> list[np.ndarray]:
    """Rows 0-2 share 70 slots (row 2 shares 90 with row 0), rows 3 and 4 share 80 of
    another prompt, row 5 is alone, row 6 shares only 10 slots with rows 0-2."""
    rng = np.random.default_rng(seed)
    a, b = rng.permutation(2_000)[:200], rng.permutation(2_000)[:100] + 500
    return [
        np.r_[a[:70], [2_900]],
        np.r_[a[:70], a[100:110], [2_901]],
        np.r_[a[:90], [2_902]],
        np.r_[b[:80], [2_903, 2_904]],
        np.r_[b[:85], [2_905]],
        np.r_[[1, 2, 3], [2_906]],
        np.r_[a[:10], [2_907]],
    ]


def _pools(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(POOL, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(POOL, KV_HEADS, DIM, generator=gen, dtype=torch.float64)
    return k, v


def test_rows_are_grouped_by_the_prefix_they_share():
    table, lengths = _table(_contexts())
    plan = plan_cascade(table, lengths, min_prefix=64)
    groups = {
        tuple(sorted(m for m in members if m < len(lengths))): int(mask.sum())
        for members, mask in zip(plan.members.tolist(), plan.prefix_mask, strict=True)
    }
    assert groups == {(0, 1, 2): 70, (3, 4): 80}
    assert plan.repeated == 2 * 70 + 80
    # Rows 5 and 6 read everything as their own; every row keeps its new token's slot.
    own = plan.own_mask.sum(1).tolist()
    assert own == [1, 11, 21, 2, 6, 4, 11]
    for row, context in enumerate(_contexts()):
        assert plan.own_slots[row, own[row] - 1] == context[-1]


def test_no_plan_without_two_rows_sharing_enough():
    table, lengths = _table(_contexts())
    assert plan_cascade(table, lengths, min_prefix=100) is None
    assert plan_cascade(table[:1], lengths[:1], min_prefix=1) is None


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("which", [slice(None), slice(3, 5), slice(0, 3)])
def test_cascade_equals_attention_over_each_whole_context(which, eager):
    k_pool, v_pool = _pools()
    table, lengths = _table(_contexts()[which])
    plan = plan_cascade(table, lengths, min_prefix=64)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lengths), HEADS, DIM, generator=gen, dtype=torch.float64)
    mask = torch.from_numpy(np.arange(table.shape[1])[None, :] < lengths[:, None])
    want = pooled_decode_attention(q, k_pool, v_pool, torch.from_numpy(table), mask)
    got = cascade_attention(q, k_pool, v_pool, *plan.tensors(), eager=eager)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(DEVICE != "cpu", reason="decode attention is compiled on the CPU only")
def test_the_compiled_cascade_serves_plans_it_was_not_warmed_on():
    k_pool, v_pool = _pools(2)
    eager, compiled = TorchAttention(), TorchAttention()
    compiled.compile_decode(k_pool, v_pool, HEADS)
    assert compiled.compiled_cascade is not None
    for which in (slice(None), slice(3, 5), slice(0, 3)):
        table, lengths = _table(_contexts(3)[which])
        plan = plan_cascade(table, lengths, min_prefix=64)
        mask = torch.from_numpy(np.arange(table.shape[1])[None, :] < lengths[:, None])
        meta = AttentionMetadata(
            is_decode=True,
            new_slots=torch.from_numpy(table[:, 0]),
            sample_indices=torch.arange(len(lengths)),
            starts=[],
            new_lens=[],
            prefix_lens=[],
            context_slots=[],
            decode_slots=torch.from_numpy(table),
            decode_mask=mask,
            cascade=plan,
        )
        q = torch.randn(len(lengths), HEADS, DIM, dtype=torch.float64)
        with torch.inference_mode():
            want = eager.forward(q, k_pool, v_pool, meta)  # no compiled cascade: per row
            got = compiled.forward(q, k_pool, v_pool, meta)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert compiled.compiled_cascade is not None, "it never fell back"


@pytest.mark.skipif(DEVICE != "cpu", reason="decode attention is compiled on the CPU only")
def test_a_compiled_engine_with_cascade_gives_the_eager_greedy_tokens(llama_dir, monkeypatch):
    import radixserve.engine as engine_module

    shared = [int(t) for t in np.random.default_rng(4).integers(3, 90, 80)]
    arrivals = [(step, [*shared, 3 + step, 7, 11 + step]) for step in (0, 3, 4, 6)]
    params = {"max_new_tokens": 12, "ignore_eos": True}
    eager = run_arrivals(make_engine(llama_dir, dtype="float64"), arrivals, params)
    # Pure decode steps of a tiny model never repeat 8,192 shared slots: lower the bar so that
    # they take the cascade too, not only mixed steps' decode rows.
    monkeypatch.setattr(engine_module, "CASCADE_STEP_REPEATED", 64)
    engine = make_engine(llama_dir, dtype="float64", compile=True, max_running_requests=4)
    kernel, calls = engine.attention.compiled_cascade, []
    assert kernel is not None
    engine.attention.compiled_cascade = lambda q, *rest: calls.append(len(q)) or kernel(q, *rest)
    assert run_arrivals(engine, arrivals, params) == eager
    assert calls and max(calls) == 4
    assert engine.attention.compiled_cascade is not None


@pytest.mark.skipif(DEVICE != "cpu", reason="the engine plans cascades on the CPU only")
def test_an_eager_engine_with_cascade_gives_the_per_row_greedy_tokens(llama_dir, monkeypatch):
    import radixserve.engine as engine_module
    from radixserve.model import attention

    shared = [int(t) for t in np.random.default_rng(5).integers(3, 90, 80)]
    arrivals = [(step, [*shared, 3 + step, 7, 11 + step]) for step in (0, 3, 4, 6)]
    params = {"max_new_tokens": 12, "ignore_eos": True}
    per_row = make_engine(llama_dir, dtype="float64")
    per_row.attention.supports_cascade = False
    want = run_arrivals(per_row, arrivals, params)
    monkeypatch.setattr(engine_module, "CASCADE_EAGER_REPEATED", 64)
    calls, kernel = [], attention.cascade_attention
    monkeypatch.setattr(
        attention,
        "cascade_attention",
        lambda q, *rest, **kw: calls.append(len(q)) or kernel(q, *rest, **kw),
    )
    assert run_arrivals(make_engine(llama_dir, dtype="float64"), arrivals, params) == want
    assert calls and max(calls) == 4
