"""Shared helpers for the scheduler tests: building a scheduler and a stand-in model."""

from __future__ import annotations

import numpy as np

from radixserve.cache import PagedTokenToKVPoolAllocator, RadixCache, TokenToKVPoolAllocator
from radixserve.sched import Batch, Req, SamplingParams, Scheduler, SchedulerConfig


class StepClock:
    """A manual clock for the scheduler and the cache."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    pool: int = 4096, page_size: int = 1, policy: str = "lru", clock=None, **config
) -> Scheduler:
    clock = clock or StepClock()
    allocator = (
        TokenToKVPoolAllocator(pool)
        if page_size == 1
        else PagedTokenToKVPoolAllocator(pool, page_size)
    )
    cache = RadixCache(allocator, page_size=page_size, eviction_policy=policy, clock=clock)
    return Scheduler(cache, SchedulerConfig(**config), clock=clock)


def req(rid: str, prompt, max_new_tokens: int = 4, **kwargs) -> Req:
    sampling = kwargs.pop("sampling", None) or SamplingParams(max_new_tokens=max_new_tokens)
    return Req(rid, np.asarray(prompt, dtype=np.int32), sampling, **kwargs)


def counting_model(batch: Batch) -> list[int]:
    """Next token = 1000 + the number of tokens the request has, so outputs are checkable."""
    return [1000 + e.req.seq_len for e in batch.entries]


def run_to_completion(sched: Scheduler, model=counting_model, max_steps: int = 10_000) -> list:
    """Step until idle, checking invariants after every step; return the finished requests."""
    finished = []
    for _ in range(max_steps):
        if not sched.has_work():
            break
        sched.run_step(model)
        sched.check_invariants()
        finished.extend(sched.pop_finished())
    else:
        raise AssertionError("scheduler did not go idle")
    finished.extend(sched.pop_finished())
    return finished
