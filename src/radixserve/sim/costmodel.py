"""A cost model that stands in for the GPU: how long a batch takes, in seconds.

Prefill of n new tokens after a cached prefix of p tokens costs
`prefill_per_token * n + prefill_attention_per_pair * n * (p + n / 2)`: the linear layers
scale with the new tokens, attention with new tokens times the context they attend over, so a
cache hit saves both. A decode step over a batch costs
`decode_step + decode_per_request * batch_size + decode_per_context_token * total_context`.

With block keys (`tokens_per_key` > 1) each key stands for that many tokens: a prefill costs
its keys' tokens, and a decode step, which emits one key per request, stands for as many real
decode steps as the tokens that key holds, with the batch shrinking as shorter answers end.

Loading a token's KV back from a host tier costs `host_load_per_token` (the default: about
0.5 MB of fp16 KV per token of a 7B model over 25 GB/s of PCIe), and from a storage tier
`storage_load_per_token` (the default: the same 0.5 MB read at about 2.5 GB/s, a local NVMe
disk or a fast network store).

The defaults are of the order of a 7B model on one datacenter GPU; they are constants to
change, not measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from radixserve.errors import InvalidArgumentError
from radixserve.sched.scheduler import Batch, ForwardMode


@dataclass(frozen=True)
class CostModel:
    prefill_per_token: float = 6.0e-5
    prefill_attention_per_pair: float = 1.0e-9
    prefill_batch_overhead: float = 2.0e-3
    decode_step: float = 8.0e-3
    decode_per_request: float = 5.0e-5
    decode_per_context_token: float = 2.0e-8
    host_load_per_token: float = 2.0e-5
    storage_load_per_token: float = 2.0e-4

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0:
                raise InvalidArgumentError(f"cost model {f.name} must be >= 0, got {value!r}")

    def tier_load_time(self, host_tokens: int, storage_tokens: int) -> float:
        """Seconds to load that many tokens' KV from the host and storage tiers."""
        return host_tokens * self.host_load_per_token + storage_tokens * self.storage_load_per_token

    def prefill_time(self, new_tokens: int, prefix_tokens: int) -> float:
        pairs = new_tokens * (prefix_tokens + new_tokens / 2)
        return self.prefill_per_token * new_tokens + self.prefill_attention_per_pair * pairs

    def batch_time(
        self,
        batch: Batch,
        tokens_per_key: int = 1,
        decode_tokens: Sequence[int] | None = None,
    ) -> float:
        """Seconds the batch's forward pass takes, each key standing for `tokens_per_key`
        tokens. `decode_tokens[i]`: the real tokens entry i's decoded key holds (default: all
        `tokens_per_key`); ignored by prefill batches."""
        k = tokens_per_key
        if batch.mode is ForwardMode.EXTEND:
            return self.prefill_batch_overhead + sum(
                self.prefill_time(k * len(e.token_ids), k * len(e.prefix_slots))
                for e in batch.entries
            )
        steps = decode_tokens if decode_tokens is not None else [k] * len(batch.entries)
        # entry i runs t_i real steps over a context of c_i, c_i + 1, ... tokens
        context = sum(
            t * (k * len(e.prefix_slots) + 1) + t * (t - 1) / 2
            for t, e in zip(steps, batch.entries, strict=True)
        )
        return (
            self.decode_step * max(steps, default=0)
            + self.decode_per_request * sum(steps)
            + self.decode_per_context_token * context
        )
