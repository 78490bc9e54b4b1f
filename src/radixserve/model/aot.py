"""The batch-1 decode step compiled ahead of time by AOTInductor (`EngineConfig.compile_aot`,
`--compile-aot`).

`torch.compile` runs its graph behind Dynamo's frame evaluation and a Python wrapper that
launches every generated loop and kernel. At batch 1 on the embedded model those are about a
fifth of a step (py-spy, docs/cpu-decode.md). AOTInductor compiles the same step, exported
with `torch.export`, into a shared library whose C++ wrapper runs the whole step in one call.

The package holds code, not weights: the runner reads the model's own tensors (user-managed
constants), so it adds no copy of the weights and follows them if they change. Packages are
cached on disk (`cache_dir()`), keyed by everything the generated code depends on: the model's
shapes and layer types, the dtypes, the source of the model code, torch's version and the
CPU's instruction set. A first start compiles for one to two minutes; later ones load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from radixserve.model import attention, llama, quant
from radixserve.model.compiled import WIDTH_STEP, context_table
from radixserve.model.kv import KVPool
from radixserve.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where compiled packages are kept: $RADIXSERVE_CACHE/aot, else ~/.cache/radixserve/aot."""
    root = os.environ.get("RADIXSERVE_CACHE") or Path.home() / ".cache" / "radixserve"
    return Path(root) / "aot"


class _Step(torch.nn.Module):
    """`decode_step` as a module's forward, for `torch.export`."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids, positions, context_slots, context_mask, k_cache, v_cache):
        return self.m.decode_step(
            input_ids, positions, context_slots, context_mask, k_cache, v_cache
        )


def package_key(model: LlamaForCausalLM, kv: KVPool) -> str:
    """A digest of everything the compiled step depends on, except the weights' values."""
    parts = {
        "config": repr(model.config),
        "modules": [
            f"{name}:{type(m).__name__}:{getattr(m, 'dense_from_rows', '')}"
            for name, m in model.named_modules()
        ],
        "tensors": [
            f"{name}:{tuple(t.shape)}:{t.dtype}"
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        ],
        "kv": [str(kv.k.dtype), tuple(kv.k.shape)],  # the pool's shape is static in the step
        "source": [Path(m.__file__).read_text() for m in (attention, llama, quant)],
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),  # inductor sizes its parallel loops to it
    }
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


class AOTDecode:
    """`LlamaForCausalLM.decode_step` for one request, as a compiled AOTInductor package.

    Guarantees: called as `decode_step` is, with one request and a context width that is a
    multiple of `WIDTH_STEP`, it returns what the eager step returns up to float rounding, and
    writes nothing. `build` raises whatever export or compilation raises; the engine then
    keeps the `torch.compile` path for batch 1.
    """

    def __init__(self, runner, max_width: int) -> None:
        self._runner = runner
        self.max_width = max_width

    @classmethod
    def build(cls, model: LlamaForCausalLM, kv: KVPool, directory: Path | None = None) -> AOTDecode:
        """Load the package for `model` from the cache, compiling and storing it first if it
        is not there."""
        directory = directory or cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"decode-b1-{package_key(model, kv)}.pt2"
        max_width = -(-(kv.k.shape[1] + 1) // WIDTH_STEP) * WIDTH_STEP
        named = {f"m.{n}": t for n, t in [*model.named_parameters(), *model.named_buffers()]}
        if not path.exists():
            start = time.perf_counter()
            width = torch.export.Dim("width", min=WIDTH_STEP, max=max(max_width, 4 * WIDTH_STEP))
            shapes = (None, None, {1: width}, {1: width}, None, None)
            with torch.no_grad():
                exported = torch.export.export(
                    _Step(model), _example(kv), dynamic_shapes=shapes, strict=False
                )
            _check_unnamed_constants(exported, named)
            partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
            torch._inductor.aoti_compile_and_package(
                exported,
                package_path=str(partial),
                inductor_configs={"aot_inductor.package_constants_in_so": False},
            )
            partial.replace(path)  # atomic: a concurrent start never loads half a package
            log.info(
                "compiled the batch-1 decode step ahead of time in %.1f s (%s)",
                time.perf_counter() - start,
                path,
            )
        runner = torch._inductor.aoti_load_package(str(path))
        # Export lifts the int4 layers' non-persistent group-size scalars as unnamed constants;
        # _check_unnamed_constants made sure that is all they are, and _agrees checks the rest.
        constants = {fqn: named.get(fqn, _GROUP_SIZE) for fqn in runner.get_constant_fqns()}
        runner.load_constants(constants, check_full_update=True, user_managed=True)
        built = cls(runner, max_width)
        if not _agrees(built, model, kv):
            raise RuntimeError(f"the compiled step disagrees with the eager one ({path})")
        return built

    def __call__(self, input_ids, positions, context_slots, context_mask, k_cache, v_cache):
        return self._runner(input_ids, positions, context_slots, context_mask, k_cache, v_cache)


_GROUP_SIZE = torch.tensor(quant.INT4_GROUP)


def _check_unnamed_constants(exported: torch.export.ExportedProgram, named: dict) -> None:
    """Refuse a program that lifted a constant the model does not hold by name, other than the
    int4 group size: the package is loaded with the model's tensors by name."""
    for name, value in exported.constants.items():
        if name in named:
            continue
        if not (
            isinstance(value, torch.Tensor)
            and value.ndim == 0
            and value.dtype == torch.int64
            and int(value) == quant.INT4_GROUP
        ):
            raise RuntimeError(f"unexpected lifted constant {name} in the exported decode step")


def _example(kv: KVPool) -> tuple:
    table, mask = context_table([np.arange(1, 2 * WIDTH_STEP + 1, dtype=np.int64)])
    return (
        torch.tensor([1]),
        torch.tensor([2 * WIDTH_STEP]),
        torch.from_numpy(table),
        torch.from_numpy(mask),
        kv.k,
        kv.v,
    )


def _agrees(step: AOTDecode, model: LlamaForCausalLM, kv: KVPool) -> bool:
    """Whether the loaded package computes what the eager step does on an example (the same
    next token, and the first layer's new keys within bfloat16 rounding)."""
    example = _example(kv)
    with torch.no_grad():
        logits, k, _ = step(*example)
        want_logits, want_k, _ = model.decode_step(*example)
    same_token = bool((logits.argmax(-1) == want_logits.argmax(-1)).all())
    return same_token and torch.allclose(k[0].float(), want_k[0].float(), rtol=0.05, atol=0.05)
