"""The multi-replica lab: every request ends once, one replica is the single replay, and
routing by cache content beats round robin on chat traffic."""

from __future__ import annotations

import pytest

from radixserve.errors import InvalidArgumentError
from radixserve.sim.cacheonly import simulate_cache
from radixserve.sim.cluster import replay_cluster
from radixserve.sim.replay import ReplayConfig, replay
from radixserve.sim.workloads import make_workload


@pytest.fixture(scope="module")
def chat():
    return make_workload("multi-turn-random", num_sessions=48, turns=5, rate=30.0, seed=7)


@pytest.mark.parametrize("router", ["round_robin", "pow2", "cache_aware", "precise"])
def test_every_request_ends_and_the_pools_come_back_whole(chat, router):
    config = ReplayConfig(kv_cache_tokens=12_000, check_invariants=True)
    result = replay_cluster(chat, config, 3, router)
    assert result.failed == 0 and sum(result.requests_per_replica) == len(chat)
    assert result.output_tokens == sum(r.output_len for r in chat)
    assert result.imbalance >= 1.0


def test_one_replica_is_the_single_replay(chat):
    config = ReplayConfig(kv_cache_tokens=12_000)
    single = replay(chat, config)
    one = replay_cluster(chat, config, 1, "round_robin")
    assert one.token_hit_rate == single.token_hit_rate
    assert one.makespan == pytest.approx(single.makespan)


def test_precise_routing_keeps_most_of_the_single_cache_hit_rate(chat):
    config = ReplayConfig(kv_cache_tokens=12_000)
    rr = replay_cluster(chat, config, 4, "round_robin")
    precise = replay_cluster(chat, config, 4, "precise")
    bound = simulate_cache(chat, "lru", kv_tokens=4 * 12_000).hit_rate  # 4x, in one place
    assert precise.token_hit_rate >= 1.5 * rr.token_hit_rate
    assert precise.token_hit_rate >= bound - 0.05


def test_closed_loop_arrivals_are_refused(chat):
    with pytest.raises(InvalidArgumentError, match="closed-loop"):
        config = ReplayConfig(kv_cache_tokens=12_000, arrivals="closed-loop:4")
        replay_cluster(chat, config, 2, "pow2")
