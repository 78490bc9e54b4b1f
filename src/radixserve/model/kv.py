"""The KV pool: K and V tensors of shape [num_layers, num_slots, kv_heads, head_dim].

Rows are KV slots handed out by `radixserve.cache` allocators; slot 0 is the padding slot,
which padded reads may touch and nothing else writes meaningfully.
"""

from __future__ import annotations

import numpy as np
import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_slots, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.dtype = dtype

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of new tokens at `slots` (one slot per token)."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def write_all_layers(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store every layer's K/V [num_layers, len(slots), kv_heads, head_dim] at `slots`."""
        self.k.index_copy_(1, slots, k)
        self.v.index_copy_(1, slots, v)

    def export(self, slots, dtype: torch.dtype | None = None) -> bytes:
        """Every layer's K and V at `slots`, as bytes, in `dtype` (default the pool's own;
        a smaller one rounds). `load` takes them back."""
        index = _index(slots, self.k.device)
        kv = torch.stack([self.k.index_select(1, index), self.v.index_select(1, index)])
        kv = kv.to(dtype or self.dtype).cpu().contiguous()
        return kv.view(torch.uint8).numpy().tobytes()

    def load(self, slots, payload: bytes, dtype: torch.dtype | None = None) -> None:
        """Write what `export(slots, dtype)` returned for as many slots into `slots`."""
        index = _index(slots, self.k.device)
        layers, _, heads, dim = self.k.shape
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype or self.dtype)
        kv = flat.view(2, layers, len(index), heads, dim).to(self.k.device, self.dtype)
        self.k.index_copy_(1, index, kv[0])
        self.v.index_copy_(1, index, kv[1])

    def page_bytes(self, tokens: int, dtype: torch.dtype | None = None) -> int:
        """Bytes `export` makes of `tokens` slots."""
        layers, _, heads, dim = self.k.shape
        size = (dtype or self.dtype).itemsize
        return 2 * layers * tokens * heads * dim * size

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class CastingCopier:
    """A `KVPool`'s pages exported and loaded in another dtype (a host tier in bfloat16)."""

    def __init__(self, pool: KVPool, dtype: torch.dtype) -> None:
        self.pool, self.dtype = pool, dtype

    def export(self, slots) -> bytes:
        return self.pool.export(slots, self.dtype)

    def load(self, slots, payload: bytes) -> None:
        self.pool.load(slots, payload, self.dtype)


def _index(slots, device) -> torch.Tensor:
    return torch.from_numpy(np.array(slots, dtype=np.int64)).to(device)
