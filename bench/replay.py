"""How long does one policy-lab replay of a production-sized trace take, and where does it go?

Trace: 12,000 requests, about 6 million prompt tokens (Zipf-popular shared system prompts of
400 tokens, 100-token questions, 32-token answers), replayed once at 5% of its unique tokens
with LRU and fcfs. Reported: the replay's wall time (target <= 30 s), the share spent in the
radix tree (every RadixCache call, timed by wrapping the instance's methods), and, as the
baseline measured in the same run, the same replay with the radix cache disabled: the ratio
is what the tree costs on top of the scheduler loop.

    python bench/replay.py            # the full trace
    python bench/replay.py --quick    # a tenth of it
"""

from __future__ import annotations

import argparse
import time

from radixserve.cache.radix import RadixCache
from radixserve.sim.oracle import infinite_cache
from radixserve.sim.replay import ReplayConfig, replay
from radixserve.sim.workloads import make_workload

TIMED = (
    "match_prefix",
    "peek_prefix",
    "peek_node",
    "insert",
    "evict",
    "inc_lock_ref",
    "dec_lock_ref",
    "refresh_eviction_key",
)


class TreeTimer:
    """Wraps RadixCache's methods so that every call's time is added up."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._originals = {}

    def __enter__(self) -> TreeTimer:
        for name in TIMED:
            original = getattr(RadixCache, name)
            self._originals[name] = original

            def timed(cache, *args, _original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return _original(cache, *args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
                    self.calls += 1

            setattr(RadixCache, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(RadixCache, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the trace")
    args = parser.parse_args()
    groups = 20 if args.quick else 200
    trace = make_workload(
        "shared-prefix-zipf",
        num_groups=groups,
        prompts_per_group=60,
        system_len=400,
        question_len=100,
        output_len=32,
        seed=0,
    )
    prompt_tokens = sum(len(r.input_ids) for r in trace)
    start = time.perf_counter()
    bound, unique = infinite_cache(trace)
    bound_seconds = time.perf_counter() - start
    print(
        f"trace: {len(trace):,} requests, {prompt_tokens:,} prompt tokens, {unique:,} unique; "
        f"infinite-cache bound {bound:.1%} (computed in {bound_seconds:.2f} s)"
    )
    config = ReplayConfig(eviction_policy="lru", schedule_policy="fcfs", cache_fraction=5)
    with TreeTimer() as timer:
        result = replay(trace, config, unique=unique)
    baseline = replay(
        trace,
        ReplayConfig(eviction_policy="lru", cache_fraction=5, enable_radix_cache=False),
        unique=unique,
    )
    print(
        f"replay (radix cache, lru, fcfs, {result.kv_tokens:,} KV tokens): "
        f"{result.wall_seconds:.2f} s wall, hit rate {result.token_hit_rate:.1%}, "
        f"{result.sched_cache_us_per_request:.0f} µs/request in scheduler + cache"
    )
    print(
        f"  in the radix tree: {timer.seconds:.2f} s over {timer.calls:,} calls "
        f"({timer.seconds / result.wall_seconds:.0%} of the replay; timing wrappers included)"
    )
    print(
        f"baseline (radix cache disabled): {baseline.wall_seconds:.2f} s wall, "
        f"hit rate {baseline.token_hit_rate:.1%}"
    )
    print(f"  ratio replay/baseline: {result.wall_seconds / baseline.wall_seconds:.2f}x")
    verdict = "met" if result.wall_seconds <= 30 else "MISSED"
    print(f"target: one replay <= 30 s: {result.wall_seconds:.1f} s, {verdict}")


if __name__ == "__main__":
    main()
