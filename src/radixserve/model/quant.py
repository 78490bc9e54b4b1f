"""Weight formats for the linear layers, on torch's own CPU kernels.

- `float32`: weights and activations in `dtype` (float32 by default), `x @ w`;
- `bfloat16`: bfloat16 weights and activations;
- `int8`: int8 weights with one scale per output channel, `torch._weight_int8pack_mm`,
  bfloat16 activations;
- `int4`: 4-bit weights in groups of 32 inputs with a scale and a zero per group,
  `aten._weight_int4pack_mm_for_cpu`, bfloat16 activations.

int4 computes `w = (q - 8) * scale + zero` with q in 0..15. GGUF's Q4_0 (`w = d * (q - 8)`)
and Q4_1 (`w = d * q + m`, i.e. scale d and zero m + 8d) map onto it exactly, except that the
kernel takes scale and zero in the activation dtype: d and m + 8d are rounded from float16 to
bfloat16 there (relative error at most 2**-9). GGUF's Q8_0 (`w = d * q`, q an int8 in groups of
32) stays exact under int4 and int8 as `Int8GroupLinear`: q = 16 * hi + lo splits into two
4-bit halves laid side by side along the inputs, and one int4 matmul of `[x, x]` sums them;
only d rounds to bfloat16, as above. Other tensors are requantized: symmetric per channel for
int8, asymmetric min/max per group for int4. A layer whose shape the kernel
cannot take (output features not a multiple of 16, inputs not a multiple of 32) stays in
bfloat16. The int kernels are CPU-only and are fast only with bfloat16 activations.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from radixserve.errors import InvalidArgumentError

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")
INT4_GROUP = 32
_LOAD_ROWS = 4096  # rows converted at a time at load; a multiple of the int4 packer's 64
_INT4_INNER_K_TILES = 2


@dataclass
class Int4Groups:
    """A weight [N, K] as `(q - 8) * scale + zero`, q in 0..15, one scale/zero per 32 inputs."""

    q: np.ndarray  # uint8 [N, K]
    scale: np.ndarray  # float32 [N, K // 32]
    zero: np.ndarray  # float32 [N, K // 32]
    source: str = "requantized"

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The float32 weight [N, K] these groups stand for (rows start:stop of it)."""
        q = self.q[start:stop]
        n, k = q.shape
        w = q.astype(np.float32).reshape(n, k // INT4_GROUP, INT4_GROUP)
        w -= 8.0  # in place, in the order of (q - 8) * scale + zero: one float32 copy
        w *= self.scale[start:stop, :, None]
        w += self.zero[start:stop, :, None]
        return w.reshape(n, k)

    def rows(self, order: np.ndarray) -> Int4Groups:
        return Int4Groups(self.q[order], self.scale[order], self.zero[order], self.source)

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        return Int4Groups(
            np.concatenate([p.q for p in parts]),
            np.concatenate([p.scale for p in parts]),
            np.concatenate([p.zero for p in parts]),
            parts[0].source,
        )

    @classmethod
    def quantize(cls, weight: np.ndarray) -> Int4Groups:
        """Asymmetric min/max quantization of a float weight [N, K] in groups of 32."""
        n, k = weight.shape
        groups = weight.astype(np.float32).reshape(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = groups.min(-1), groups.max(-1)
        scale = (hi - lo) / 15.0
        safe = np.where(scale > 0, scale, 1.0)
        q = np.clip(np.rint((groups - lo[..., None]) / safe[..., None]), 0, 15)
        return cls(q.reshape(n, k).astype(np.uint8), scale, lo + 8.0 * scale)


@dataclass
class Int8Groups:
    """A weight [N, K] as `d * q`, q an int8, one scale d per 32 inputs: GGUF's Q8_0."""

    q: np.ndarray  # int8 [N, K]
    scale: np.ndarray  # float32 [N, K // 32]
    source: str = "Q8_0"

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The float32 weight [N, K] these groups stand for (rows start:stop of it)."""
        q = self.q[start:stop]
        n, k = q.shape
        w = q.astype(np.float32).reshape(n, k // INT4_GROUP, INT4_GROUP)
        w *= self.scale[start:stop, :, None]
        return w.reshape(n, k)

    def rows(self, order: np.ndarray) -> Int8Groups:
        return Int8Groups(self.q[order], self.scale[order], self.source)

    @staticmethod
    def cat(parts: list[Int8Groups]) -> Int8Groups:
        return Int8Groups(
            np.concatenate([p.q for p in parts]),
            np.concatenate([p.scale for p in parts]),
            parts[0].source,
        )

    def halves(self) -> Int4Groups:
        """The same weight as int4 groups over 2K inputs, for the input fed twice: the high
        halves `q >> 4` (-8..7, scale 16d, zero 0) then the low halves `q & 15` (0..15, scale
        d, zero 8d). `x @ halves.T` on `[x, x]` equals `x @ w.T` exactly in real numbers."""
        n, k = self.q.shape
        q = np.empty((n, 2 * k), dtype=np.uint8)
        q[:, :k] = (self.q >> 4) + 8  # -8..7 + 8, within int8
        q[:, k:] = self.q & 0x0F
        scale = np.concatenate([16.0 * self.scale, self.scale], axis=1)
        zero = np.concatenate([np.zeros_like(self.scale), 8.0 * self.scale], axis=1)
        return Int4Groups(q, scale, zero, source=self.source)


def gguf_q8_0_groups(data: np.ndarray) -> Int8Groups:
    """The exact groups of a Q8_0 tensor, from its raw blocks [N, blocks * 34]."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8)
    return Int8Groups(q.reshape(rows, -1), d)


def gguf_int4_groups(data: np.ndarray, kind: str) -> Int4Groups:
    """The exact groups of a Q4_0 or Q4_1 tensor, from its raw blocks [N, blocks * bytes]."""
    block = {"Q4_0": 18, "Q4_1": 20}[kind]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, block)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d
    else:
        zero = np.zeros_like(d)
    packed = blocks[..., block - 16 :]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # elements 0..15, then 16..31
    return Int4Groups(q.reshape(rows, -1), d, zero, source=kind)


# oneDNN-blocked weights by id: torch.compile cannot trace that layout, so graphs reach it
# through `radixserve::dense_linear` with the id as a tensor input (the module holds the
# weight; a layer that is freed leaves this table by itself).
_BLOCKED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_blocked_ids = itertools.count()


# Defined with `torch.library.Library` rather than `custom_op`: the latter's Python wrapper
# measured 16-26 us a call over the oneDNN matmul itself (8x576 @ 576x1536), this 5-10, on
# about 211 calls a decode step.
_LIBRARY = torch.library.Library("radixserve", "DEF")
_LIBRARY.define("dense_linear(Tensor x, Tensor weight_id, int out_features) -> Tensor")


def _dense_linear_cpu(x: torch.Tensor, weight_id: torch.Tensor, out_features: int):
    weight = _BLOCKED[int(weight_id)]
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


_LIBRARY.impl("dense_linear", _dense_linear_cpu, "CPU")


@torch.library.register_fake("radixserve::dense_linear")
def _(x, weight_id, out_features):
    return x.new_empty(x.shape[0], out_features)


def dense_linear(x: torch.Tensor, weight_id: torch.Tensor, out_features: int) -> torch.Tensor:
    """x @ w.T with w in oneDNN's blocked layout, found by `weight_id`; the same bits as the
    plain matmul."""
    return torch.ops.radixserve.dense_linear(x, weight_id, out_features)


class _PackedLinear(nn.Module):
    """A packed linear that hands batches of `dense_from_rows` rows or more to a bfloat16
    copy of its weight: the packed kernels cost time in proportion to the rows, a dense
    matmul does not (`dense_rows_threshold`).

    The dense copy is a plain [in, out] tensor (`dense_t`) or, after `pack_dense_copies`,
    oneDNN's blocked layout of it, which computes the same numbers faster, eager or compiled.
    """

    dense_t: torch.Tensor | None
    dense_blocked: torch.Tensor | None = None
    dense_from_rows: int

    def keep_dense(
        self,
        dequantize: Callable[[int, int], np.ndarray],
        dtype: torch.dtype,
        from_rows: int | None,
    ) -> None:
        """Keep the weight [out, in] that `dequantize(start, stop)` gives, rows start:stop in
        float32, densely for batches of `from_rows` rows or more. It is cast a slice of rows
        at a time: the whole float32 weight never exists at once (the embedded model's LM head
        would be 113 MB of it at load)."""
        dense = None
        if from_rows is not None:
            dense = torch.empty(self.in_features, self.out_features, dtype=dtype)
            for start in range(0, self.out_features, _LOAD_ROWS):
                rows = torch.from_numpy(dequantize(start, start + _LOAD_ROWS))
                dense[:, start : start + _LOAD_ROWS] = rows.to(dtype).t()
        self.register_buffer("dense_t", dense)
        self.dense_from_rows = from_rows or 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_blocked is not None and x.shape[0] >= self.dense_from_rows:
            y = dense_linear(x, self.blocked_id, self.out_features)
        elif self.dense_t is not None and x.shape[0] >= self.dense_from_rows:
            y = x @ self.dense_t
        else:
            y = self.packed_forward(x)
        return y if self.bias is None else y + self.bias

    def pack_dense(self, rows_hint: int) -> bool:
        """Move the dense copy into oneDNN's blocked layout; False (nothing changed) where
        there is no dense copy, or this torch build or CPU cannot block bfloat16 weights."""
        if self.dense_t is None or not onednn_blocks_bfloat16():
            return False
        weight = self.dense_t.t().contiguous()  # [out, in], as oneDNN's linear takes it
        try:
            blocked = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)
        except RuntimeError:
            return False
        key = next(_blocked_ids)
        _BLOCKED[key] = self.dense_blocked = blocked
        self.register_buffer("blocked_id", torch.tensor(key), persistent=False)
        self.dense_t = None
        return True


class Int4Linear(_PackedLinear):
    """y = x @ w.T (+ bias) with w held as int4 groups; x is [T, in_features]."""

    def __init__(
        self,
        groups: Int4Groups,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        dense_from_rows: int | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = groups.q.shape
        self.register_buffer("packed", _int4pack(groups.q))
        scales_and_zeros = np.ascontiguousarray(np.stack([groups.scale.T, groups.zero.T], axis=-1))
        self.register_buffer("scales_and_zeros", torch.from_numpy(scales_and_zeros).to(dtype))
        # The group size as a tensor: the kernel takes it so, and inductor's own lowering of
        # `_weight_int4pack_mm_for_cpu` makes it a constant that nested compiled regions
        # never load (torch 2.13).
        self.register_buffer("group_size", torch.tensor(INT4_GROUP), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.keep_dense(groups.dequantize, dtype, dense_from_rows)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.int4mm_packed_weight_cpu(
            x, self.packed, self.group_size, self.scales_and_zeros
        )

    def nbytes(self) -> int:
        return _nbytes(self.packed, self.scales_and_zeros, self.bias)


def _int4pack(q: np.ndarray, rows: int = _LOAD_ROWS) -> torch.Tensor:
    """The CPU int4 kernel's packing of q [out, in] (values 0..15). Its rows pack in blocks
    of 64, each on its own, so the int32 input the packer takes is made `rows` (a multiple of
    64) at a time: the embedded model's LM head would otherwise need a 226 MB int32 copy at
    load. `tests/model/test_quant.py` checks the bytes against one whole call."""
    return torch.cat(
        [
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.from_numpy(q[start : start + rows].astype(np.int32)), _INT4_INNER_K_TILES
            )
            for start in range(0, q.shape[0], rows)
        ]
    )


class Int8Linear(_PackedLinear):
    """y = x @ w.T (+ bias) with w as int8 and one scale per output channel."""

    def __init__(
        self,
        weight: np.ndarray,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        dense_from_rows: int | None = None,
    ) -> None:
        super().__init__()
        w = weight.astype(np.float32)
        scale = np.abs(w).max(axis=1) / 127.0
        safe = np.where(scale > 0, scale, 1.0)
        q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", torch.from_numpy(q))
        self.register_buffer("scales", torch.from_numpy(scale).to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.keep_dense(self.dequantize, dtype, dense_from_rows)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.weight, self.scales)

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The float32 weight [out, in] (rows start:stop of it)."""
        q = self.weight.numpy()[start:stop].astype(np.float32)
        return q * self.scales.float().numpy()[start:stop, None]

    def nbytes(self) -> int:
        return _nbytes(self.weight, self.scales, self.bias)


class Int8GroupLinear(Int4Linear):
    """y = x @ w.T (+ bias) with w held exactly as int8 groups (`Int8Groups`), computed by
    the int4 kernel on `Int8Groups.halves` with the input fed twice. One-row decode of the
    embedded model's LM head measured 2.0-2.1 against 2.8-3.0 ms for `_weight_int8pack_mm`, which
    is compute-bound on this CPU; the halves stream 10 bits a weight against 8."""

    def __init__(
        self,
        groups: Int8Groups,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        dense_from_rows: int | None = None,
    ) -> None:
        super().__init__(groups.halves(), bias, dtype)
        self.in_features = groups.q.shape[1]
        self.keep_dense(groups.dequantize, dtype, dense_from_rows)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().packed_forward(torch.cat([x, x], dim=-1))


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def int4_fits(out_features: int, in_features: int) -> bool:
    """Whether the int4 CPU kernel takes a weight of this shape."""
    return out_features % 16 == 0 and in_features % (INT4_GROUP * _INT4_INNER_K_TILES) == 0


@dataclass(frozen=True)
class FormatChoice:
    """What `resolve_weight_format` decided, and why.

    `dense_from_rows`: int4/int8 layers also keep a bfloat16 copy and use it for batches of
    this many rows or more (prefill, large decode batches); None keeps the packed weight only.
    """

    weight_format: str
    dtype: torch.dtype
    reason: str
    dense_from_rows: int | None = None


def resolve_weight_format(
    requested: str,
    dtype: str | None,
    device: torch.device,
    tensor_kinds: set[str],
    default_dtype: str,
) -> FormatChoice:
    """Turn `--weight-format` (and `--dtype`) into a format and an activation dtype.

    `tensor_kinds` are the file's storage types (GGUF type names, or torch dtype names).
    `auto` keeps the file's numbers: int4 for Q4_0/Q4_1 files and int8 for Q8_0 files when the
    CPU runs them faster than float32 (measured once per process); bfloat16 for bfloat16
    checkpoints; otherwise float32. An explicit `--dtype` makes `auto` mean float at that dtype.
    """
    if requested not in WEIGHT_FORMATS:
        raise InvalidArgumentError(
            f"weight_format must be one of {WEIGHT_FORMATS}, got {requested!r}",
            field="weight_format",
        )
    cpu = device.type == "cpu"
    if requested in ("int4", "int8"):
        if not cpu:
            raise InvalidArgumentError(
                f"weight_format={requested} runs on CPU only; use bfloat16 on {device.type}",
                field="weight_format",
            )
        if dtype not in (None, "bfloat16"):
            raise InvalidArgumentError(
                f"weight_format={requested} computes in bfloat16; drop dtype={dtype}",
                field="dtype",
            )
        return FormatChoice(requested, torch.bfloat16, "asked for", dense_rows_threshold())
    if requested == "bfloat16":
        if dtype not in (None, "bfloat16"):
            raise InvalidArgumentError(
                f"weight_format=bfloat16 computes in bfloat16; drop dtype={dtype}", field="dtype"
            )
        return FormatChoice("bfloat16", torch.bfloat16, "asked for")
    if requested == "float32" or dtype is not None or not cpu:
        return FormatChoice("float32", getattr(torch, dtype or default_dtype), "float")
    if tensor_kinds & {"Q4_0", "Q4_1"} or "Q8_0" in tensor_kinds:
        fmt = "int4" if tensor_kinds & {"Q4_0", "Q4_1"} else "int8"
        fast, figures = bf16_kernels_pay_off()
        if fast:
            reason = f"exact for the file; {figures}"
            return FormatChoice(fmt, torch.bfloat16, reason, dense_rows_threshold())
        return FormatChoice("float32", torch.float32, f"bf16 kernels are slower here; {figures}")
    if tensor_kinds == {"bfloat16"}:
        return FormatChoice("bfloat16", torch.bfloat16, "the checkpoint is bfloat16")
    return FormatChoice("float32", torch.float32, "float checkpoint")


@functools.cache
def bf16_kernels_pay_off() -> tuple[bool, str]:
    """Whether a one-token int4 matmul in bfloat16 beats float32 on this CPU, and the times."""
    k, n = 576, 3072
    x = torch.randn(1, k)
    w = torch.randn(k, n)
    groups = Int4Groups.quantize(w.T.numpy())
    int4 = Int4Linear(groups, None, torch.bfloat16)
    xb = x.bfloat16()

    with torch.inference_mode():
        dense = _best_time(lambda: x @ w, 15)
        packed = _best_time(lambda: int4(xb), 15)
    figures = f"1x{k}x{n} matmul: int4/bf16 {packed * 1e6:.0f} us, float32 {dense * 1e6:.0f} us"
    return packed < dense, figures


@functools.cache
def dense_rows_threshold() -> int | None:
    """The fewest rows at which a bfloat16 matmul beats the int4 kernel on this CPU (measured
    once per process on a 576 x 3072 weight); None if it never does up to 32 rows."""
    k, n = 576, 3072
    weight = torch.randn(n, k)
    int4 = Int4Linear(Int4Groups.quantize(weight.numpy()), None, torch.bfloat16)
    dense_t = weight.T.contiguous().bfloat16()
    with torch.inference_mode():
        for rows in (2, 4, 8, 16, 32):
            x = torch.randn(rows, k).bfloat16()
            dense = _best_time(functools.partial(torch.matmul, x, dense_t))
            if dense < _best_time(functools.partial(int4.packed_forward, x)):
                return rows
    return None


def _best_time(fn, reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def apply_weight_format(
    model: nn.Module,
    choice: FormatChoice,
    exact: dict[str, Int4Groups | Int8Groups] | None = None,
    file_types: dict[str, str] | None = None,
) -> dict[str, int]:
    """Replace `model`'s linear layers by `choice.weight_format` and cast the rest to
    `choice.dtype`, in place. `exact` holds the file's own int4 or int8 groups by module name;
    `file_types` the file's storage type by module name (a Q8_0 layer goes to int8 even under
    int4, its nearest format). Returns how many layers went to each storage, for the log."""
    exact, file_types = exact or {}, file_types or {}
    counts: dict[str, int] = {}
    fmt, dtype = choice.weight_format, choice.dtype
    if fmt in ("int4", "int8"):
        # By name, not holding the modules: each float layer is freed once replaced.
        names = [name for name, module in model.named_modules() if hasattr(module, "weight_t")]
        for name in names:
            new, kind = _quantized(
                model.get_submodule(name),
                fmt,
                dtype,
                exact.get(name),
                file_types.get(name, "float"),
                choice.dense_from_rows,
            )
            _set_module(model, name, new)
            counts[kind] = counts.get(kind, 0) + 1
    model.to(dtype)
    if fmt in ("float32", "bfloat16"):
        counts[str(dtype).removeprefix("torch.")] = sum(
            hasattr(m, "weight_t") for m in model.modules()
        )
    return counts


def _quantized(
    module, fmt, dtype, exact: Int4Groups | Int8Groups | None, file_type: str, dense_from_rows
):
    bias = module.bias.detach() if module.bias is not None else None
    k, n = module.weight_t.shape

    def weight() -> np.ndarray:  # the float weight [out, in], copied only where requantized
        return module.weight_t.detach().float().T.contiguous().numpy()

    if isinstance(exact, Int8Groups):
        if int4_fits(n, 2 * k):
            layer = Int8GroupLinear(exact, bias, dtype, dense_from_rows)
            return layer, f"int8 groups (exact from {exact.source}, as two int4 halves)"
        exact = None
    if fmt == "int4" and file_type == "Q8_0":
        fmt = "int8"  # 8-bit numbers are not squeezed into 4 bits
    if fmt == "int8":
        layer = Int8Linear(weight(), bias, dtype, dense_from_rows)
        return layer, f"int8 (per channel, from {file_type})"
    if not int4_fits(n, k):
        return module.to(dtype), "bfloat16 (shape unfit for int4)"
    if exact is not None:
        return Int4Linear(exact, bias, dtype, dense_from_rows), f"int4 (exact from {exact.source})"
    groups = Int4Groups.quantize(weight())
    return Int4Linear(groups, bias, dtype, dense_from_rows), f"int4 (from {file_type})"


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


@functools.cache
def onednn_blocks_bfloat16() -> bool:
    """Whether oneDNN can put bfloat16 weights in its blocked layout here: torch needs a build
    with oneDNN and a CPU with AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU has neither)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def pack_dense_copies(model: nn.Module, rows_hint: int = 32) -> int:
    """Put every packed layer's bfloat16 copy for large batches into oneDNN's blocked layout.
    The outputs are bit-identical; batch 32 decodes about 1.4x faster on a 2-core AVX512 CPU
    (`bench/engine.py --parts c`). Returns how many layers were packed."""
    return sum(
        module.pack_dense(rows_hint)
        for module in model.modules()
        if isinstance(module, _PackedLinear)
    )


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of linear weights one decode step streams (embedding rows are negligible)."""
    total = 0
    for module in model.modules():
        if isinstance(module, (Int4Linear, Int8Linear)):
            total += module.nbytes()
        elif hasattr(module, "weight_t"):
            total += _nbytes(module.weight_t, module.bias)
    return total
