"""Decode steps replayed from CUDA graphs (`EngineConfig.cuda_graph`, on by default on CUDA).

A decode step of a small model on a GPU is bound by launching its kernels, not by running
them: the embedded model's eager step is about a thousand kernels. A CUDA graph launches the
whole step at once. Graphs have fixed shapes, so a step is padded to a batch bucket and a
context-width bucket, and one graph is captured per pair on first use.

Padded rows decode token 0 at position 0 with an empty context (the new key alone), and
their outputs are dropped; padded context entries are masked. The step reads its inputs from
one buffer per graph, filled by one host-to-device copy: the token ids, the context lengths
(which are also the positions) and the slot table, with the mask derived in the graph.

All graphs share one memory pool. That is safe because the outputs of a replay (logits, new
keys and values) are consumed before the next replay of any graph: the logits are copied out
and the keys and values stored in the pool.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable

import numpy as np
import torch

from radixserve.model.compiled import context_table, mark_dynamic_inputs
from radixserve.model.kv import KVPool

MIN_WIDTH = 64
MAX_WIDTH = 4096
"""Wider contexts run the step without a graph: their attention, not the launches, dominates,
and a graph padded to that width would hold its gathered keys for every padded row."""


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 32, ending at `max_batch`."""
    sizes = [1, 2, 4, 8]
    sizes += list(range(16, 65, 8)) + list(range(96, max_batch + 32, 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def width_bucket(width: int, max_width: int) -> int:
    """The power of two (at least MIN_WIDTH) that holds `width`, capped at `max_width`
    (which must hold `width`)."""
    return min(max(MIN_WIDTH, 1 << max(0, width - 1).bit_length()), max_width)


class _Graph:
    """One captured step of fixed batch and width, with its input buffer and outputs."""

    def __init__(self, rows: int, width: int, buffer: torch.Tensor, run: Callable) -> None:
        self.rows, self.width, self.buffer = rows, width, buffer
        self.run = run  # replays the graph (or, uncaptured, runs the step) and returns outputs
        self.host = torch.zeros(buffer.shape, dtype=torch.long, pin_memory=buffer.is_cuda)


class CudaGraphDecode:
    """Runs decode batches through captured CUDA graphs of `step` (the model's `decode_step`,
    or a compiled version of it).

    Guarantees: the same call and results as `CompiledDecode`: logits [B, vocab] equal to the
    eager step's (same kernels, padded shapes), and the new K/V stored at `new_slots`. A batch
    larger than `max_batch` runs the step directly, unpadded. A call that raises leaves the KV
    pool untouched. `capture=False` runs the padded step without graphs (the CPU tests check
    the padding that way).
    """

    def __init__(
        self,
        step: Callable,
        kv: KVPool,
        device: torch.device,
        max_batch: int,
        max_width: int,
        capture: bool = True,
    ) -> None:
        self.step, self.kv, self.device = step, kv, device
        self.max_width, self.capture = max(max_width, MIN_WIDTH), capture
        self.buckets = batch_buckets(max_batch)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.capture_seconds = 0.0
        self._pool = None
        self._positions = torch.arange(self.max_width, device=device)

    def __call__(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        context: list[np.ndarray],
        new_slots: np.ndarray,
    ) -> torch.Tensor:
        """Logits [B, vocab] of one decode step; `context[b]` holds request b's prefix slots,
        so `positions[b] == len(context[b])`. Arrays are on the host."""
        rows = len(context)
        lengths = np.fromiter((len(c) for c in context), dtype=np.int64, count=rows)
        width = int(lengths.max())
        self.kv.wait_all()  # pages a tier loaded: the graph reads every layer
        if rows > self.buckets[-1] or width > self.max_width:
            logits, k, v = self._direct(input_ids, context, lengths)
        else:
            bucket = (
                self.buckets[bisect_left(self.buckets, rows)],
                width_bucket(width, self.max_width),
            )
            graph = self.graphs.get(bucket) or self._build(*bucket)
            logits, k, v = self._replay(graph, input_ids, context, lengths)
        slots = torch.as_tensor(new_slots, device=self.device)
        self.kv.write_all_layers(slots, k[:, :rows], v[:, :rows])
        return logits[:rows].clone()

    def warm_up(self, widths: tuple[int, ...] = (MIN_WIDTH,)) -> float:
        """Capture every batch bucket at these widths; returns the seconds it took."""
        start = time.perf_counter()
        for width in widths:
            for rows in self.buckets:
                if (rows, width) not in self.graphs:
                    self._build(rows, width)
        return time.perf_counter() - start

    def verify(self, vocab_size: int) -> None:
        """Raise `RuntimeError` unless the smallest and largest batch graphs, each replayed on
        two different inputs, give the unpadded step's logits and first-layer keys within
        bfloat16 rounding (a graph that ignored its input buffer would give the first answer
        twice). Writes nothing to the KV pool."""
        rng = np.random.default_rng(0)
        for rows in sorted({self.buckets[0], self.buckets[-1]}):
            graph = self.graphs.get((rows, MIN_WIDTH)) or self._build(rows, MIN_WIDTH)
            for _ in range(2):
                ids = rng.integers(0, vocab_size, rows)
                lengths = rng.integers(0, MIN_WIDTH, rows)
                context = [np.zeros(n, dtype=np.int64) for n in lengths]
                logits, k, _ = self._replay(graph, ids, context, lengths)
                want, want_k, _ = self._direct(ids, context, lengths)
                errors = (
                    _relative_error(logits[:rows], want),
                    _relative_error(k[0, :rows], want_k[0]),
                )
                if max(errors) > 0.05:
                    raise RuntimeError(
                        f"the graph of {rows} rows disagrees with the eager step "
                        f"(relative errors {errors[0]:.3g} in logits, {errors[1]:.3g} in keys)"
                    )

    def _replay(self, graph: _Graph, input_ids, context, lengths):
        rows, host = len(context), graph.host.numpy()
        host[:] = 0
        host[:rows] = input_ids
        host[graph.rows : graph.rows + rows] = lengths
        table = host[2 * graph.rows :].reshape(graph.rows, graph.width)
        for row, slots in enumerate(context):
            table[row, : len(slots)] = slots
        graph.buffer.copy_(graph.host)
        return graph.run()

    def _direct(self, input_ids, context, lengths):
        dev = self.device
        table, mask = (torch.from_numpy(a).to(dev) for a in context_table(context))
        ids, lens = (torch.as_tensor(a, device=dev) for a in (input_ids, lengths))
        with torch.no_grad():
            return self.step(ids, lens, table, mask, self.kv.k, self.kv.v)

    def _build(self, rows: int, width: int) -> _Graph:
        start = time.perf_counter()
        buffer = torch.zeros(2 * rows + rows * width, dtype=torch.long, device=self.device)
        arange = self._positions[:width]

        def step():
            ids, lens = buffer[:rows], buffer[rows : 2 * rows]
            table = buffer[2 * rows :].view(rows, width)
            mask = arange[None, :] < lens[:, None]
            mark_dynamic_inputs(ids, lens, table, mask)  # a compiled step: one graph for all
            with torch.no_grad():
                return self.step(ids, lens, table, mask, self.kv.k, self.kv.v)

        if not self.capture:
            graph = _Graph(rows, width, buffer, step)
        else:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # allocator, library handles and any compilation
                    step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            cuda_graph = torch.cuda.CUDAGraph()
            # thread_local: a tier's copy thread may touch CUDA while this thread captures
            with torch.cuda.graph(cuda_graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = step()
            if self._pool is None:
                self._pool = cuda_graph.pool()

            def replay():
                cuda_graph.replay()
                return outputs

            graph = _Graph(rows, width, buffer, replay)
        self.graphs[rows, width] = graph
        self.capture_seconds += time.perf_counter() - start
        return graph


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))
