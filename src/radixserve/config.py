"""Engine configuration. Options carry the same names in the CLI (with dashes) and the docs."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.cache.evict import available_eviction_policies
from radixserve.errors import InvalidArgumentError
from radixserve.model.quant import WEIGHT_FORMATS
from radixserve.sched.policy import make_schedule_policy

DTYPES = ("float32", "bfloat16", "float16", "float64")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class EngineConfig:
    """How to build an `Engine`. `model=None` is the embedded SmolLM2-135M-Instruct."""

    model: str | None = None
    enable_radix_cache: bool = True
    page_size: int = 1
    eviction_policy: str = "adaptive"
    schedule_policy: str = "fcfs"
    kv_cache_tokens: int | None = None
    chunked_prefill_size: int = 2048
    enable_mixed_chunk: bool = True
    enable_jump_forward: bool = True
    enable_kv_events: bool = False
    max_running_requests: int = 64
    dtype: str | None = None
    weight_format: str = "auto"
    device: str = "cpu"
    threads: int | None = None
    threads_batch: int | None = None
    seed: int = 0
    max_context: int | None = None
    decode_attention: str = "auto"
    compile: bool = False
    compile_aot: bool = False
    cuda_graph: bool = True
    hicache_size_gb: float | None = None
    hicache_host_dtype: str | None = None
    hicache_write_policy: str = "write_through"
    hicache_write_through_threshold: int = 2
    hicache_eviction_policy: str = "lru"
    hicache_storage: str | None = None
    hicache_page_size: int = 64
    hicache_storage_size_gb: float | None = None
    hicache_prefetch: str = "timeout"
    hicache_prefetch_timeout: float = 2.0
    scheduler_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("page_size", "chunked_prefill_size", "max_running_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("kv_cache_tokens", "threads", "threads_batch", "max_context"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(f"{name} must be an integer >= 1 or None, got {value!r}")
        for name in ("eviction_policy", "hicache_eviction_policy"):
            if getattr(self, name) not in available_eviction_policies():
                raise InvalidArgumentError(
                    f"{name} must be one of {available_eviction_policies()}, "
                    f"got {getattr(self, name)!r}"
                )
        make_schedule_policy(self.schedule_policy)
        if self.weight_format not in WEIGHT_FORMATS:
            raise InvalidArgumentError(
                f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidArgumentError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if not isinstance(self.hicache_page_size, int) or self.hicache_page_size < 1:
            raise InvalidArgumentError(
                f"hicache_page_size must be an integer >= 1, got {self.hicache_page_size!r}"
            )
        if self.hicache_page_size % self.page_size:
            raise InvalidArgumentError(
                f"hicache_page_size ({self.hicache_page_size}) must be a multiple of page_size "
                f"({self.page_size})"
            )
        if self.hicache_storage_size_gb is not None and not self.hicache_storage_size_gb > 0:
            raise InvalidArgumentError(
                f"hicache_storage_size_gb must be > 0, got {self.hicache_storage_size_gb!r}"
            )
        if self.hicache_size_gb is not None and not self.hicache_size_gb > 0:
            raise InvalidArgumentError(f"hicache_size_gb must be > 0, got {self.hicache_size_gb!r}")
        if self.hicache_host_dtype is not None and self.hicache_host_dtype not in DTYPES:
            raise InvalidArgumentError(
                f"hicache_host_dtype must be one of {DTYPES}, got {self.hicache_host_dtype!r}"
            )
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise InvalidArgumentError(
                f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, got "
                f"{self.hicache_write_policy!r}"
            )
        if (
            not isinstance(self.hicache_write_through_threshold, int)
            or self.hicache_write_through_threshold < 1
        ):
            raise InvalidArgumentError(
                "hicache_write_through_threshold must be an integer >= 1, got "
                f"{self.hicache_write_through_threshold!r}"
            )
        if self.hicache_prefetch not in ("best_effort", "wait_complete", "timeout"):
            raise InvalidArgumentError(
                "hicache_prefetch must be best_effort, wait_complete or timeout, got "
                f"{self.hicache_prefetch!r}"
            )
        if not self.hicache_prefetch_timeout >= 0:
            raise InvalidArgumentError(
                f"hicache_prefetch_timeout must be >= 0 s, got {self.hicache_prefetch_timeout!r}"
            )
        if self.decode_attention not in ("auto", "sdpa", "matmul"):
            raise InvalidArgumentError(
                f"decode_attention must be auto, sdpa or matmul, got {self.decode_attention!r}"
            )

    @property
    def resolved_dtype(self) -> str:
        """The float dtype: float32 on CPU and bfloat16 on CUDA unless `dtype` says otherwise.

        The weight format may still choose bfloat16 activations (`Engine.dtype` is final)."""
        if self.dtype is not None:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
