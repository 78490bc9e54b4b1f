"""Eviction policies: the order in which unlocked leaves leave the radix tree.

A policy is a strategy object, separate from the tree. The tree keeps its evictable leaves in a
heap ordered by `policy.key(node)` and evicts the smallest key first. A policy is anything with:

- `name: str`;
- `key(node) -> comparable`: smaller keys leave first. Keys of different nodes must be mutually
  comparable; ties leave in the order the leaves became evictable;
- `tracks_access: bool`: whether `key` reads fields that `match_prefix` and `insert` change on
  the nodes they reach (`last_access_time`, `hit_count`, `priority`). When it is false, the tree
  skips re-keying on access.

`key` may read any public field of `TreeNode`: `last_access_time`, `creation_time`,
`hit_count`, `priority`, `lock_ref`, `parent`, `children` and `len(node)`. The tree computes a
key when a node becomes an evictable leaf and again whenever a field above changes on it; the
cache's `check_invariants()` verifies that every stored key equals `policy.key(node)`, so a key
must not depend on anything else that changes over time.

Optional hooks, for policies that keep state of their own (the tree calls each only if the
policy defines it):

- `bind(cache)`: the tree was created or reset; the policy drops its state and may keep the
  cache, to read its sizes or to call `cache.refresh_eviction_key(node)` when a key it gave
  changes for a reason the tree cannot see;
- `on_insert(node)`: a new leaf joined the tree, before its key is first asked for;
- `on_evict(node, key, now)`: a leaf leaves the tree by eviction, still linked to its parent;
- `on_reference(node, cached)`: `insert` placed a sequence whose path ends at `node`, and its
  first `cached` tokens were in the tree before (a request's use of the cache, hits included).

`TreeNode.eviction_state` belongs to the policy: the tree sets it to None on every new node
(including the upper half of a split) and never reads it.

Register a policy under a name with `register_eviction_policy(name, factory)`, or pass an
instance straight to `RadixCache(eviction_policy=...)`.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from radixserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from radixserve.cache.radix import RadixCache, TreeNode


@runtime_checkable
class EvictionPolicy(Protocol):
    """The contract every eviction policy meets (see the module docstring)."""

    name: str
    tracks_access: bool

    def key(self, node: TreeNode) -> Any:
        """The node's eviction key; the smallest key is evicted first."""
        ...


class LRUPolicy:
    """Least recently used first: the oldest `last_access_time`."""

    name = "lru"
    tracks_access = True

    def key(self, node: TreeNode) -> float:
        return node.last_access_time


class LFUPolicy:
    """Least frequently used first: the lowest `(hit_count, last_access_time)`."""

    name = "lfu"
    tracks_access = True

    def key(self, node: TreeNode) -> tuple[int, float]:
        return (node.hit_count, node.last_access_time)


class FIFOPolicy:
    """First in, first out: the oldest `creation_time`."""

    name = "fifo"
    tracks_access = False

    def key(self, node: TreeNode) -> float:
        return node.creation_time


class MRUPolicy:
    """Most recently used first: the newest `last_access_time`."""

    name = "mru"
    tracks_access = True

    def key(self, node: TreeNode) -> float:
        return -node.last_access_time


class FILOPolicy:
    """First in, last out: the newest `creation_time`."""

    name = "filo"
    tracks_access = False

    def key(self, node: TreeNode) -> float:
        return -node.creation_time


class PriorityPolicy:
    """Lowest priority first, then least recently used: `(priority, last_access_time)`."""

    name = "priority"
    tracks_access = True

    def key(self, node: TreeNode) -> tuple[float, float]:
        return (node.priority, node.last_access_time)


class SLRUPolicy:
    """Segmented LRU: probationary nodes (`hit_count < threshold`) first, each segment by LRU."""

    name = "slru"
    tracks_access = True

    def __init__(self, threshold: int = 2) -> None:
        if not isinstance(threshold, int) or threshold < 1:
            raise InvalidArgumentError(f"slru threshold must be an integer >= 1, got {threshold!r}")
        self.threshold = threshold

    def key(self, node: TreeNode) -> tuple[bool, float]:
        return (node.hit_count >= self.threshold, node.last_access_time)


def prefix_identity(node: TreeNode, page_bytes: int) -> int:
    """A hash naming where `node` starts: its namespace, every token above it, its first page.

    Equal for a node and a later node holding the same tokens at the same place, even when
    nodes above were split or evicted and cached again in between.
    """
    parts = []
    walker = node.parent
    while walker is not None and walker.parent is not None:
        parts.append(walker.key)
        walker = walker.parent
    parts.reverse()
    parts.append(node.key[:page_bytes])
    return hash((node.extra_key, b"".join(parts)))


_WINDOW, _PROBATION, _PROTECTED = "window", "probation", "protected"


class _State:
    """What WindowedGreedyDualPolicy knows of one node."""

    __slots__ = ("identity", "key_bytes", "level", "segment", "size", "stamp")

    def __init__(self, segment: str, identity: int, key_bytes: int, size: int = 0) -> None:
        self.segment = segment
        self.size = size
        self.stamp = 0
        self.level = 0.0
        self.identity = identity  # prefix_identity while the edge is key_bytes long
        self.key_bytes = key_bytes


class WindowedGreedyDualPolicy:
    """GreedyDual priorities over a recency window, a scan-resistant probation and hit nodes.

    Every evictable leaf has a GreedyDual priority H (Young 1994; Cao and Irani 1997; GDSF,
    Cherkasova 1998), and the lowest H leaves first. L, the inflation level, is the H of the
    last leaf evicted, as it stood when a node was last used; its rise ages out nodes that
    were valuable once. A leaf's H depends on its segment:

    - **window**: the newest leaves, up to `window` x the pool's tokens. H = L + 1, as for a
      node worth one use, so what a request creates stays until its immediate follow-ups (the
      next turn, a child thought) have had a chance to reuse it.
    - **protected**: nodes that were hit, or that were cached again soon after being evicted
      (a ghost hit, as in ARC's B1 list: Megiddo and Modha, FAST 2003).
      H = L + log2(2 + hit_count): frequent nodes stay longer.
    - **probation**: nodes that left the window without a hit. H = L as it stood when they left;
      at equal H the most recently demoted goes first. While L stands still, residents that
      got in earlier are kept, so a stream of one-off or cyclic requests longer than the cache
      cannot flush them: the admission rule of LIRS (Jiang and Zhang, SIGMETRICS 2002) and
      W-TinyLFU (Einziger et al., ACM ToS 2017), where a newcomer with no history does not
      displace an incumbent that has none either. Once L rises, old probation nodes go first.

    Ghosts are the prefix identities (`prefix_identity`) of never-hit nodes that were evicted,
    kept up to `ghost` x the pool's tokens, oldest dropped first.

    When to use it: a cache of a few percent of the working set under mixed traffic, where LRU
    flushes shared prefixes with one-off tails or cycles through more sessions than fit. With a
    cache near the working set it does about what LRU does. It is online: it reads only the
    tree and the past. Costs: O(log n) per key as for LRU, a binary search over L's history
    per key of a used node, and one walk up the node's path per insertion and per eviction of
    a never-hit node (hashing its prefix). L's history grows by one entry per eviction that
    raises L, and is cut back to the oldest use still in the tree as it doubles.
    """

    name = "wgd"
    tracks_access = True

    def __init__(self, window: float = 0.1, ghost: float = 2.0) -> None:
        if not 0 < window < 1:
            raise InvalidArgumentError(f"wgd window must be in (0, 1), got {window!r}")
        if not ghost >= 0:
            raise InvalidArgumentError(f"wgd ghost must be >= 0, got {ghost!r}")
        self.window = window
        self.ghost = ghost
        self.bind(None)

    def bind(self, cache: RadixCache | None) -> None:
        """Start afresh for `cache` (called by the tree when it is created or reset)."""
        self.cache = cache
        pool = cache.allocator.size if cache is not None else 0
        self._page_bytes = 4 * cache.page_size if cache is not None else 4
        self._window_limit = self.window * pool
        self._ghost_limit = self.ghost * pool
        self._window: deque[TreeNode] = deque()
        self._window_tokens = 0
        self._demotions = 0
        self._ghosts: OrderedDict[int, int] = OrderedDict()
        self._ghost_tokens = 0
        # L as a step function of time: L(t) is the level after the evictions before t.
        self._level_times = [-math.inf]
        self._levels = [0.0]
        self._compact_at = 1024

    def level_at(self, t: float) -> float:
        """L as it stood just before time `t`."""
        return self._levels[bisect.bisect_left(self._level_times, t) - 1]

    def _compact_levels(self) -> None:
        """Drop L's history from before the oldest `last_access_time` in the tree.

        A key reads L only at a node's `last_access_time`, so no key, now or later, asks for an
        earlier time; the level in force then becomes the history's first entry, and no key
        changes. Runs when the history has doubled past the node count, so it costs O(1) per
        eviction on average.
        """
        nodes = self.cache._nodes() if self.cache is not None else []
        oldest = min((node.last_access_time for node in nodes), default=math.inf)
        cut = bisect.bisect_left(self._level_times, oldest) - 1
        if cut > 0:
            self._levels = [self._levels[cut], *self._levels[cut + 1 :]]
            self._level_times = [-math.inf, *self._level_times[cut + 1 :]]
        self._compact_at = max(1024, 2 * len(self._levels), 2 * len(nodes))

    def segment(self, node: TreeNode) -> str:
        """The segment `node` is ranked in."""
        state = node.eviction_state
        if node.hit_count or (state is not None and state.segment == _PROTECTED):
            return _PROTECTED
        return _PROBATION if state is None else state.segment

    def key(self, node: TreeNode) -> tuple[float, int, float]:
        if self.segment(node) != _PROBATION:
            t = node.last_access_time
            return (self.level_at(t) + math.log2(2 + node.hit_count), 1, t)
        # Probation: H = L when demoted; at equal H the newest demotion goes first. An upper
        # half of a split that no hit reached has no state: L at its last use, and oldest.
        state = node.eviction_state
        if state is None:
            return (self.level_at(node.last_access_time), 0, 0.0)
        return (state.level, 0, -float(state.stamp))

    def _identity(self, node: TreeNode) -> int:
        """A hash naming where `node` starts (see `prefix_identity`)."""
        return prefix_identity(node, self._page_bytes)

    def on_insert(self, node: TreeNode) -> None:
        identity = self._identity(node)
        size = self._ghosts.pop(identity, None)
        if size is not None:
            self._ghost_tokens -= size
            node.eviction_state = _State(_PROTECTED, identity, len(node.key))
            return
        node.eviction_state = _State(_WINDOW, identity, len(node.key), len(node))
        self._window.append(node)
        self._window_tokens += len(node)
        while self._window_tokens > self._window_limit and self._window:
            oldest = self._window.popleft()
            state = oldest.eviction_state
            if state.segment != _WINDOW:
                continue  # evicted while in the window; its tokens were returned then
            self._window_tokens -= state.size
            self._demotions += 1
            state.segment, state.stamp = _PROBATION, self._demotions
            state.level = self._levels[-1]
            if oldest is not node and oldest.heap_entry is not None and not oldest.hit_count:
                self._demoted(oldest)

    def _demoted(self, node: TreeNode) -> None:
        """`node`, an evictable leaf, left the window for probation: its key changed."""
        self.cache.refresh_eviction_key(node)

    def on_evict(self, node: TreeNode, key: tuple, now: float) -> None:
        state = node.eviction_state
        if state is not None and state.segment == _WINDOW:
            self._window_tokens -= state.size
            state.segment = _PROBATION
        priority, rank, _ = key
        if priority > self._levels[-1]:
            if self._level_times[-1] == now:
                self._levels[-1] = priority
            else:
                self._level_times.append(now)
                self._levels.append(priority)
                if len(self._levels) > self._compact_at:
                    self._compact_levels()
        if rank == 1:
            return
        if not self._ghost_limit:
            return
        if state is not None and state.key_bytes == len(node.key):
            identity = state.identity
        else:  # the upper half of a split, or a lower half that starts further down now
            identity = self._identity(node)
        self._ghost_tokens += len(node) - self._ghosts.pop(identity, 0)
        self._ghosts[identity] = len(node)
        while self._ghost_tokens > self._ghost_limit:
            self._ghost_tokens -= self._ghosts.popitem(last=False)[1]


def _adaptive() -> EvictionPolicy:
    from radixserve.cache.adaptive import AdaptivePolicy

    return AdaptivePolicy()


def _learned_lru() -> EvictionPolicy:
    from radixserve.cache.learned import LearnedLRUPolicy

    return LearnedLRUPolicy()


_REGISTRY: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
    "mru": MRUPolicy,
    "filo": FILOPolicy,
    "priority": PriorityPolicy,
    "slru": SLRUPolicy,
    "wgd": WindowedGreedyDualPolicy,
    "adaptive": _adaptive,
    "learned-lru": _learned_lru,
}


def register_eviction_policy(
    name: str, factory: Callable[[], EvictionPolicy], *, replace: bool = False
) -> None:
    """Make `factory()` selectable as `eviction_policy=name`; shadows a name only with `replace`."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"policy name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not replace:
        raise InvalidArgumentError(f"eviction policy {name!r} is already registered")
    _REGISTRY[name] = factory


def available_eviction_policies() -> list[str]:
    """The registered policy names, sorted."""
    return sorted(_REGISTRY)


def make_eviction_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """Resolve a policy name (or pass an instance through), checking it meets the protocol."""
    if isinstance(policy, str):
        factory = _REGISTRY.get(policy)
        if factory is None:
            raise InvalidArgumentError(
                f"eviction_policy must be one of {available_eviction_policies()}, got {policy!r}"
            )
        policy = factory()
    if not isinstance(policy, EvictionPolicy):
        raise InvalidArgumentError(
            "eviction_policy must be a registered name or an object with name, tracks_access "
            f"and key(node), got {policy!r}"
        )
    return policy
