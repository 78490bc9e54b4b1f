"""Attention over the paged KV pool, behind a small backend interface.

A backend gets the new tokens' queries [T, heads, head_dim] (T = all new tokens of the batch,
request after request), the layer's K/V pool tensors, and `AttentionMetadata` saying which
slots each request attends over. New K/V are already written when it runs. Backends here are
plain torch and run on CPU and CUDA; a FlashInfer or FlashAttention backend implements the
same `forward`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.nn import functional as F

from radixserve.errors import InvalidArgumentError

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Where each request's tokens and context live.

    Extend: request i owns queries [starts[i], starts[i] + new_lens[i]) and attends over slots
    `context_slots[i]` (its prefix, then its new tokens), causally. Decode: every request has
    one query; `decode_slots` is [B, max_context] padded with slot 0 and `decode_mask` marks
    the real entries. Mixed (an extend batch with `decode_rows` > 0): the last `decode_rows`
    queries are decodes described by `decode_slots` and `decode_mask`; the extend fields
    describe the queries before them. `cascade`, when set, groups the decode rows by the
    prefix they share, for `cascade_attention`.
    """

    is_decode: bool
    new_slots: torch.Tensor
    sample_indices: torch.Tensor
    starts: list[int]
    new_lens: list[int]
    prefix_lens: list[int]
    context_slots: list[torch.Tensor]
    decode_slots: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_rows: int = 0
    cascade: CascadePlan | None = None
    packed: PackedExtend | None = None  # set by the first layer that packs the extend part


@dataclass
class PackedExtend:
    """The extend requests of a batch packed for a variable-length kernel: request i's queries
    are rows [cu_q[i], cu_q[i + 1]) of the extend queries, its context (prefix, then new
    tokens) the pool slots `slots[cu_k[i] : cu_k[i + 1]]`."""

    slots: torch.Tensor
    cu_q: torch.Tensor  # int32 [N + 1]
    cu_k: torch.Tensor  # int32 [N + 1]
    max_q: int
    max_k: int

    @classmethod
    def of(cls, meta: AttentionMetadata) -> PackedExtend:
        """Pack `meta`'s extend requests; their queries must lie back to back from row 0."""
        lens = meta.new_lens
        expected = np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist()
        if list(meta.starts) != expected:
            raise InvalidArgumentError("packed extend needs queries back to back from row 0")
        context = [p + n for p, n in zip(meta.prefix_lens, lens, strict=True)]
        cu = np.zeros((2, len(lens) + 1), dtype=np.int32)
        cu[0, 1:] = np.cumsum(lens)
        cu[1, 1:] = np.cumsum(context)
        dev = meta.context_slots[0].device
        cu_t = torch.from_numpy(cu).to(dev)
        return cls(torch.cat(meta.context_slots), cu_t[0], cu_t[1], max(lens), max(context))


@dataclass
class CascadePlan:
    """Decode rows grouped by a shared prefix of slots, for `cascade_attention`.

    Group g's prefix is `prefix_slots[g]` where `prefix_mask[g]`; its rows are `members[g]`
    (padded with the row count, an index past the last row). Row b's result from its group
    is at `row_pos[b]` of the groups' rows flattened (g * R + j), or at G * R when it is in no
    group. `own_slots[b]` where `own_mask[b]` is the rest of row b's context: everything after
    its group's prefix (its whole context when it is in no group), never empty.
    """

    prefix_slots: torch.Tensor
    prefix_mask: torch.Tensor
    members: torch.Tensor
    row_pos: torch.Tensor
    own_slots: torch.Tensor
    own_mask: torch.Tensor
    repeated: int = 0  # prefix slots the rows would read again without it, per layer

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.prefix_slots,
            self.prefix_mask,
            self.members,
            self.row_pos,
            self.own_slots,
            self.own_mask,
        )


# A shared prefix shorter than this is attended per row: the grouped matmul gains little there.
CASCADE_MIN_PREFIX = 64


def plan_cascade(
    table: np.ndarray, lengths: np.ndarray, min_prefix: int = CASCADE_MIN_PREFIX
) -> CascadePlan | None:
    """Group the decode rows of slot table [B, W] (row b's context is table[b, :lengths[b]])
    whose contexts start with the same `min_prefix` or more slots; None when no two rows do.

    Rows starting with the same slot but sharing fewer than `min_prefix` slots with a group
    stay out of it. A group's prefix is the longest run of slots all its rows start with, so a
    row's own part keeps at least its newest slot (rows never share their new token's slot).
    """
    rows = len(lengths)
    if rows < 2:
        return None
    lengths = np.asarray(lengths)
    order = np.argsort(table[:, 0], kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(table[order, 0]) != 0])
    groups: list[tuple[np.ndarray, int]] = []
    for candidates in np.split(order, starts[1:]):
        # Rows with the same first slot: the first row's partners are those that share
        # `min_prefix` slots with it; the others try again among themselves.
        while len(candidates) >= 2:
            width = int(lengths[candidates[0]])
            same = table[candidates, :width] == table[candidates[0], :width]
            same &= np.arange(width)[None, :] < lengths[candidates][:, None]
            common = np.where(same.all(1), width, same.argmin(1))
            near = common >= min_prefix
            if near.sum() >= 2:
                groups.append((candidates[near], int(common[near].min())))
            near[0] = True
            candidates = candidates[~near]
    if not groups:
        return None
    # At least two groups and two own columns: the compiled kernel then never meets a size of
    # one, which it would specialize on and compile again for. A padding group has one slot and
    # no rows.
    count, size = max(2, len(groups)), max(len(m) for m, _ in groups)
    longest = max(shared for _, shared in groups)
    prefix_slots = np.zeros((count, longest), dtype=np.int64)
    prefix_mask = np.zeros((count, longest), dtype=bool)
    members_table = np.full((count, size), rows, dtype=np.int64)
    row_pos = np.full(rows, count * size, dtype=np.int64)
    own_start = np.zeros(rows, dtype=np.int64)
    prefix_mask[:, 0] = True
    for g, (members, shared) in enumerate(groups):
        prefix_slots[g, :shared] = table[members[0], :shared]
        prefix_mask[g, :shared] = True
        members_table[g, : len(members)] = members
        row_pos[members] = g * size + np.arange(len(members))
        own_start[members] = shared
    own_lens = lengths - own_start
    width = max(2, int(own_lens.max()))
    cols = own_start[:, None] + np.arange(width)[None, :]
    own_mask = np.arange(width)[None, :] < own_lens[:, None]
    own_slots = np.where(
        own_mask, np.take_along_axis(table, np.minimum(cols, table.shape[1] - 1), 1), 0
    )
    as_tensor = torch.from_numpy
    return CascadePlan(
        as_tensor(prefix_slots),
        as_tensor(prefix_mask),
        as_tensor(members_table),
        as_tensor(row_pos),
        as_tensor(own_slots),
        as_tensor(own_mask),
        sum((len(members) - 1) * shared for members, shared in groups),
    )


class AttentionBackend(Protocol):
    name: str

    def forward(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention output [T, heads, head_dim] for queries q [T, heads, head_dim]."""
        ...


class TorchAttention:
    """torch attention: SDPA for prefill (FlashAttention's variable-length kernel over the
    whole batch on CUDA in half precision); SDPA or an explicit matmul-softmax for decode.

    `decode="matmul"` computes scores with two batched matmuls and a softmax, which measures
    faster than SDPA for one-token queries in bfloat16 on CPU; `"sdpa"` uses SDPA for both.
    """

    def __init__(self, decode: str = "auto", decode_rows: int = 16) -> None:
        if decode not in ("auto", "sdpa", "matmul"):
            raise InvalidArgumentError(f"decode attention must be auto, sdpa or matmul: {decode!r}")
        self.decode = decode
        self.decode_rows = decode_rows
        self.name = f"torch-{decode}"
        self.supports_cascade = True  # AttentionMetadata.cascade is honoured
        self.compiled_rows = None  # pooled_decode_attention compiled, from compile_decode
        self.compiled_cascade = None  # cascade_attention compiled, from compile_decode
        # Prefill on CUDA in half precision: one FlashAttention call over every request of the
        # batch (packed, variable length) instead of one SDPA call per request.
        self.varlen = True

    def compile_decode(self, k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int) -> float:
        """Run the decode rows of eager batches (mixed chunks) of two or more requests through
        `pooled_decode_attention` compiled by inductor, CPU only. Compiles it for `heads` query
        heads on layer pools like these; returns the seconds it took. Raises what the compiler
        raises, leaving eager decode in place. (32 requests over 512-token shared prompts
        arriving at 8 req/s, in process: 4.8-5.5 s against 5.3-6.5 s eager.)"""
        start = time.perf_counter()
        kernel = torch.compile(pooled_decode_attention, dynamic=False)
        dev = k_pool.device
        # Only the rows and the width vary, at sizes unlike any other dimension here (so that
        # no equality between them is assumed). The slot table and mask are built outside
        # inference mode and q inside it, as in the forward: the guards check that too.
        for width in (5, 6):
            slots = torch.zeros(2, width, dtype=torch.long, device=dev)
            mask = torch.ones_like(slots, dtype=torch.bool)
            for tensor in (slots, mask):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
            with torch.inference_mode():
                q = k_pool.new_zeros(2, heads, k_pool.shape[2])
                torch._dynamo.maybe_mark_dynamic(q, 0)
                kernel(q, k_pool, v_pool, slots, mask)
        self.compiled_rows = kernel
        self.compiled_cascade = _compile_cascade(k_pool, v_pool, heads)
        return time.perf_counter() - start

    def forward(self, q, k_pool, v_pool, meta: AttentionMetadata) -> torch.Tensor:
        if meta.is_decode:
            return self._decode(q, k_pool, v_pool, meta)
        if meta.decode_rows:
            split = q.shape[0] - meta.decode_rows
            extend = self._extend(q[:split], k_pool, v_pool, meta)
            return torch.cat([extend, self._decode(q[split:], k_pool, v_pool, meta)])
        return self._extend(q, k_pool, v_pool, meta)

    def _extend(self, q, k_pool, v_pool, meta: AttentionMetadata) -> torch.Tensor:
        if self.varlen and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            try:
                return self._extend_varlen(q, k_pool, v_pool, meta)
            except Exception as exc:  # the per-request loop below computes the same
                log.warning("variable-length prefill failed, attending per request: %s", exc)
                self.varlen = False
        # 4-D inputs and enable_gqa keep SDPA on its fused kernels (3-D falls back to the
        # math path on CPU, measured 5x slower for a 1,024-token chunk).
        outs = []
        for start, n, prefix, slots in zip(
            meta.starts, meta.new_lens, meta.prefix_lens, meta.context_slots, strict=True
        ):
            qi = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
            ki = k_pool[slots].transpose(0, 1)[None]  # [1, Hkv, L, D]
            vi = v_pool[slots].transpose(0, 1)[None]
            if prefix == 0:
                out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:
                rows = torch.arange(n, device=q.device)[:, None] + prefix
                mask = torch.arange(prefix + n, device=q.device)[None, :] <= rows
                out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _extend_varlen(self, q, k_pool, v_pool, meta: AttentionMetadata) -> torch.Tensor:
        if meta.packed is None:
            meta.packed = PackedExtend.of(meta)
        packed = meta.packed
        # FlashAttention's causal mask is aligned to the bottom right when a request has
        # more keys than queries: query j of n sees its prefix and new tokens 0..j.
        out = torch.ops.aten._flash_attention_forward(
            q.contiguous(),
            k_pool[packed.slots],
            v_pool[packed.slots],
            packed.cu_q,
            packed.cu_k,
            packed.max_q,
            packed.max_k,
            0.0,
            True,
            False,
        )
        return out[0]

    def _decode(self, q, k_pool, v_pool, meta: AttentionMetadata) -> torch.Tensor:
        rows = q.shape[0]
        if meta.cascade is not None:
            plan = meta.cascade.tensors()
            if self.compiled_cascade is not None:
                try:
                    return self.compiled_cascade(q.contiguous(), k_pool, v_pool, *plan)
                except Exception as exc:  # the eager form computes the same
                    log.warning("compiled cascade attention failed, attending eagerly: %s", exc)
                    self.compiled_cascade = None
            return cascade_attention(q, k_pool, v_pool, *plan, eager=True)
        if self.compiled_rows is not None and rows > 1:
            try:
                slots, mask = meta.decode_slots, meta.decode_mask
                return self.compiled_rows(q.contiguous(), k_pool, v_pool, slots, mask)
            except Exception as exc:  # the eager form below computes the same
                log.warning("compiled decode attention failed, attending eagerly: %s", exc)
                self.compiled_rows = None
        if rows <= self.decode_rows:
            return self._decode_rows(q, k_pool, v_pool, meta.decode_slots, meta.decode_mask)
        # Gathering every request's context at once falls off a cliff on CPU past about 32
        # requests of 1k tokens (3.5x slower per request at 64); slices of 16 stay fast.
        return torch.cat(
            [
                self._decode_rows(
                    q[i : i + self.decode_rows],
                    k_pool,
                    v_pool,
                    meta.decode_slots[i : i + self.decode_rows],
                    meta.decode_mask[i : i + self.decode_rows],
                )
                for i in range(0, rows, self.decode_rows)
            ]
        )

    def _decode_rows(self, q, k_pool, v_pool, slots, valid) -> torch.Tensor:
        heads, kv_heads, dim = q.shape[1], k_pool.shape[1], q.shape[2]
        groups = heads // kv_heads
        width = int(valid.sum(dim=1).max())
        slots, valid = slots[:, :width], valid[:, :width]
        k = k_pool[slots].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        v = v_pool[slots].permute(0, 2, 1, 3)
        mask = valid[:, None, None, :]  # [B, 1, 1, L]
        impl = self.decode
        if impl == "auto":
            impl = "matmul" if q.dtype in (torch.bfloat16, torch.float16) else "sdpa"
        if impl == "sdpa":
            qb = q[:, :, None, :]  # [B, H, 1, D]
            out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)
            return out[:, :, 0, :]
        # Grouped matmul: [B, Hkv, groups, D] @ [B, Hkv, D, L] -> [B, Hkv, groups, L]
        qg = q.reshape(q.shape[0], kv_heads, groups, dim)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * (dim**-0.5)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, v).reshape(q.shape[0], heads, dim)


def _compile_cascade(k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int):
    """`cascade_attention` compiled by inductor for pools like these, warmed on plans of two
    shapes so that every size in a plan is dynamic."""
    kernel = torch.compile(cascade_attention, dynamic=False)
    dev = k_pool.device
    # Each size differs from every other within a warm-up and between the two (no equality
    # guards): groups, rows per group, prefix, rows, own width.
    for groups, size, prefix, rows, own in ((2, 3, 5, 7, 9), (3, 4, 6, 11, 10)):
        table = np.arange(rows * (prefix + own), dtype=np.int64).reshape(rows, prefix + own)
        for g in range(groups):
            table[g * size : (g + 1) * size, :prefix] = table[g * size, :prefix]
        plan = plan_cascade(table, np.full(rows, prefix + own), min_prefix=prefix)
        assert plan is not None and plan.members.shape == (groups, size)
        tensors = [t.to(dev) for t in plan.tensors()]
        for t in tensors:
            for d in range(t.dim()):
                torch._dynamo.maybe_mark_dynamic(t, d)
        with torch.inference_mode():
            q = k_pool.new_zeros(rows, heads, k_pool.shape[2])
            torch._dynamo.maybe_mark_dynamic(q, 0)
            kernel(q, k_pool, v_pool, *tensors)
    return kernel


def single_query_attention(
    q: torch.Tensor,
    k_context: torch.Tensor,
    v_context: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Attention of one query per row over its gathered context, then its own new key.

    q [B, heads, D]; k_context, v_context [B, W, kv_heads, D]; mask [B, W] marks the real
    context entries; k_new, v_new [B, kv_heads, D]. Scores, softmax and the weighted sum run in
    float32 (float64 stays float64); the output [B, heads, D] is in q's dtype.
    """
    if q.device.type == "cpu" and q.shape[0] > 1 and torch.compiler.is_compiling():
        return _broadcast_attention(q, k_context, v_context, k_new, v_new, mask)
    rows, heads, dim = q.shape
    kv_heads = k_context.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(rows, kv_heads, heads // kv_heads, dim).to(acc) * (dim**-0.5)
    keys = k_context.permute(0, 2, 3, 1).to(acc)  # [B, Hkv, D, W]
    values = v_context.permute(0, 2, 1, 3).to(acc)  # [B, Hkv, W, D]
    scores = torch.matmul(qg, keys).masked_fill(~mask[:, None, None, :], float("-inf"))
    own = (qg * k_new.to(acc)[:, :, None, :]).sum(-1, keepdim=True)  # [B, Hkv, G, 1]
    probs = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1)
    out = torch.matmul(probs[..., :-1], values) + probs[..., -1:] * v_new.to(acc)[:, :, None, :]
    return out.reshape(rows, heads, dim).to(q.dtype)


def _broadcast_attention(q, k_context, v_context, k_new, v_new, mask) -> torch.Tensor:
    """`single_query_attention` as `fused_attention` over the context and then the new key."""
    keys = torch.cat([k_context, k_new[:, None]], dim=1)
    values = torch.cat([v_context, v_new[:, None]], dim=1)
    real = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return fused_attention(q, keys, values, real)


def fused_attention(q, keys, values, mask) -> torch.Tensor:
    """Attention of one query per row, q [B, heads, D], over keys and values [B, W, Hkv, D]
    where mask [B, W] is set (each row has at least one entry); float32 math (float64 stays),
    output in q's dtype.

    Written as products and sums in the pool's own layout for inductor on the CPU: it fuses
    the gather, the conversion and both reductions into loops over contiguous rows, where the
    matmul form transposes every gathered key scalar by scalar first. Batch 32, 80-token
    contexts: 643 against 511 tok/s; batch 8, 1,000 tokens: 97-124 against 72-85
    (`bench/engine.py --parts c --compile`). Inductor splits these loops over the rows, so one
    row runs on one thread: batch 1 at 1,500 tokens measured 26 against 31-44 tok/s and keeps
    the matmul form. Eager, this form would materialize [B, W, heads, D]."""
    probs = torch.softmax(_grouped_scores(q, keys, mask), dim=1)
    out = (probs[..., None] * values.to(probs.dtype)[:, :, :, None, :]).sum(1)  # [B, Hkv, G, D]
    return out.reshape(q.shape).to(q.dtype)


def _grouped_scores(q, keys, mask) -> torch.Tensor:
    """Scaled scores [B, W, Hkv, G] of queries q [B, heads, D] (G per kv head) against keys
    [B, W, Hkv, D], -inf where mask [B, W] is unset; float32 or wider."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(rows, 1, kv_heads, heads // kv_heads, dim).to(acc) * (dim**-0.5)
    scores = (qg * keys.to(acc)[:, :, :, None, :]).sum(-1)
    return scores.masked_fill(~mask[:, :, None, None], float("-inf"))


def _partial_attention(q, keys, values, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_attention`'s output before the cast, and each row and head's log-sum-exp of
    scores."""
    scores = _grouped_scores(q, keys, mask)
    top = scores.amax(1, keepdim=True)
    weights = torch.exp(scores - top)
    total = weights.sum(1, keepdim=True)
    out = (weights[..., None] * values.to(scores.dtype)[:, :, :, None, :]).sum(1)
    out = out / total[:, 0, ..., None]
    return out.reshape(q.shape), (top + torch.log(total))[:, 0].reshape(q.shape[:2])


def _partial_flash(q, keys, values, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """`_partial_attention` by torch's CPU flash-attention kernel, for eager use, with queries
    q [N, Q, D] in kv-head-major order (Q = kv heads x queries per kv head) over keys and
    values [N, L, Hkv, D] where mask [N, L]: output [N, Q, D] (q's dtype) and each query's
    log-sum-exp of scores [N, Q] (float32 or wider). One call per part: the fused form would
    materialize [N, L, Q, D] eagerly, and matmuls with a softmax between cost 2.5x as much
    (24-32 rows over 4 shared prompts)."""
    rows, queries, dim = q.shape
    kv_heads = keys.shape[2]
    additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
    additive = additive.masked_fill(~mask, float("-inf"))[:, None, None, :]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(rows, kv_heads, queries // kv_heads, dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=additive,
    )
    return out.reshape(rows, queries, dim), lse.reshape(rows, queries)


def cascade_attention(
    q,
    k_pool,
    v_pool,
    prefix_slots,
    prefix_mask,
    members,
    row_pos,
    own_slots,
    own_mask,
    eager: bool = False,
) -> torch.Tensor:
    """One query per row, q [B, heads, D], over the pool slots `CascadePlan` describes: each
    group's shared prefix once, as one matmul for all its rows, merged by log-sum-exp with
    each row's own slots. Equals `pooled_decode_attention` over each row's whole context.

    Every row that shares a system prompt otherwise re-reads its keys: 24 rows in 4 groups
    over 512 shared and 48 own slots, compiled, bfloat16: 1.3 ms a layer against 5.0 ms. Eager
    (`eager=True`) both parts go through torch's CPU flash-attention kernel (`_partial_flash`)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_pool.shape[1]
    per = heads // kv_heads
    groups, size = members.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    padded = torch.cat([q, q.new_zeros(1, heads, dim)])[members]  # [G, R, H, D]
    qx = padded.reshape(groups, size, kv_heads, per, dim).permute(0, 2, 1, 3, 4)
    if eager:
        shared, shared_lse = _partial_flash(
            qx.reshape(groups, kv_heads * size * per, dim),
            k_pool[prefix_slots],
            v_pool[prefix_slots],
            prefix_mask,
        )
        shared = shared.to(acc)
    else:
        qx = qx.to(acc).reshape(groups, kv_heads, size * per, dim) * (dim**-0.5)
        keys = k_pool[prefix_slots].to(acc).permute(0, 2, 3, 1)  # [G, Hkv, D, P]
        values = v_pool[prefix_slots].to(acc).permute(0, 2, 1, 3)  # [G, Hkv, P, D]
        scores = (qx @ keys).masked_fill(~prefix_mask[:, None, None, :], float("-inf"))
        top = scores.amax(-1, keepdim=True)
        weights = torch.exp(scores - top)
        total = weights.sum(-1, keepdim=True)
        shared = (weights @ values) / total  # [G, Hkv, R * per, D]
        shared_lse = top + torch.log(total)
    shared = shared.reshape(groups, kv_heads, size, per, dim).permute(0, 2, 1, 3, 4)
    shared_lse = shared_lse.reshape(groups, kv_heads, size, per).permute(0, 2, 1, 3)
    shared = torch.cat([shared.reshape(groups * size, heads, dim), shared.new_zeros(1, heads, dim)])
    shared_lse = torch.cat(
        [shared_lse.reshape(groups * size, heads), shared_lse.new_full((1, heads), float("-inf"))]
    )
    shared, shared_lse = shared[row_pos], shared_lse[row_pos]
    partial = _partial_flash if eager else _partial_attention
    own, own_lse = partial(q, k_pool[own_slots], v_pool[own_slots], own_mask)
    own, own_lse = own.to(acc), own_lse.to(acc)
    top = torch.maximum(shared_lse, own_lse)  # own_lse is finite: no row's own part is empty
    a, b = torch.exp(shared_lse - top)[..., None], torch.exp(own_lse - top)[..., None]
    return ((shared * a + own * b) / (a + b)).to(q.dtype)


def pooled_decode_attention(q, k_pool, v_pool, slots, mask) -> torch.Tensor:
    """`fused_attention` over the pool slots [B, W] of each row (`TorchAttention`'s compiled
    decode kernel)."""
    return fused_attention(q, k_pool[slots], v_pool[slots], mask)


BACKENDS = {"torch": TorchAttention}


def make_attention_backend(name: str = "torch", decode: str = "auto") -> AttentionBackend:
    if name not in BACKENDS:
        raise InvalidArgumentError(f"attention backend must be one of {sorted(BACKENDS)}: {name!r}")
    return BACKENDS[name](decode=decode)
