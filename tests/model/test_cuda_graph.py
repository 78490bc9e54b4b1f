"""CUDA-graph decode: buckets, padding and replay give the eager engine's tokens.

On the CPU the padded step runs without graphs (`capture=False`), which checks everything but
the capture itself; with RADIXSERVE_TEST_DEVICE=cuda (bench/gpu_check.sh) the same tests
capture and replay real graphs.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from model_helpers import DEVICE, make_engine, run_arrivals
from test_compiled import prefilled

from radixserve.model.compiled import context_table
from radixserve.model.cuda_graph import MIN_WIDTH, CudaGraphDecode, batch_buckets, width_bucket

GREEDY = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
ON_CUDA = DEVICE.startswith("cuda")


def test_batch_buckets_cover_every_size_up_to_the_maximum():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100)[-3:] == [64, 96, 100]
    for top in (1, 3, 17, 64, 130):
        buckets = batch_buckets(top)
        assert buckets == sorted(set(buckets)) and buckets[-1] == top


def test_width_buckets_are_powers_of_two_from_the_minimum_up_to_the_cap():
    assert width_bucket(0, 4096) == MIN_WIDTH
    assert width_bucket(MIN_WIDTH, 4096) == MIN_WIDTH
    assert width_bucket(MIN_WIDTH + 1, 4096) == 2 * MIN_WIDTH
    assert width_bucket(1000, 4096) == 1024
    assert width_bucket(3000, 3000) == 3000


def waves(engine) -> list[list[int]]:
    """Requests that join and leave at different steps, with contexts from 5 to 230 tokens:
    decode batches of 1 to 6 rows, widths across three buckets."""
    lengths = [5, 70, 130, 2, 190, 100]
    prompts = [[3 + (7 * i + n) % 90 for i in range(n)] for n in lengths]
    return run_arrivals(engine, [(7 * k, p) for k, p in enumerate(prompts)], GREEDY)


def graph_engine(llama_dir, max_batch: int, max_width: int):
    engine = make_engine(llama_dir, dtype="float64", cuda_graph=False, max_running_requests=6)
    engine.compiled_decode = CudaGraphDecode(
        engine.model.decode_step, engine.kv, engine.device, max_batch, max_width, ON_CUDA
    )
    return engine


@pytest.mark.parametrize("rows", [1, 3])
def test_a_padded_step_gives_the_unpadded_steps_logits_and_keys(llama_dir, rows):
    """Three rows padded to a bucket of 4 and a width of 64, one row to a width of 256."""
    engine = make_engine(llama_dir, dtype="float64", cuda_graph=False)
    prompts = [[3, 4, 5, 6, 7], [9, 8], list(range(10, 50))][:rows] if rows > 1 else [[5] * 150]
    reqs = prefilled(engine, prompts)
    kv, dev = engine.kv, engine.device
    ids = np.array([r.output_ids[-1] for r in reqs])
    prefixes = [r.kv_indices() for r in reqs]
    positions = np.array([len(p) for p in prefixes])
    table, mask = (torch.from_numpy(t).to(dev) for t in context_table(prefixes))
    with torch.no_grad():
        want, want_k, want_v = engine.model.decode_step(
            torch.from_numpy(ids).to(dev),
            torch.from_numpy(positions).to(dev),
            table,
            mask,
            kv.k,
            kv.v,
        )
    graphs = CudaGraphDecode(engine.model.decode_step, kv, dev, 4, 512, ON_CUDA)
    new_slots = np.arange(kv.num_slots - rows, kv.num_slots)
    logits = graphs(ids, positions, prefixes, new_slots)
    assert list(graphs.graphs) == [(4 if rows == 3 else 1, 64 if rows == 3 else 256)]
    torch.testing.assert_close(logits, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(kv.k[:, new_slots], want_k, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(kv.v[:, new_slots], want_v, rtol=1e-9, atol=1e-12)


def test_verify_passes_a_sound_graph_and_catches_one_that_ignores_its_input(llama_dir):
    engine = make_engine(llama_dir, dtype="float64", cuda_graph=False)
    kv, dev, vocab = engine.kv, engine.device, engine.model.config.vocab_size
    graphs = CudaGraphDecode(engine.model.decode_step, kv, dev, 4, 256, ON_CUDA)
    before = kv.k.clone()
    graphs.verify(vocab)
    assert set(graphs.graphs) == {(1, MIN_WIDTH), (4, MIN_WIDTH)}
    assert torch.equal(kv.k, before)
    stale = graphs.graphs[4, MIN_WIDTH]
    first = tuple(t.clone() for t in stale.run())
    stale.run = lambda: first  # outputs of an earlier input, as a graph bound to the wrong buffer
    with pytest.raises(RuntimeError, match="graph of 4 rows disagrees"):
        graphs.verify(vocab)


def test_padded_graph_steps_give_the_eager_tokens(llama_dir):
    eager = waves(make_engine(llama_dir, dtype="float64", cuda_graph=False))
    engine = graph_engine(llama_dir, max_batch=4, max_width=256)
    assert waves(engine) == eager
    graphs = engine.compiled_decode
    assert graphs is not None, "a step failed and the engine fell back to eager"
    widths = {width for _, width in graphs.graphs}
    assert {1, 2, 4} <= {rows for rows, _ in graphs.graphs}
    assert {64, 128, 256} <= widths


def test_batches_and_contexts_beyond_the_graphs_run_directly(llama_dir):
    """Six rows against graphs of at most 4, widths past a cap of 100: unpadded steps."""
    eager = waves(make_engine(llama_dir, dtype="float64", cuda_graph=False))
    engine = graph_engine(llama_dir, max_batch=4, max_width=100)
    assert waves(engine) == eager
    assert engine.compiled_decode is not None
    assert max(width for _, width in engine.compiled_decode.graphs) == 100


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a CUDA device")
def test_the_engine_captures_decode_graphs_on_cuda_by_default(llama_dir, caplog):
    eager = waves(make_engine(llama_dir, dtype="float64", cuda_graph=False))
    with caplog.at_level(logging.INFO, logger="radixserve.engine"):
        engine = make_engine(llama_dir, dtype="float64", max_running_requests=6)
    assert isinstance(engine.compiled_decode, CudaGraphDecode), caplog.text
    assert "captured" in caplog.text
    assert waves(engine) == eager
    assert isinstance(engine.compiled_decode, CudaGraphDecode)
    assert torch.cuda.is_available()
