"""Synthetic workloads: seeded, and shaped as their names say."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from radixserve.errors import InvalidArgumentError
from radixserve.sim.workloads import WORKLOADS, chat_traffic, make_workload, mooncake_conversation


def starts_with(seq, prefix) -> bool:
    return len(seq) >= len(prefix) and np.array_equal(seq[: len(prefix)], prefix)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_is_seeded(name):
    a, b = make_workload(name, seed=1), make_workload(name, seed=1)
    c = make_workload(name, seed=2)
    assert [r.input_ids.tolist() for r in a] == [r.input_ids.tolist() for r in b]
    assert [r.input_ids.tolist() for r in a] != [r.input_ids.tolist() for r in c]
    rids = [r.rid for r in a]
    assert len(set(rids)) == len(rids)
    assert all(r.after is None or r.after in set(rids) for r in a)


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    trace = make_workload(
        "shared-prefix",
        num_groups=4,
        prompts_per_group=3,
        system_len=16,
        question_len=4,
        output_len=2,
    )
    heads = {r.input_ids[:16].tobytes() for r in trace}
    assert len(trace) == 12 and len(heads) == 4
    assert all(len(r.input_ids) == 20 and r.output_len == 2 for r in trace)


def test_zipf_popularity_is_skewed():
    trace = make_workload("shared-prefix-zipf", num_groups=20, prompts_per_group=50, seed=0)
    counts = sorted(np.unique([r.input_ids[:8].tobytes() for r in trace], return_counts=True)[1])[
        ::-1
    ]
    assert counts[0] > 5 * counts[-1]


@pytest.mark.parametrize("name", ["multi-turn", "multi-turn-random", "agent"])
def test_sessions_append_to_their_history_including_answers(name):
    trace = make_workload(name, seed=0)
    by_rid = {r.rid: r for r in trace}
    followers = [r for r in trace if r.after is not None]
    assert followers
    for r in followers:
        parent = by_rid[r.after]
        assert starts_with(r.input_ids, np.concatenate([parent.input_ids, parent.output_ids]))


def test_round_robin_multi_turn_interleaves_sessions():
    trace = make_workload("multi-turn", num_sessions=3, turns=2, seed=0)
    assert [r.after for r in trace] == [None, None, None, "req-0", "req-1", "req-2"]


@pytest.mark.parametrize("name", ["tree-of-thought", "tree-of-thought-shuffled"])
def test_tree_of_thought_children_extend_their_parent(name):
    trace = make_workload(name, num_trees=2, depth=3, branching=2, seed=0)
    assert len(trace) == 2 * (1 + 2 + 4)
    by_rid = {r.rid: r for r in trace}
    children = [r for r in trace if r.after is not None]
    assert len(children) == 2 * (2 + 4)
    for r in children:
        parent = by_rid[r.after]
        assert starts_with(r.input_ids, np.concatenate([parent.input_ids, parent.output_ids]))


def test_poisson_arrivals_are_increasing_and_validated():
    trace = make_workload("few-shot", rate=10.0, seed=0)
    times = [r.arrival for r in trace]
    assert times == sorted(times) and times[-1] > 0
    with pytest.raises(InvalidArgumentError, match="rate"):
        make_workload("few-shot", rate=0)
    with pytest.raises(InvalidArgumentError, match="workload"):
        make_workload("nope")


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3"])
def test_a_bad_seed_is_refused_by_every_generator(seed):
    """Regression: a negative seed reached numpy and came out as a bare traceback."""
    with pytest.raises(InvalidArgumentError, match="seed"):
        make_workload("few-shot", seed=seed)
    with pytest.raises(InvalidArgumentError, match="seed"):
        chat_traffic(num_sessions=4, seed=seed)
    with pytest.raises(InvalidArgumentError, match="seed"):
        mooncake_conversation(num_sessions=4, seed=seed)


def test_chat_traffic_has_the_shape_it_promises():
    records = chat_traffic(num_sessions=300, num_apps=6, doc_share=0.3, seed=5)
    assert records == chat_traffic(num_sessions=300, num_apps=6, doc_share=0.3, seed=5)
    assert [r["timestamp"] for r in records] == sorted(r["timestamp"] for r in records)
    for r in records:
        assert 512 * (len(r["hash_ids"]) - 1) < r["input_length"] <= 512 * len(r["hash_ids"])
    prompts = [tuple(r["hash_ids"]) for r in records]
    # Later turns extend an earlier prompt of their session, block for block.
    assert sum(any(b[: len(a)] == a and b != a for a in prompts) for b in prompts) > 50
    # Every prompt starts with one of the six applications' system prompts.
    firsts = {p[0] for p in prompts}
    assert len(firsts) <= 6
    lengths = [len(p) for p in prompts]
    assert max(lengths) >= 8 + 1, "some messages carry long documents"
    flat = chat_traffic(num_sessions=300, num_apps=6, doc_share=0.0, seed=5)
    assert max(len(r["hash_ids"]) for r in flat) < max(lengths)


def test_chat_traffic_drift_moves_popularity():
    kwargs = dict(num_sessions=2000, num_apps=50, mean_turns=1.0, duration_s=4000.0, seed=2)
    drifting = chat_traffic(drift_every_s=1000.0, **kwargs)

    def top(records, lo, hi):
        counts = Counter(r["hash_ids"][0] for r in records if lo <= r["timestamp"] < hi)
        return counts.most_common(1)[0][0]

    tops = {top(drifting, 1000 * k * 1000, 1000 * (k + 1) * 1000) for k in range(4)}
    assert len(tops) >= 2, "the most popular application changes between phases"
    steady = chat_traffic(**kwargs)
    assert len({top(steady, 1000 * k * 1000, 1000 * (k + 1) * 1000) for k in range(4)}) == 1


def test_chat_traffic_refuses_bad_arguments():
    for kwargs in (
        dict(doc_share=1.5),
        dict(mean_turns=0.5),
        dict(system_blocks=(3, 1)),
        dict(answer_blocks=(-1, 2)),
        dict(think_sigma=-1.0),
        dict(drift_every_s=0.0),
        dict(num_sessions=0),
    ):
        with pytest.raises(InvalidArgumentError):
            chat_traffic(**kwargs)
