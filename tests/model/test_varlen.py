"""Prefill on CUDA through one variable-length FlashAttention call per layer
(`attention.PackedExtend`, `TorchAttention._extend_varlen`).

The packing runs everywhere; the kernel needs a CUDA device (bench/gpu_check.sh runs these
with RADIXSERVE_TEST_DEVICE=cuda), and is checked there against the per-request SDPA loop.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_helpers import DEVICE, make_engine, run_arrivals

from radixserve.errors import InvalidArgumentError
from radixserve.model.attention import AttentionMetadata, PackedExtend, TorchAttention

ON_CUDA = DEVICE.startswith("cuda")
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="FlashAttention's varlen kernel is CUDA-only")


def _meta(prefix_lens, new_lens, pool: int, device="cpu", seed: int = 0) -> AttentionMetadata:
    """Extend metadata for requests with these prefix and new lengths over distinct random
    pool slots."""
    rng = np.random.default_rng(seed)
    slots = rng.permutation(pool)
    contexts, at = [], 0
    for p, n in zip(prefix_lens, new_lens, strict=True):
        contexts.append(torch.from_numpy(slots[at : at + p + n].copy()).to(device))
        at += p + n
    starts = np.concatenate([[0], np.cumsum(new_lens)[:-1]]).astype(int).tolist()
    new_slots = torch.cat([c[p:] for c, p in zip(contexts, prefix_lens, strict=True)])
    return AttentionMetadata(
        is_decode=False,
        new_slots=new_slots,
        sample_indices=torch.zeros(0, dtype=torch.long, device=device),
        starts=starts,
        new_lens=list(new_lens),
        prefix_lens=list(prefix_lens),
        context_slots=contexts,
    )


def test_packing_lays_requests_back_to_back():
    meta = _meta([0, 5, 12], [3, 1, 4], pool=100)
    packed = PackedExtend.of(meta)
    assert packed.cu_q.tolist() == [0, 3, 4, 8]
    assert packed.cu_k.tolist() == [0, 3, 9, 25]
    assert (packed.max_q, packed.max_k) == (4, 16)
    assert packed.cu_q.dtype == packed.cu_k.dtype == torch.int32
    assert packed.slots.tolist() == torch.cat(meta.context_slots).tolist()


def test_packing_refuses_queries_that_are_not_back_to_back():
    meta = _meta([0, 5], [3, 2], pool=100)
    meta.starts = [0, 4]
    with pytest.raises(InvalidArgumentError, match="back to back"):
        PackedExtend.of(meta)


def test_the_cpu_prefill_never_takes_the_cuda_kernel(monkeypatch):
    backend = TorchAttention()
    monkeypatch.setattr(
        backend, "_extend_varlen", lambda *a: pytest.fail("varlen kernel called on the CPU")
    )
    meta = _meta([0, 4], [3, 2], pool=50)
    k = torch.randn(50, 2, 16, dtype=torch.bfloat16)
    out = backend.forward(torch.randn(5, 4, 16, dtype=torch.bfloat16), k, k, meta)
    assert out.shape == (5, 4, 16)
    assert backend.varlen  # still on: it applies on CUDA only


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_prefill_equals_the_per_request_loop(dtype):
    # SmolLM2-135M's heads: 9 query heads over 3 KV heads of 64.
    prefix_lens, new_lens = [0, 37, 300, 0, 1], [129, 1, 64, 7, 250]
    pool, heads, kv_heads, dim = 2_000, 9, 3, 64
    meta = _meta(prefix_lens, new_lens, pool, device=DEVICE, seed=1)
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=dtype)

    q, k_pool, v_pool = (
        rand(sum(new_lens), heads, dim),
        rand(pool, kv_heads, dim),
        rand(pool, kv_heads, dim),
    )
    varlen = TorchAttention()
    got = varlen.forward(q, k_pool, v_pool, meta)
    assert varlen.varlen and meta.packed is not None  # the kernel ran, no fallback
    loop = TorchAttention()
    loop.varlen = False
    want = loop.forward(q, k_pool, v_pool, _meta(prefix_lens, new_lens, pool, DEVICE, seed=1))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # A request's rows depend on its own context only: the middle request alone agrees.
    alone = _meta([37], [1], pool, device=DEVICE)
    alone.context_slots = [meta.context_slots[1]]
    row = varlen.forward(q[129:130], k_pool, v_pool, alone)
    torch.testing.assert_close(row.float(), got[129:130].float(), atol=1e-2, rtol=1e-2)


@needs_cuda
def test_an_engine_with_varlen_prefill_gives_the_looped_greedy_tokens(llama_dir):
    shared = [int(t) for t in np.random.default_rng(6).integers(3, 90, 60)]
    arrivals = [(0, [*shared, 3 + i, 7, 11 + i]) for i in range(4)]
    arrivals += [(2, [5 + i] * (20 + 7 * i)) for i in range(3)]
    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    loop = make_engine(llama_dir, dtype="bfloat16")
    loop.attention.varlen = False
    want = run_arrivals(loop, arrivals, params)
    engine = make_engine(llama_dir, dtype="bfloat16")
    calls, kernel = [], engine.attention._extend_varlen
    engine.attention._extend_varlen = lambda q, *rest: calls.append(len(q)) or kernel(q, *rest)
    got = run_arrivals(engine, arrivals, params)
    assert engine.attention.varlen and calls
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    # bf16 kernels round differently; a random tiny model's near-ties may flip late tokens.
    assert same >= 0.9 * sum(len(w) for w in want)
    assert [g[0] for g in got] == [w[0] for w in want]
