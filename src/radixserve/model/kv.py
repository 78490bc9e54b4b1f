"""The KV pool: K and V tensors of shape [num_layers, num_slots, kv_heads, head_dim].

Rows are KV slots handed out by `radixserve.cache` allocators; slot 0 is the padding slot,
which padded reads may touch and nothing else writes meaningfully.

Pages loaded from a host or storage tier (`load`) are copied in on CUDA by a copy stream of
their own, one layer after another, and the forward waits for a layer's copies only when it
reaches that layer (`wait_layer`), so the first layers compute while the last still load. On
CPU a load is a plain copy and the waits do nothing.
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
        on_cuda = self.k.device.type == "cuda"
        self.copier = LayerwiseCopier(num_layers, self.k.device) if on_cuda else None
        """Loads on a copy stream (CUDA only; None: loads are plain copies)."""

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait for the loads into `layer` issued so far (before the
        forward reads that layer)."""
        if self.copier is not None:
            self.copier.wait(layer)

    def wait_all(self) -> None:
        """Make the current stream wait for every load issued so far."""
        if self.copier is not None:
            self.copier.wait_all()

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
        self.wait_all()  # a page still loading is read after its copy
        index = _index(slots, self.k.device)
        kv = torch.stack([self.k.index_select(1, index), self.v.index_select(1, index)])
        kv = kv.to(dtype or self.dtype).cpu().contiguous()
        return kv.view(torch.uint8).numpy().tobytes()

    def load(self, slots, payload: bytes, dtype: torch.dtype | None = None) -> None:
        """Write what `export(slots, dtype)` returned for as many slots into `slots`."""
        layers, _, heads, dim = self.k.shape
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype or self.dtype)
        kv = flat.view(2, layers, len(slots), heads, dim)
        if self.copier is not None:
            self.copier.load(self.k, self.v, np.asarray(slots, dtype=np.int64), kv)
            return
        index = _index(slots, self.k.device)
        kv = kv.to(self.k.device, self.dtype)
        self.k.index_copy_(1, index, kv[0])
        self.v.index_copy_(1, index, kv[1])

    def page_bytes(self, tokens: int, dtype: torch.dtype | None = None) -> int:
        """Bytes `export` makes of `tokens` slots."""
        layers, _, heads, dim = self.k.shape
        size = (dtype or self.dtype).itemsize
        return 2 * layers * tokens * heads * dim * size

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class LayerwiseCopier:
    """Host-to-device KV loads on a copy stream, with one event per layer.

    `load` queues, layer by layer, the copy of pinned host pages into the pool and records
    the layer's event after it; `wait(layer)` makes the compute stream wait on that event
    (once per load: a layer already waited for costs nothing). The copy stream first waits
    for the compute stream's work so far, since the slots a load fills may have been read or
    written by requests that held them before. Host buffers stay referenced until the copies
    that read them are done. `cuda` is the `torch.cuda` module (a test may pass a stand-in).
    """

    def __init__(self, num_layers: int, device: torch.device, cuda=None) -> None:
        self.cuda = cuda or torch.cuda
        self.device = device
        self.stream = self.cuda.Stream(device)
        self.events = [self.cuda.Event() for _ in range(num_layers)]
        self.pending = [False] * num_layers
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # (done event, host buffer)
        self.loads = 0

    def load(self, k: torch.Tensor, v: torch.Tensor, slots: np.ndarray, kv: torch.Tensor) -> None:
        """Queue the copy of `kv` ([2, layers, n, heads, dim] on the host) into `slots`."""
        self._release()
        host = kv.transpose(0, 1).contiguous()  # [layers, 2, ...]: each layer's part in one piece
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.stream.wait_stream(self.cuda.current_stream(self.device))
        with self.cuda.stream(self.stream):
            index = torch.from_numpy(slots).to(self.device, non_blocking=True)
            for layer, event in enumerate(self.events):
                part = host[layer].to(self.device, non_blocking=True).to(k.dtype)
                k[layer].index_copy_(0, index, part[0])
                v[layer].index_copy_(0, index, part[1])
                event.record(self.stream)
                self.pending[layer] = True
            done = self.cuda.Event()
            done.record(self.stream)
        self._in_flight.append((done, host))
        self.loads += 1

    def wait(self, layer: int) -> None:
        if self.pending[layer]:
            self.cuda.current_stream(self.device).wait_event(self.events[layer])
            self.pending[layer] = False

    def wait_all(self) -> None:
        for layer in range(len(self.events)):
            self.wait(layer)
        self._release()

    def _release(self) -> None:
        """Drop the host buffers whose copies are done."""
        self._in_flight = [(done, buf) for done, buf in self._in_flight if not done.query()]


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
