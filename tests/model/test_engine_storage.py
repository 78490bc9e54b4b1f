"""The engine with a storage tier (`hicache_storage`): a prefix computed before a restart is
loaded back, not recomputed, and the answer is the same; other models and tenants never load
it; a request waiting for its pages can be aborted; nothing leaks."""

from __future__ import annotations

import contextlib
import time

import pytest
from model_helpers import make_engine, tiny_checkpoint

from radixserve.errors import InvalidArgumentError

PROMPT = [3 + (7 * i) % 80 for i in range(70)]  # 4 storage pages of 16, and 6 tokens


def run(engine, prompt=PROMPT, extra_key=None, max_new_tokens=6):
    rid = engine.add_request(
        prompt, {"max_new_tokens": max_new_tokens, "temperature": 0}, extra_key=extra_key
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for chunk in engine.step():
            if chunk.rid == rid and chunk.finished:
                engine.storage_io.flush(30)
                return chunk.result
    raise AssertionError("the request did not finish")


def idle_check(engine) -> None:
    assert not engine.has_work()
    engine.check_invariants()
    assert engine.cache.protected_size() == 0
    assert engine.allocator.available_size() + engine.cache.total_size() == engine.allocator.size


def storage_engine(model, tmp_path, **options):
    return make_engine(
        model, dtype="float64", hicache_storage=f"file:{tmp_path}", hicache_page_size=16, **options
    )


def test_a_prefix_survives_a_restart(llama_dir, tmp_path):
    first = storage_engine(llama_dir, tmp_path)
    before = run(first)
    assert before.usage.cached_tokens == 0 and before.meta["storage_tokens"] == 0
    idle_check(first)
    restarted = storage_engine(llama_dir, tmp_path)
    after = run(restarted)
    assert after.meta["storage_tokens"] == 64  # the prompt's whole pages
    assert after.usage.cached_tokens == 64
    assert after.token_ids == before.token_ids
    idle_check(restarted)
    again = run(restarted)  # now on the device: nothing to load
    assert again.meta["storage_tokens"] == 0 and again.usage.cached_tokens >= 64
    idle_check(restarted)


def test_other_tenants_and_models_do_not_load_it(llama_dir, tmp_path, tmp_path_factory):
    run(storage_engine(llama_dir, tmp_path), extra_key="tenant-a")
    other = storage_engine(llama_dir, tmp_path)
    assert run(other, extra_key="tenant-b").meta["storage_tokens"] == 0
    assert run(other, extra_key="tenant-a").meta["storage_tokens"] == 64
    different = tiny_checkpoint(tmp_path_factory.mktemp("other"), "llama", seed=5)
    assert (
        run(storage_engine(different, tmp_path), extra_key="tenant-a").meta["storage_tokens"] == 0
    )
    idle_check(other)


def test_best_effort_does_not_wait_and_an_aborted_wait_leaks_nothing(llama_dir, tmp_path):
    run(storage_engine(llama_dir, tmp_path))
    eager = storage_engine(llama_dir, tmp_path, hicache_prefetch="best_effort")
    result = run(eager)
    assert result.finish_reason == "length"
    idle_check(eager)
    waiting = storage_engine(llama_dir, tmp_path, hicache_prefetch="wait_complete")
    rid = waiting.add_request(PROMPT, {"max_new_tokens": 4})
    assert rid in waiting.request_ids()
    assert waiting.abort(rid)
    chunks = []
    while waiting.has_work():
        chunks += waiting.step()
    [final] = [c for c in chunks if c.finished]
    assert final.result.finish_reason == "abort"
    waiting.storage_io.flush(30)
    idle_check(waiting)


def test_bad_storage_options_are_refused(llama_dir, tmp_path):
    with pytest.raises(InvalidArgumentError, match="multiple of page_size"):
        make_engine(llama_dir, page_size=4, hicache_storage=f"file:{tmp_path}", hicache_page_size=6)
    with pytest.raises(InvalidArgumentError, match="hicache_prefetch"):
        make_engine(llama_dir, hicache_storage=f"file:{tmp_path}", hicache_prefetch="eager")
    with pytest.raises(InvalidArgumentError, match="unknown storage URI"):
        make_engine(llama_dir, hicache_storage="s3://bucket")


@pytest.mark.parametrize("page_size", [1, 16])
def test_outputs_with_storage_hits_equal_outputs_without_a_cache(llama_dir, tmp_path, page_size):
    prompts = [PROMPT, [*PROMPT[:50], 9, 8, 7], PROMPT[:33]]
    plain = make_engine(llama_dir, dtype="float64", enable_radix_cache=False)
    expected = [run_plain(plain, p) for p in prompts]
    writer = storage_engine(llama_dir, tmp_path, page_size=page_size)
    run(writer)
    reader = storage_engine(llama_dir, tmp_path, page_size=page_size)
    results = [run(reader, p) for p in prompts]
    assert [r.token_ids for r in results] == expected
    assert results[0].meta["storage_tokens"] == 64
    assert results[1].meta["storage_tokens"] == 0  # its pages are on the device by then
    assert results[1].usage.cached_tokens >= 48
    idle_check(reader)


def run_plain(engine, prompt) -> list[int]:
    rid = engine.add_request(prompt, {"max_new_tokens": 6, "temperature": 0})
    while True:
        for chunk in engine.step():
            if chunk.rid == rid and chunk.finished:
                return chunk.result.token_ids


def host_engine(model, policy, **options):
    return make_engine(
        model,
        dtype="float64",
        kv_cache_tokens=160,
        hicache_size_gb=0.01,
        hicache_page_size=16,
        hicache_write_policy=policy,
        **options,
    )


LONG = [3 + (7 * i) % 80 for i in range(100)]
OTHERS = [[5 + (13 * i + k) % 80 for i in range(100)] for k in (1, 2)]


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_the_host_tier_brings_back_a_prefix_the_device_evicted(llama_dir, policy):
    prompt = LONG
    plain = make_engine(llama_dir, dtype="float64", enable_radix_cache=False)
    expected = run_plain(plain, [*prompt, 11, 12])
    engine = host_engine(llama_dir, policy)
    runs = 2 if policy == "write_through_selective" else 1  # selective: the second offer
    for _ in range(runs):
        run_host(engine, prompt)
    for other in OTHERS:  # these push the prefix out of the 160-token device pool
        run_host(engine, other)
    assert engine.cache.peek_prefix(prompt) < 16
    match = engine.tiers.match_prefix([*prompt, 11, 12])
    assert match.device < 16 and match.device + match.host == 96 and match.storage == 0
    result = run_host(engine, [*prompt, 11, 12])
    assert result.meta["host_tokens"] == 96  # six whole 16-token pages
    assert result.usage.cached_tokens >= 96
    assert result.token_ids == expected
    idle_check(engine)


def test_the_host_tier_evicts_by_its_own_policy(llama_dir):
    engine = host_engine(llama_dir, "write_through", hicache_eviction_policy="lfu")
    assert engine.host_tier.storage.policy.name == "lfu"
    assert engine.cache.policy.name == "adaptive"  # the device pool keeps the engine's default
    run_host(engine, LONG)
    idle_check(engine)
    with pytest.raises(InvalidArgumentError, match="hicache_eviction_policy must be one of"):
        host_engine(llama_dir, "write_through", hicache_eviction_policy="newest")


def test_selective_write_through_skips_prefixes_seen_once(llama_dir):
    engine = host_engine(llama_dir, "write_through_selective")
    run_host(engine, LONG)
    for other in OTHERS:
        run_host(engine, other)
    assert run_host(engine, LONG).meta["host_tokens"] == 0
    idle_check(engine)


def run_host(engine, prompt):
    rid = engine.add_request(prompt, {"max_new_tokens": 6, "temperature": 0})
    while True:
        for chunk in engine.step():
            if chunk.rid == rid and chunk.finished:
                return chunk.result


def test_a_host_tier_in_a_smaller_dtype_holds_pages_at_half_the_bytes(llama_dir):
    exact = host_engine(llama_dir, "write_through")
    half = host_engine(llama_dir, "write_through", hicache_host_dtype="float32")  # of float64
    for engine in (exact, half):
        run_host(engine, LONG)
        for other in OTHERS:
            run_host(engine, other)
    assert half.host_tier.storage.size_bytes() * 2 == exact.host_tier.storage.size_bytes()
    result = run_host(half, [*LONG, 11, 12])
    assert result.meta["host_tokens"] == 96 and result.finish_reason == "length"
    idle_check(half)


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event) -> None:
        self.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    def __init__(self, name: int) -> None:
        self.name = name

    def record(self, stream) -> None:
        stream.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return True


class FakeCuda:
    """`torch.cuda`'s stream and event calls on the CPU, for `LayerwiseCopier`: the work runs
    at once and `log` records who waited on what. CUDA itself is not on this machine; this
    checks the order of the calls the copy stream depends on."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = FakeStream("compute", self.log)
        self.events = 0

    def Stream(self, device) -> FakeStream:
        return FakeStream("copy", self.log)

    def Event(self) -> FakeEvent:
        self.events += 1
        return FakeEvent(self.events)

    def current_stream(self, device) -> FakeStream:
        return self.compute

    def stream(self, stream):
        return contextlib.nullcontext()


def test_tier_loads_are_waited_for_layer_by_layer_before_each_layers_attention(llama_dir):
    from radixserve.model.kv import LayerwiseCopier

    engine = host_engine(llama_dir, "write_through")
    expected = run_host(host_engine(llama_dir, "write_through"), [*LONG, 11, 12]).token_ids
    cuda = FakeCuda()
    layers = engine.model.config.num_hidden_layers
    engine.kv.copier = LayerwiseCopier(layers, engine.kv.k.device, cuda)
    attention = engine.attention

    class Logged:
        def forward(self, q, k, v, meta):
            cuda.log.append(("read", int(k.data_ptr())))
            return attention.forward(q, k, v, meta)

    engine.attention = Logged()
    run_host(engine, LONG)
    for other in OTHERS:
        run_host(engine, other)
    cuda.log.clear()
    result = run_host(engine, [*LONG, 11, 12])
    assert result.meta["host_tokens"] == 96 and result.token_ids == expected
    loads = engine.kv.copier.loads
    assert loads == 6  # one per 16-token host page
    log = cuda.log
    first_wait = next(i for i, entry in enumerate(log) if entry[0] == "wait_event")
    # Each load: the copy stream waits for the compute stream, then records one event per
    # layer and one when done; all before the forward first waits.
    assert [e[0] for e in log[:first_wait]] == (["wait_stream"] + ["record"] * (layers + 1)) * 6
    waits = [i for i, entry in enumerate(log) if entry[0] == "wait_event"]
    reads = [i for i, entry in enumerate(log) if entry[0] == "read"]
    assert len(waits) == layers  # once per layer, in the first forward after the loads
    assert all(w < r for w, r in zip(waits, reads[:layers], strict=True))
    assert all(reads[k] < waits[k + 1] for k in range(layers - 1))  # layer by layer
    idle_check(engine)
