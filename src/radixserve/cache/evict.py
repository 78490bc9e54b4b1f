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

Register a policy under a name with `register_eviction_policy(name, factory)`, or pass an
instance straight to `RadixCache(eviction_policy=...)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from radixserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from radixserve.cache.radix import TreeNode


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


_REGISTRY: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
    "mru": MRUPolicy,
    "filo": FILOPolicy,
    "priority": PriorityPolicy,
    "slru": SLRUPolicy,
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
