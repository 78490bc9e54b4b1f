"""The Scheduler: continuous batching over the radix cache, prefill first. No tensors.

The loop that drives it (the engine, or the policy lab) is:

    batch = scheduler.step()                        # an extend or a decode batch, or None
    next_ids = model(batch)                         # one token id per entry
    scheduler.process_batch_result(batch, next_ids)
    for req in scheduler.pop_finished(): ...

Every request ends exactly once in `pop_finished()`, with a `finish_reason`: `stop`, `length`,
or `abort` (with a message, e.g. for a request that can never fit). A request retracted under
memory pressure goes back to the queue and is recomputed later; it is never lost or duplicated.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from radixserve.cache.allocator import SLOT_DTYPE
from radixserve.cache.radix import RadixCache, pool_check
from radixserve.errors import CacheInvariantError, InvalidArgumentError
from radixserve.sched.admission import (
    NewTokenRatio,
    chunk_tokens,
    future_need,
    output_reserve,
)
from radixserve.sched.policy import CACHE_AWARE, admission_order, make_schedule_policy
from radixserve.sched.queue import WaitingQueue
from radixserve.sched.request import FinishReason, Req, ReqState, pages


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler options; the CLI flags carry the same names with dashes."""

    schedule_policy: str = "fcfs"
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192
    lpm_fallback_queue_len: int = 128
    schedule_seed: int = 0
    enable_priority_scheduling: bool = False
    priority_preemption_threshold: int = 10
    enable_in_batch_prefix_caching: bool = True
    in_batch_prefix_check_threshold: int = 32
    in_batch_prefix_defer_threshold: int = 32
    max_queue_wait: float | None = 30.0
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    clip_max_new_tokens: int = 4096
    enable_mixed_chunk: bool = False

    def __post_init__(self) -> None:
        make_schedule_policy(self.schedule_policy)
        positive = ("max_running_requests", "chunked_prefill_size", "clip_max_new_tokens")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")
        non_negative = (
            "lpm_fallback_queue_len",
            "priority_preemption_threshold",
            "in_batch_prefix_check_threshold",
            "in_batch_prefix_defer_threshold",
        )
        for name in non_negative:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")
        if self.max_queue_wait is not None and not self.max_queue_wait > 0:
            raise InvalidArgumentError(
                f"max_queue_wait must be > 0 seconds or None, got {self.max_queue_wait!r}"
            )
        NewTokenRatio(
            self.init_new_token_ratio, self.min_new_token_ratio, self.new_token_ratio_decay
        )


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass(slots=True)
class BatchEntry:
    """One request's share of a forward pass.

    The model computes the KV of `token_ids` (at positions `len(prefix_slots)` onwards), writes
    it into `new_slots`, attends over `prefix_slots` plus `new_slots`, and, when `sample` is
    true, returns the next token. `sample` is false for a prefill chunk that is not the last.
    `is_decode` marks a running request's one-token decode; in an extend batch (mixed chunk)
    such entries come after every prefill entry. The slot arrays are views into the request,
    valid until `process_batch_result`; do not write to them.
    """

    req: Req
    token_ids: np.ndarray
    prefix_slots: np.ndarray
    new_slots: np.ndarray
    sample: bool
    is_decode: bool = False


@dataclass(slots=True)
class Batch:
    """An extend batch (prefill chunks, then, when mixed, one decode entry per running
    request) or a decode batch."""

    mode: ForwardMode
    entries: list[BatchEntry]

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class SchedulerStats:
    """Counters since the scheduler was built."""

    extend_batches: int = 0
    decode_batches: int = 0
    mixed_batches: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_prefill_tokens: int = 0
    decode_tokens: int = 0
    retractions: int = 0
    preemptions: int = 0
    evicted_tokens: int = 0
    finished: int = 0
    aborted: int = 0


@dataclass
class _Round:
    """Book-keeping of one extend round."""

    reserved: int
    chunk_left: int
    chunked: bool = False
    entries: list[BatchEntry] = field(default_factory=list)
    heads: set[bytes] = field(default_factory=set)
    deferred: int = 0


class Scheduler:
    """Continuous batching with prefix reuse, chunked prefill, retraction and preemption."""

    def __init__(
        self,
        cache: RadixCache,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_admit: Callable[[Req], None] | None = None,
        before_admit: Callable[[Req], None] | None = None,
    ) -> None:
        """`on_admit(req)` runs after each admission, once `req`'s prefix is matched and locked
        (the policy lab's oracle uses it to learn which future uses have happened).
        `before_admit(req)` runs before a waiting request's prefix is first matched: a lower KV
        tier may put more of its prefix into the tree there."""
        self.cache = cache
        self.allocator = cache.allocator
        self.config = config or SchedulerConfig()
        self.page_size = cache.page_size
        cfg = self.config
        if cfg.chunked_prefill_size < self.page_size:
            raise InvalidArgumentError(
                f"chunked_prefill_size={cfg.chunked_prefill_size} must be at least "
                f"page_size={self.page_size}"
            )
        self.policy = make_schedule_policy(
            cfg.schedule_policy,
            lpm_fallback_queue_len=cfg.lpm_fallback_queue_len,
            seed=cfg.schedule_seed,
        )
        self.ratio = NewTokenRatio(
            cfg.init_new_token_ratio, cfg.min_new_token_ratio, cfg.new_token_ratio_decay
        )
        self.clock = clock
        self.on_admit = on_admit
        self.before_admit = before_admit
        self.waiting = WaitingQueue(by_priority=cfg.enable_priority_scheduling)
        self.prefilling: Req | None = None
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self._finished: list[Req] = []
        self._rids: dict[str, Req] = {}
        self._arrivals = 0
        self._requeue: list[Req] | None = None

    # -- queue ----------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Queue `req`. One that can never fit in the KV pool ends at once as `abort`."""
        if req.rid in self._rids:
            raise InvalidArgumentError(f"request id {req.rid!r} is already in the scheduler")
        if req.state is not ReqState.WAITING or req.output_ids or req.kv_allocated:
            raise InvalidArgumentError(f"request {req.rid!r} is not a fresh request")
        self._rids[req.rid] = req
        req.queued_time = self.clock()
        if req.arrival_time is None:
            req.arrival_time = req.queued_time
        req.arrival_index = self._arrivals
        self._arrivals += 1
        need = pages(len(req.input_ids) + req.sampling.max_new_tokens, self.page_size)
        if need > self.allocator.size:
            self._end(
                req,
                FinishReason(
                    "abort",
                    cause="too_long",
                    message=(
                        f"request needs {need} KV slots (prompt {len(req.input_ids)} + "
                        f"max_new_tokens {req.sampling.max_new_tokens}) but the KV pool holds "
                        f"{self.allocator.size}"
                    ),
                ),
            )
            return
        self.waiting.add(req)

    def abort(self, rid: str, message: str = "aborted", cause: str = "client") -> bool:
        """End request `rid` as `abort` for `cause`, releasing everything it holds.

        Works in any state, including between `step()` and `process_batch_result()` for a
        request in the batch in flight: only KV computed by earlier steps enters the tree.
        False if `rid` is unknown or already ended.
        """
        req = self._rids.get(rid)
        if req is None or req.finished:
            return False
        if req.state is ReqState.WAITING:
            self.waiting.remove(req)
        else:
            self._release(req, finished=True)
        self._end(req, FinishReason("abort", message=message, cause=cause))
        return True

    def request_ids(self) -> list[str]:
        """Every request the scheduler holds, in any state short of finished."""
        return list(self._rids)

    def finish(self, rid: str, reason: FinishReason) -> bool:
        """End a running request early with `reason` (e.g. a stop string the engine matched)."""
        req = self._rids.get(rid)
        if req is None or req.state is not ReqState.RUNNING:
            return False
        self._release(req, finished=True)
        self._end(req, reason)
        return True

    def pop_finished(self) -> list[Req]:
        """Requests that ended since the last call, each exactly once."""
        done, self._finished = self._finished, []
        return done

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def has_finished(self) -> bool:
        """True when requests ended that `pop_finished()` has not returned yet."""
        return bool(self._finished)

    # -- slots ----------------------------------------------------------------------------

    def _alloc(self, n: int) -> np.ndarray | None:
        short = n - self.allocator.available_size()
        if short > 0:
            self.stats.evicted_tokens += self.cache.evict(short)
        return self.allocator.alloc(n)

    def _capacity(self) -> int:
        return self.allocator.available_size() + self.cache.evictable_size()

    def _release(self, req: Req, finished: bool) -> None:
        """Give the request's whole computed pages to the tree; free or keep the rest.

        With `finished` false the request keeps its KV: its slots are re-pointed at the tree's
        copy before any duplicate of its own is freed, so no slot is both in use and free. With
        `finished` true everything it holds is released and its prefix unlocked.
        """
        cache, slots = self.cache, req.kv_slots
        aligned = req.kv_len - req.kv_len % self.page_size
        if not cache.disable and aligned > req.cached_len:
            key = req.token_ids(aligned)
            inserted = cache.insert(
                key, slots[:aligned], priority=req.priority, extra_key=req.extra_key
            )
            duplicates = slots[req.cached_len : inserted].copy()
            if not finished:
                match = cache.match_prefix(key, req.extra_key, count_hit=False)
                slots[:aligned] = match.indices
                cache.inc_lock_ref(match.last_node)
                cache.dec_lock_ref(req.last_node)
                req.last_node, req.cached_len = match.last_node, aligned
                if duplicates.size:
                    self.allocator.free(duplicates)
                return
            to_free = np.concatenate([duplicates, slots[aligned : req.kv_allocated]])
        elif finished:
            to_free = slots[req.cached_len : req.kv_allocated]
        else:
            return
        if to_free.size:
            self.allocator.free(to_free)
        if req.last_node is not None:
            cache.dec_lock_ref(req.last_node)
        req.reset_kv()

    def _end(self, req: Req, reason: FinishReason) -> None:
        req.reset_kv()
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.finish_time = self.clock()
        if req in self.running:
            self.running.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        del self._rids[req.rid]
        self._finished.append(req)
        self.stats.finished += 1
        if reason.kind == "abort":
            self.stats.aborted += 1

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue; its computed KV stays in the tree."""
        self._release(req, finished=True)
        if req in self.running:
            self.running.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        req.state = ReqState.WAITING
        req.queued_time = self.clock()
        req.num_retractions += 1
        if self._requeue is not None:  # preempted while the queue is being read: after it
            self._requeue.append(req)
        else:
            self.waiting.add(req)  # back at its arrival position

    # -- step -----------------------------------------------------------------------------

    def step(self) -> Batch | None:
        """The next batch: an extend batch when any prefill can be admitted, else a decode batch."""
        batch = self._schedule_extend()
        if batch is None and self.running:
            batch = self._schedule_decode()
        return batch

    def _reserved(self) -> int:
        cfg, ratio = self.config, self.ratio.value
        reqs = self.running + ([self.prefilling] if self.prefilling else [])
        return sum(future_need(r, ratio, cfg.clip_max_new_tokens, self.page_size) for r in reqs)

    def _schedule_extend(self) -> Batch | None:
        if not self.waiting and self.prefilling is None:
            return None
        budget = self.config.chunked_prefill_size
        if self.config.enable_mixed_chunk and self.running:
            pending = sum(r.seq_len - r.kv_len for r in self.running)
            budget = max(self.page_size, budget - pending)
        rnd = _Round(reserved=self._reserved(), chunk_left=budget)
        req = self.prefilling
        if req is not None:
            own_need = self._future_need(req)
            rnd.reserved -= own_need
            if not self._add_chunk(req, rnd, first=not self.running):
                rnd.reserved += own_need
                rnd.chunked = True
        if not rnd.chunked and self.waiting:
            self._admit_waiting(rnd)
        if not rnd.entries:
            return None
        self.stats.extend_batches += 1
        if self.config.enable_mixed_chunk and self.running:
            decode = self._decode_entries(retract=False)
            if decode:
                rnd.entries.extend(decode)
                self.stats.mixed_batches += 1
        return Batch(ForwardMode.EXTEND, rnd.entries)

    def _future_need(self, req: Req) -> int:
        return future_need(req, self.ratio.value, self.config.clip_max_new_tokens, self.page_size)

    def _admit_waiting(self, rnd: _Round) -> None:
        cfg = self.config
        full = len(self.running) + len(rnd.entries) >= cfg.max_running_requests
        if full and not cfg.enable_priority_scheduling:
            return  # nothing could be admitted or preempted for: skip ordering the queue
        ordered = admission_order(
            self.waiting, self.policy, self.cache, self.clock(), max_queue_wait=cfg.max_queue_wait
        )
        defer = cfg.enable_in_batch_prefix_caching and self.policy.name in CACHE_AWARE
        self._requeue = []
        try:
            self._admit_in_order(ordered, rnd, defer)
        finally:
            for req in self._requeue:
                self.waiting.add(req)
            self._requeue = None

    def _admit_in_order(self, ordered, rnd: _Round, defer: bool) -> None:
        """Admit from `ordered` until a request cannot be admitted or the round is full."""
        cfg = self.config
        for req in ordered:
            if rnd.chunk_left < self.page_size:
                break
            # Deferral skips requests, so a round skips at most the policy's window of them.
            if defer and rnd.deferred < self.policy.window and self._defer_in_batch(req, rnd):
                rnd.deferred += 1
                continue
            full = len(self.running) + len(rnd.entries) >= cfg.max_running_requests
            if full and not self._preempt_for(req, rnd, slots_only=True):
                break
            admitted = self._admit(req, rnd)
            if not admitted and self._preempt_for(req, rnd, slots_only=False):
                admitted = self._admit(req, rnd)
            if not admitted or rnd.chunked:
                break

    def _defer_in_batch(self, req: Req, rnd: _Round) -> bool:
        """True when `req` should wait a round for an earlier request's prefix to be cached."""
        cfg = self.config
        need = cfg.in_batch_prefix_defer_threshold
        if len(req.input_ids) < need or need == 0:
            return False
        if req.input_ids[:need].tobytes() not in rnd.heads:
            return False
        cached = self.cache.peek_prefix(req.token_ids(), req.extra_key)
        return cached <= cfg.in_batch_prefix_check_threshold

    def _admit(self, req: Req, rnd: _Round) -> bool:
        """Match and lock `req`'s prefix and add its first chunk, or leave everything as it was."""
        if self.before_admit is not None and req.cached_tokens is None:
            self.before_admit(req)
        # The last token is always computed, so that the model can sample the next one.
        match = self.cache.match_prefix(req.token_ids(req.seq_len - 1), req.extra_key)
        self.cache.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.cached_len = req.kv_len = match.prefix_len
        req.append_slots(match.indices)
        if not self._add_chunk(req, rnd, first=not self.running and not rnd.entries):
            self.cache.dec_lock_ref(match.last_node)
            req.reset_kv()
            return False
        if req.cached_tokens is None:
            req.cached_tokens = match.prefix_len
            self.stats.prompt_tokens += len(req.input_ids)
            self.stats.cached_prompt_tokens += match.prefix_len
        req.prefix_len = match.prefix_len
        self.waiting.remove(req)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
        head = self.config.in_batch_prefix_defer_threshold
        if head and len(req.input_ids) >= head:
            rnd.heads.add(req.input_ids[:head].tobytes())
        if self.on_admit is not None:
            self.on_admit(req)
        return True

    def _add_chunk(self, req: Req, rnd: _Round, first: bool) -> bool:
        """Allocate and list `req`'s next prefill chunk if memory and the chunk budget allow.

        `first` (nothing else runs or is in the batch): admitted whenever the chunk itself fits
        in free plus evictable memory. Otherwise the request's whole future need must fit in
        the budget left after every reservation.
        """
        page = self.page_size
        extend = req.seq_len - req.kv_len
        chunk = chunk_tokens(extend, rnd.chunk_left, page)
        if chunk <= 0:
            return False
        need_now = max(0, pages(req.kv_len + chunk, page) - req.kv_allocated)
        capacity = self._capacity()
        if need_now > capacity or (not first and self._future_need(req) > capacity - rnd.reserved):
            return False
        slots = self._alloc(need_now)
        if slots is None:  # pragma: no cover - capacity was checked above
            raise CacheInvariantError(f"could not allocate {need_now} slots within capacity")
        req.append_slots(slots)
        start = req.kv_len
        rnd.entries.append(
            BatchEntry(
                req,
                req.token_ids(start + chunk)[start:],
                req.kv_slots[:start],
                req.kv_slots[start : start + chunk],
                sample=chunk == extend,
            )
        )
        rnd.chunk_left -= chunk
        rnd.reserved += self._future_need(req)
        req.state = ReqState.PREFILLING
        if chunk < extend:
            self.prefilling = req
            rnd.chunked = True
        return True

    def _preempt_for(self, req: Req, rnd: _Round, slots_only: bool) -> bool:
        """Retract lower-priority running requests so `req` can be admitted; True if any were."""
        cfg = self.config
        if not cfg.enable_priority_scheduling:
            return False
        victims = [
            r for r in self.running if req.priority - r.priority > cfg.priority_preemption_threshold
        ]
        if not victims:
            return False
        victims.sort(key=lambda r: (r.priority, len(r.output_ids)))
        ratio, clip, page = self.ratio.value, cfg.clip_max_new_tokens, self.page_size
        if slots_only:
            chosen = victims[:1]
        else:
            gap = future_need(req, ratio, clip, page) - (self._capacity() - rnd.reserved)
            chosen, gained = [], 0
            for r in victims:
                if gained >= gap:
                    break
                chosen.append(r)
                gained += (r.kv_allocated - r.cached_len) + output_reserve(r, ratio, clip, page)
            if gained < gap:
                return False
        for r in chosen:
            rnd.reserved -= future_need(r, ratio, clip, page)
            self._retract(r)
            self.stats.preemptions += 1
        return True

    def _schedule_decode(self) -> Batch | None:
        entries = self._decode_entries(retract=True)
        if not entries:
            return None
        self.stats.decode_batches += 1
        mode = ForwardMode.DECODE if entries[0].is_decode else ForwardMode.EXTEND
        return Batch(mode, entries)

    def _slots_short(self, req: Req) -> int:
        """Slots `req` lacks for the KV of every token it holds (pages, 0 when it has them)."""
        return max(0, pages(req.seq_len, self.page_size) - req.kv_allocated)

    def _decode_entries(self, retract: bool) -> list[BatchEntry]:
        """One entry per running request, with slots for the tokens whose KV is not computed:
        its last sampled token, plus any forced after it (`append_forced`). Entries of several
        tokens are extend entries (`is_decode` false) and come first.

        Short of memory, `retract` sends requests back to the queue until the rest fit; without
        it (a decode riding in an extend batch) nothing is decoded this step instead.
        """
        if not retract and sum(self._slots_short(r) for r in self.running) > self._capacity():
            return []
        retracted = False
        while True:
            if sum(self._slots_short(r) for r in self.running) <= self._capacity():
                break
            if self.prefilling is not None:
                victim = self.prefilling
            elif len(self.running) == 1:
                (req,) = self.running
                self._release(req, finished=True)
                self._end(req, FinishReason("abort", message="out of KV memory", cause="memory"))
                return []
            else:
                victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            self._retract(victim)
            self.stats.retractions += 1
            retracted = True
        if retracted:
            self.ratio.reestimate(self.running)
        for r in self.running:
            short = self._slots_short(r)
            if short:
                slots = self._alloc(short)
                if slots is None:  # pragma: no cover - capacity was checked above
                    raise CacheInvariantError("could not allocate a decode page within capacity")
                r.append_slots(slots)
        entries = []
        for r in self.running:
            n = r.seq_len - r.kv_len
            entries.append(
                BatchEntry(
                    r,
                    np.array(r.output_ids[-n:], dtype=np.int32),
                    r.kv_slots[: r.kv_len],
                    r.kv_slots[r.kv_len : r.kv_len + n],
                    sample=True,
                    is_decode=n == 1,
                )
            )
        entries.sort(key=lambda e: e.is_decode)  # stable: several-token entries first
        self.ratio.step()
        return entries

    # -- results --------------------------------------------------------------------------

    def process_batch_result(self, batch: Batch, next_token_ids: Sequence[int]) -> list[Req]:
        """Apply one forward's sampled tokens; return the requests that finished with it."""
        if len(next_token_ids) != len(batch.entries):
            raise InvalidArgumentError(
                f"got {len(next_token_ids)} next tokens for a batch of {len(batch.entries)}"
            )
        done_before = len(self._finished)
        now = self.clock()
        for entry, token in zip(batch.entries, next_token_ids, strict=True):
            req = entry.req
            if req.finished or req.state is ReqState.WAITING:
                continue
            req.kv_len += len(entry.token_ids)
            if req.state is ReqState.RUNNING:
                self.stats.decode_tokens += len(entry.token_ids)
            else:
                self.stats.computed_prefill_tokens += len(entry.token_ids)
                self._release(req, finished=False)
                if not entry.sample:
                    continue
                if self.prefilling is req:
                    self.prefilling = None
                req.state = ReqState.RUNNING
                self.running.append(req)
            reason = self._append_token(req, int(token), now)
            if reason is not None:
                self._release(req, finished=True)
                self._end(req, reason)
        return self._finished[done_before:]

    def append_forced(self, rid: str, tokens: Sequence[int]) -> bool:
        """Append tokens a running request's grammar forces, as if decoded one by one (stop
        tokens and `max_new_tokens` apply; the request may end here). Their KV is computed
        with the next decode. False if `rid` is not running."""
        req = self._rids.get(rid)
        if req is None or req.state is not ReqState.RUNNING:
            return False
        now = self.clock()
        for token in tokens:
            reason = self._append_token(req, int(token), now)
            if reason is not None:
                self._release(req, finished=True)
                self._end(req, reason)
                break
        return True

    def _append_token(self, req: Req, token: int, now: float) -> FinishReason | None:
        if req.remaining_new_tokens() == 0:
            return FinishReason("length")
        req.output_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        if token in req.sampling.stop_token_ids:
            return FinishReason("stop", matched=token)
        if token in req.eos_token_ids and not req.sampling.ignore_eos:
            return FinishReason("stop", matched=token)
        if req.remaining_new_tokens() == 0:
            return FinishReason("length")
        return None

    def run_step(self, model: Callable[[Batch], Sequence[int]]) -> Batch | None:
        """One scheduling step with `model` standing in for the forward pass."""
        batch = self.step()
        if batch is not None:
            self.process_batch_result(batch, model(batch))
        return batch

    # -- checks ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The cache's invariants, plus: tree + request-owned + free slots are exactly the pool."""
        self.cache.check_invariants()
        active = self.running + ([self.prefilling] if self.prefilling else [])
        for req in active:
            if not req.kv_len <= req.kv_allocated or req.kv_allocated % self.page_size:
                raise CacheInvariantError(
                    f"request {req.rid}: kv_len={req.kv_len}, kv_allocated={req.kv_allocated}"
                )
            if req.cached_len and (req.last_node is None or req.last_node.lock_ref < 1):
                raise CacheInvariantError(f"request {req.rid}: cached prefix is not locked")
        for req in self.waiting:
            if req.kv_allocated or req.last_node is not None:
                raise CacheInvariantError(f"waiting request {req.rid} still holds KV")
        held = [r.own_slots() for r in active] or [np.empty(0, dtype=SLOT_DTYPE)]
        pool_check(self.cache, held)
