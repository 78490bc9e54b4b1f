"""Random arrival sequences through the real Scheduler and RadixCache with a trivial model.

Every request ends exactly once, with the outputs the model dictates (recomputation after a
retraction included), and the scheduler's and cache's invariants hold after every step.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_helpers import StepClock, counting_model, make_scheduler, req

from radixserve.cache import available_eviction_policies
from radixserve.sched.scheduler import Batch, ForwardMode

PIECES = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [1, 2, 3, 13, 14, 15])

request_spec = st.fixed_dictionaries(
    {
        "pieces": st.lists(st.integers(0, len(PIECES) - 1), max_size=4),
        "tail": st.lists(st.integers(20, 30), max_size=8),
        "max_new": st.integers(0, 24),
        "priority": st.integers(0, 20),
        "arrival": st.integers(0, 30),
        "abort_after": st.one_of(st.none(), st.integers(0, 40)),
    }
)


def checked_counting_model(batch: Batch) -> list[int]:
    """The counting model, after checking each entry hands over the request's own tokens
    from its prefix on, with one new slot per token."""
    for e in batch.entries:
        start = len(e.prefix_slots)
        assert len(e.new_slots) == len(e.token_ids) >= 1
        assert e.token_ids.tolist() == e.req.token_ids()[start : start + len(e.token_ids)].tolist()
        if e.is_decode:
            assert start + 1 == e.req.seq_len
    if batch.mode is ForwardMode.DECODE:
        assert all(e.is_decode for e in batch.entries)
    flags = [e.is_decode for e in batch.entries]
    assert flags == sorted(flags), "decode entries come last"
    return counting_model(batch)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(request_spec, min_size=1, max_size=12),
    page_size=st.sampled_from([1, 2, 4]),
    pool_pages=st.sampled_from([24, 48, 200]),
    chunk=st.sampled_from([8, 16, 64]),
    schedule=st.sampled_from(["fcfs", "lpm", "dfs-weight", "lof", "random"]),
    eviction=st.sampled_from(available_eviction_policies()),
    priority=st.booleans(),
    ratio=st.sampled_from([0.1, 0.7]),
    mixed=st.booleans(),
    jump=st.sampled_from([0, 0, 1, 3]),
)
def test_every_request_ends_exactly_once_and_nothing_leaks(
    specs, page_size, pool_pages, chunk, schedule, eviction, priority, ratio, mixed, jump
):
    """`jump` > 0: every few tokens a running request is handed `jump` forced tokens, as a
    grammar's jump-forward does; the outputs must come out the same."""
    clock = StepClock()
    sched = make_scheduler(
        pool=pool_pages * page_size,
        page_size=page_size,
        policy=eviction,
        clock=clock,
        schedule_policy=schedule,
        chunked_prefill_size=chunk,
        enable_priority_scheduling=priority,
        priority_preemption_threshold=5,
        init_new_token_ratio=ratio,
        min_new_token_ratio=min(ratio, 0.1),
        max_queue_wait=10.0,
        enable_mixed_chunk=mixed,
    )
    reqs = []
    for i, spec in enumerate(specs):
        prompt = [t for p in spec["pieces"] for t in PIECES[p]] + spec["tail"] or [99]
        reqs.append(
            (spec, req(f"r{i}", prompt, max_new_tokens=spec["max_new"], priority=spec["priority"]))
        )
    ended: dict[str, int] = {}
    for step in range(3000):
        clock.now = float(step)
        for spec, r in reqs:
            if spec["arrival"] == step:
                sched.add_request(r)
            if spec["abort_after"] is not None and spec["arrival"] + spec["abort_after"] == step:
                sched.abort(r.rid, "client went away")
        sched.run_step(checked_counting_model)
        sched.check_invariants()
        for r in list(sched.running) if jump else []:
            if len(r.output_ids) % 4 == 1:
                sched.append_forced(r.rid, [1000 + r.seq_len + k for k in range(jump)])
                sched.check_invariants()
        for r in sched.pop_finished():
            ended[r.rid] = ended.get(r.rid, 0) + 1
        if step > 31 and not sched.has_work():
            break
    else:
        raise AssertionError("the scheduler did not drain")
    assert ended == {r.rid: 1 for _, r in reqs}
    event(f"retracted: {sched.stats.retractions > 0}")
    event(f"preempted: {sched.stats.preemptions > 0}")
    event(f"evicted: {sched.stats.evicted_tokens > 0}")
    event(f"mixed: {sched.stats.mixed_batches > 0}")
    event(f"jump-forward: {jump > 0}")
    for spec, r in reqs:
        reason = r.finish_reason
        if reason.kind == "length":
            assert len(r.output_ids) == spec["max_new"]
            assert r.output_ids == [1000 + len(r.input_ids) + k for k in range(spec["max_new"])]
        else:
            assert reason.kind == "abort"
            too_big = len(r.input_ids) + spec["max_new"] > pool_pages * page_size
            assert spec["abort_after"] is not None or too_big, reason.message
    assert sched.cache.protected_size() == 0
    assert sched.allocator.available_size() + sched.cache.total_size() == sched.allocator.size
