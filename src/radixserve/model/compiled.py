"""Decode steps as one compiled graph (`EngineConfig.compile`, `--compile`).

Eager PyTorch runs a small-batch decode step as about a thousand small operators, each a few
microseconds of dispatch (docs/cpu-decode.md). `torch.compile` over the whole of
`LlamaForCausalLM.decode_step` fuses the norms, rotary embedding, softmax and activations
into a few generated loops around the weight matmuls. Attention over the gathered context is
written as broadcasts and sums for batches of two or more, which inductor fuses with the
gather, and as matmuls for one request, whose fused loops would run on one thread
(`radixserve.model.attention.single_query_attention`).

The step writes nothing inside the graph: the new keys and values come out and are stored by
one `index_copy_`, so the graph never copies the pool (an in-graph write to a view of the pool
is turned into a copy of all of it).

Only pure decode batches go through the graph; prefill, mixed and multi-token batches stay
eager. Graphs are made per batch-size class (1, then a dynamic size per linear-layer path), and
the context width is padded to a multiple of `WIDTH_STEP` so that widths share one graph.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from radixserve.model.kv import KVPool
from radixserve.model.llama import LlamaForCausalLM

WIDTH_STEP = 32


class CompiledDecode:
    """Runs decode batches through `torch.compile(model.decode_step)`.

    Guarantees: the logits are the eager forward's up to float rounding, and the new K/V are
    stored at the requests' new slots. A call that raises leaves the KV pool untouched, so the
    caller can run the step eagerly instead.
    """

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, device: torch.device) -> None:
        self.kv, self.device = kv, device
        # Only the batch and context-width dimensions vary; the pool and weights stay static.
        # The generated code's stride checks cost about 1 ms a step at batch 1 (1,200 calls).
        self._graph = torch.compile(
            model.decode_step, dynamic=False, options={"size_asserts": False}
        )
        self.aot = None  # an AOTDecode for batch 1 (`radixserve.model.aot`), when built

    @property
    def step(self):
        """The compiled `decode_step` (CUDA graphs capture it on CUDA)."""
        return self._graph

    def __call__(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        context: list[np.ndarray],
        new_slots: np.ndarray,
    ) -> torch.Tensor:
        """Logits [B, vocab] of one decode step; `context[b]` holds request b's prefix slots.
        Arrays are on the host (tensors anywhere are taken too)."""
        ids, pos, slots = (
            torch.as_tensor(a, device=self.device) for a in (input_ids, positions, new_slots)
        )
        logits, k, v = self._run(ids, pos, context)
        self.kv.write_all_layers(slots, k, v)
        return logits

    def warm_up(self, batch_sizes: tuple[int, ...], before=None) -> float:
        """Compile the graphs these batch sizes need, on dummy inputs that write nothing,
        calling `before(rows)` first for each; returns the seconds it took. Raises what the
        compiler raises."""
        start = time.perf_counter()
        for rows in batch_sizes:
            if rows == 1 and self.aot is not None:
                continue
            if before is not None:
                before(rows)
            ids = torch.zeros(rows, dtype=torch.long, device=self.device)
            self._run(ids, ids + 1, [np.zeros(1, dtype=np.int64)] * rows)
        return time.perf_counter() - start

    def _run(self, input_ids, positions, context):
        table, mask = context_table(context)
        table = torch.from_numpy(table).to(self.device)
        mask = torch.from_numpy(mask).to(self.device)
        mark_dynamic_inputs(input_ids, positions, table, mask)
        self.kv.wait_all()  # pages a tier loaded: the graph reads every layer
        aot = self.aot
        use_aot = aot is not None and len(context) == 1 and table.shape[1] <= aot.max_width
        graph = aot if use_aot else self._graph
        with torch.no_grad():
            return graph(input_ids, positions, table, mask, self.kv.k, self.kv.v)


def mark_dynamic_inputs(input_ids, positions, table, mask) -> None:
    """Let one graph serve every batch size and context width of its class."""
    for tensor in (input_ids, positions, table, mask):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for tensor in (table, mask):
        torch._dynamo.maybe_mark_dynamic(tensor, 1)


def context_table(context: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of prefix slots padded with slot 0 to a width that is a multiple of WIDTH_STEP,
    and the mask of the real entries."""
    lengths = np.fromiter((len(c) for c in context), dtype=np.int64, count=len(context))
    width = max(WIDTH_STEP, -(-int(lengths.max()) // WIDTH_STEP) * WIDTH_STEP)
    table = np.zeros((len(context), width), dtype=np.int64)
    for row, slots in enumerate(context):
        table[row, : len(slots)] = slots
    mask = np.arange(width)[None, :] < lengths[:, None]
    return table, mask


def warm_up_batch_sizes(model: LlamaForCausalLM, max_running: int) -> tuple[int, ...]:
    """One batch size per graph the engine can meet: 1, 2, and the first size at which packed
    linear layers switch to their dense copy."""
    sizes = {1, 2}
    sizes |= {m.dense_from_rows for m in model.modules() if getattr(m, "dense_from_rows", 0)}
    return tuple(sorted(s for s in sizes if s <= max_running))
