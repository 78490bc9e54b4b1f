"""Routing policies: which replica serves a request. Plain objects, no torch, no HTTP.

The lab (`radixserve.sim.cluster`) replays them over simulated replicas; a server-side router
would call the same objects. A policy sees each replica as a `ReplicaLoad` and the request as
a `RouteRequest`, and returns a replica index:

- `round_robin`: in turn.
- `pow2`: the less loaded of two replicas drawn at random (power of two choices).
- `cache_aware`: SGLang router semantics. Each replica has an approximate tree of the prefixes
  routed to it (here: the set of page digests, capped, least recently routed out). When the
  load is imbalanced (max - min > `balance_abs_threshold` and max > min x
  `balance_rel_threshold`) the least loaded replica wins. Otherwise the best prefix match wins
  if it covers more than `cache_threshold` of the prompt, else the replica with the smallest
  tree (the most room).
- `precise`: a global page index fed by the replicas' KV events (`BlockStored`,
  `BlockRemoved`, `AllBlocksCleared`), so it knows what each replica holds rather than guess;
  pages of requests it routed that no event has confirmed yet count as expected there, so a
  burst sharing a prefix is not split while the first of it is still being prefilled.
  Cost of replica r = `prefill_weight` x the prompt tokens r would compute + r's load (queued
  prompt tokens + `decode_weight` x running requests) + `age_weight` x how long r's oldest
  queued request has waited. `prefill_weight` is 2: a token computed for lack of a cached copy
  is waited on by this request and is also work added to the cluster, while a queued token is
  only waited on. The age term steers new work away from a replica whose queue
  is starving, so a request cannot be pushed back forever by traffic that keeps hitting the
  same cache.

Every policy honours sticky sessions: a request with a `session` goes where the session's
last request went, unless that replica's load is `sticky_max_load_ratio` x the mean or more.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixserve.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from radixserve.cache.hashing import hash_pages, leading_pages, remember_pages
from radixserve.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router knows of a request: its prompt, namespace and session."""

    input_ids: Sequence[int]
    extra_key: object | None = None
    session: str | None = None


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as a router sees it."""

    queued_requests: int = 0
    queued_tokens: int = 0
    running_requests: int = 0
    oldest_wait: float = 0.0

    @property
    def requests(self) -> int:
        return self.queued_requests + self.running_requests


class RoutingPolicy:
    """Chooses a replica. `on_events` feeds a replica's KV events; `on_finish` may be told
    when a request ends. Subclasses implement `_choose`."""

    name = ""

    def __init__(self, replicas: int, page_size: int = 1, sticky_max_load_ratio: float = 2.0):
        if not isinstance(replicas, int) or replicas < 1:
            raise InvalidArgumentError(f"replicas must be an integer >= 1, got {replicas!r}")
        self.replicas = replicas
        self.page_size = page_size
        self.sticky_max_load_ratio = sticky_max_load_ratio
        self._sessions: OrderedDict[str, int] = OrderedDict()

    def choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> int:
        """The replica (index into `loads`) that serves `request`."""
        if len(loads) != self.replicas:
            raise InvalidArgumentError(f"expected {self.replicas} replica loads, got {len(loads)}")
        target = None
        if request.session is not None:
            target = self._sessions.get(request.session)
            if target is not None:
                mean = sum(load.requests for load in loads) / len(loads)
                if loads[target].requests >= max(1.0, self.sticky_max_load_ratio * mean) + 1:
                    target = None
        if target is None:
            target = self._choose(request, loads)
        if request.session is not None:
            self._sessions[request.session] = target
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > 100_000:
                self._sessions.popitem(last=False)
        self._routed(request, target)
        return target

    def _choose(self, request: RouteRequest, loads: Sequence[ReplicaLoad]) -> int:
        raise NotImplementedError

    def _routed(self, request: RouteRequest, replica: int) -> None:
        """Called with every decision (sticky ones included)."""

    def on_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        """KV events a replica published, in order."""

    def forget(self, replica: int) -> None:
        """Drop what `replica` was thought to hold (it died, restarted or went silent)."""

    def page_hashes(self, request: RouteRequest) -> list[bytes]:
        """The chained digests of the prompt's whole pages, as the replicas' trees name them."""
        return hash_pages(request.input_ids, self.page_size, request.extra_key)


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, replicas: int, **options) -> None:
        super().__init__(replicas, **options)
        self._next = 0

    def _choose(self, request, loads) -> int:
        target = self._next
        self._next = (self._next + 1) % self.replicas
        return target


def _least_loaded(loads: Sequence[ReplicaLoad], among: Sequence[int]) -> int:
    return min(among, key=lambda i: (loads[i].queued_tokens, loads[i].requests, i))


class PowerOfTwo(RoutingPolicy):
    name = "pow2"

    def __init__(self, replicas: int, seed: int = 0, **options) -> None:
        super().__init__(replicas, **options)
        self._rng = random.Random(seed)

    def _choose(self, request, loads) -> int:
        if self.replicas == 1:
            return 0
        a, b = self._rng.sample(range(self.replicas), 2)
        return min((a, b), key=lambda i: (loads[i].requests, loads[i].queued_tokens, i))


class CacheAware(RoutingPolicy):
    name = "cache_aware"

    def __init__(
        self,
        replicas: int,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        max_tree_pages: int = 1 << 20,
        **options,
    ) -> None:
        super().__init__(replicas, **options)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_pages = max_tree_pages
        self._trees: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]
        self._hashes: list[bytes] = []

    def _choose(self, request, loads) -> int:
        counts = [load.requests for load in loads]
        low, high = min(counts), max(counts)
        self._hashes = hashes = self.page_hashes(request)
        if high - low > self.balance_abs_threshold and high > low * self.balance_rel_threshold:
            return counts.index(low)
        matched = [leading_pages(hashes, tree) for tree in self._trees]
        best = max(range(self.replicas), key=lambda i: (matched[i], -counts[i]))
        total = max(1, len(request.input_ids) // self.page_size)
        if hashes and matched[best] / total > self.cache_threshold:
            return best
        return min(range(self.replicas), key=lambda i: (len(self._trees[i]), counts[i], i))

    def _routed(self, request, replica) -> None:
        hashes = self._hashes if self._hashes else self.page_hashes(request)
        self._hashes = []
        remember_pages(self._trees[replica], hashes, self.max_tree_pages)

    def forget(self, replica: int) -> None:
        self._trees[replica].clear()


class Precise(RoutingPolicy):
    name = "precise"

    def __init__(
        self,
        replicas: int,
        prefill_weight: float = 2.0,
        decode_weight: float = 16.0,
        age_weight: float = 1000.0,
        expected_pages: int = 65_536,
        **options,
    ) -> None:
        super().__init__(replicas, **options)
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.age_weight = age_weight
        self.expected_pages = expected_pages
        self._index: dict[bytes, set[int]] = {}
        self._held: list[set[bytes]] = [set() for _ in range(replicas)]
        # Pages of requests routed to a replica whose events have not confirmed them yet: a
        # burst of one prefix must not be split before the first of it is prefilled.
        self._expected: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(replicas)]
        self._hashes: list[bytes] = []

    def _routed(self, request, replica) -> None:
        hashes, self._hashes = self._hashes or self.page_hashes(request), []
        unconfirmed = [h for h in hashes if replica not in self._index.get(h, ())]
        remember_pages(self._expected[replica], unconfirmed, self.expected_pages)

    def on_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        held = self._held[replica]
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self._index.setdefault(h, set()).add(replica)
                    held.add(h)
                    self._expected[replica].pop(h, None)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._drop(h, replica)
            elif isinstance(event, AllBlocksCleared):
                for h in list(held):
                    self._drop(h, replica)
                self._expected[replica].clear()

    def forget(self, replica: int) -> None:
        """Drop everything `replica` was known to hold (it died or stopped publishing)."""
        self.on_events(replica, [AllBlocksCleared()])

    def _drop(self, h: bytes, replica: int) -> None:
        self._held[replica].discard(h)
        owners = self._index.get(h)
        if owners is not None:
            owners.discard(replica)
            if not owners:
                del self._index[h]

    def cached_tokens(self, request: RouteRequest, hashes: list[bytes] | None = None) -> list[int]:
        """Prompt tokens each replica holds as a cached prefix, per the events so far and the
        requests routed to it since (whose pages it will hold once they are prefilled)."""
        out = [0] * self.replicas
        alive = set(range(self.replicas))
        hashes = self.page_hashes(request) if hashes is None else hashes
        for depth, h in enumerate(hashes, start=1):
            owners = self._index.get(h, set())
            alive = {r for r in alive if r in owners or h in self._expected[r]}
            if not alive:
                break
            for r in alive:
                out[r] = depth * self.page_size
        return out

    def _choose(self, request, loads) -> int:
        self._hashes = self.page_hashes(request)
        cached = self.cached_tokens(request, self._hashes)
        prompt = len(request.input_ids)

        def cost(r: int) -> tuple[float, int]:
            load = loads[r]
            work = load.queued_tokens + self.decode_weight * load.running_requests
            score = (
                self.prefill_weight * (prompt - cached[r])
                + work
                + self.age_weight * load.oldest_wait
            )
            return score, r

        return min(range(self.replicas), key=cost)


ROUTING_POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobin, PowerOfTwo, CacheAware, Precise)
}


def make_routing_policy(name: str, replicas: int, **options) -> RoutingPolicy:
    """A routing policy by name (`ROUTING_POLICIES`); an unknown name raises, listing them."""
    if name not in ROUTING_POLICIES:
        raise InvalidArgumentError(
            f"router must be one of {sorted(ROUTING_POLICIES)}, got {name!r}", field="router"
        )
    return ROUTING_POLICIES[name](replicas, **options)
