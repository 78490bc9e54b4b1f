"""Does a scheduler step cost the same with 100, 1,000 and 10,000 requests waiting?

The scheduler runs with a model that answers at once. Before every step the queue is topped up
to N waiting requests (64-token prompts over 16 shared 48-token prefixes, 4 new tokens each),
so the queue stays N long while requests are admitted, decode and finish. Reported per
configuration: the mean and p99 time of one step plus its `process_batch_result`, in µs, and
the ratio of each N's mean to N = 100's, measured in the same run. The issue's target is a
ratio of at most 2 at N = 10,000.

    python bench/sched_queue.py             # fcfs, lpm, and fcfs with priorities and starvation
    python bench/sched_queue.py --steps 200
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from radixserve.cache import RadixCache, TokenToKVPoolAllocator
from radixserve.sched import Req, SamplingParams, Scheduler, SchedulerConfig

CONFIGS = {
    "fcfs": dict(schedule_policy="fcfs"),
    "lpm": dict(schedule_policy="lpm"),
    "fcfs+priority+max_queue_wait": dict(
        schedule_policy="fcfs", enable_priority_scheduling=True, max_queue_wait=5.0
    ),
}
SIZES = (100, 1_000, 10_000)


def run(config: dict, waiting: int, steps: int, seed: int = 0) -> np.ndarray:
    """Per-step times (seconds) with `waiting` requests queued throughout."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 32_000, 48, dtype=np.int32) for _ in range(16)]
    now = [0.0]
    cache = RadixCache(TokenToKVPoolAllocator(200_000), clock=lambda: now[0])
    sched = Scheduler(
        cache, SchedulerConfig(max_running_requests=32, **config), clock=lambda: now[0]
    )
    made = 0

    def top_up() -> None:
        nonlocal made
        while len(sched.waiting) < waiting:
            prompt = np.concatenate([prefixes[made % 16], rng.integers(0, 32_000, 16)])
            sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)
            sched.add_request(Req(f"r{made}", prompt.astype(np.int32), sampling, priority=made % 3))
            made += 1

    times = []
    gc.collect()
    for step in range(steps):
        top_up()
        now[0] = step * 0.01
        start = time.perf_counter()
        batch = sched.step()
        if batch is not None:
            sched.process_batch_result(batch, [7] * len(batch.entries))
        times.append(time.perf_counter() - start)
        sched.pop_finished()
    return np.asarray(times[steps // 10 :])  # the first tenth warms the tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    print(f"{'configuration':<30}{'waiting':>9}{'mean µs':>10}{'p99 µs':>10}{'/ N=100':>9}")
    for name, config in CONFIGS.items():
        base = None
        for n in SIZES:
            t = run(config, n, args.steps) * 1e6
            mean = float(t.mean())
            base = base or mean
            print(
                f"{name:<30}{n:>9,}{mean:>10.1f}{float(np.percentile(t, 99)):>10.1f}"
                f"{mean / base:>8.2f}x"
            )


if __name__ == "__main__":
    main()
