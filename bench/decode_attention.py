"""Which decode attention path is faster: SDPA or an explicit matmul-softmax?

One-token queries over a batch of contexts, SmolLM2-135M's head shape (9 query heads, 3 KV
heads, head dim 64), float32 and bfloat16, both paths measured in the same run; the ratio is
SDPA time over matmul time. `TorchAttention(decode="auto")` picks by the dtype from this.

    python bench/decode_attention.py [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from radixserve.model.attention import AttentionMetadata, TorchAttention


def measure(backend, q, k_pool, v_pool, meta, reps: int = 30) -> float:
    for _ in range(3):
        backend.forward(q, k_pool, v_pool, meta)
    if q.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        backend.forward(q, k_pool, v_pool, meta)
    if q.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, dim = 9, 3, 64
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context in ((1, 512), (8, 1024), (32, 1024)):
            slots = batch * context + 1
            k_pool = torch.randn(slots, kv_heads, dim, dtype=dtype, device=args.device)
            v_pool = torch.randn_like(k_pool)
            q = torch.randn(batch, heads, dim, dtype=dtype, device=args.device)
            table = torch.arange(1, slots, device=args.device).view(batch, context)
            meta = AttentionMetadata(
                is_decode=True,
                new_slots=table[:, -1],
                sample_indices=torch.arange(batch),
                starts=list(range(batch)),
                new_lens=[1] * batch,
                prefix_lens=[context - 1] * batch,
                context_slots=[],
                decode_slots=table,
                decode_mask=torch.ones(batch, context, dtype=torch.bool, device=args.device),
            )
            with torch.inference_mode():
                sdpa = measure(TorchAttention("sdpa"), q, k_pool, v_pool, meta)
                matmul = measure(TorchAttention("matmul"), q, k_pool, v_pool, meta)
            print(
                f"{dtype!s:15s} batch {batch:>2} context {context:>5}: sdpa {sdpa * 1e3:7.3f} ms"
                f"  matmul {matmul * 1e3:7.3f} ms  sdpa/matmul {sdpa / matmul:5.2f}"
            )


if __name__ == "__main__":
    main()
