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
    describe the queries before them.
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


class AttentionBackend(Protocol):
    name: str

    def forward(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Attention output [T, heads, head_dim] for queries q [T, heads, head_dim]."""
        ...


class TorchAttention:
    """torch attention: SDPA for prefill; SDPA or an explicit matmul-softmax for decode.

    `decode="matmul"` computes scores with two batched matmuls and a softmax, which measures
    faster than SDPA for one-token queries in bfloat16 on CPU; `"sdpa"` uses SDPA for both.
    """

    def __init__(self, decode: str = "auto", decode_rows: int = 16) -> None:
        if decode not in ("auto", "sdpa", "matmul"):
            raise InvalidArgumentError(f"decode attention must be auto, sdpa or matmul: {decode!r}")
        self.decode = decode
        self.decode_rows = decode_rows
        self.name = f"torch-{decode}"
        self.compiled_rows = None  # pooled_decode_attention compiled, from compile_decode

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

    def _decode(self, q, k_pool, v_pool, meta: AttentionMetadata) -> torch.Tensor:
        rows = q.shape[0]
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
    rows, heads, dim = q.shape
    kv_heads = keys.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(rows, 1, kv_heads, heads // kv_heads, dim).to(acc) * (dim**-0.5)
    scores = (qg * keys.to(acc)[:, :, :, None, :]).sum(-1)  # [B, W, Hkv, G]
    probs = torch.softmax(scores.masked_fill(~mask[:, :, None, None], float("-inf")), dim=1)
    out = (probs[..., None] * values.to(acc)[:, :, :, None, :]).sum(1)  # [B, Hkv, G, D]
    return out.reshape(rows, heads, dim).to(q.dtype)


def pooled_decode_attention(q, k_pool, v_pool, slots, mask) -> torch.Tensor:
    """`fused_attention` over the pool slots [B, W] of each row (`TorchAttention`'s compiled
    decode kernel)."""
    return fused_attention(q, k_pool[slots], v_pool[slots], mask)


BACKENDS = {"torch": TorchAttention}


def make_attention_backend(name: str = "torch", decode: str = "auto") -> AttentionBackend:
    if name not in BACKENDS:
        raise InvalidArgumentError(f"attention backend must be one of {sorted(BACKENDS)}: {name!r}")
    return BACKENDS[name](decode=decode)
