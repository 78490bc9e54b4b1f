"""RadixCache: KV slots of token sequences, shared by prefix in a radix tree.

Names and semantics follow SGLang's RadixCache (`match_prefix`, `insert`, `evict`,
`inc_lock_ref`, `dec_lock_ref`, `evictable_size`, `protected_size`), with these additions:
`peek_prefix` (a read-only match for queue ordering), `check_invariants`, chained page hashes
and KV events.

Keys are token ids. Pass them as a 1-D numpy int32 array for speed: other integer arrays and
Python sequences are accepted but converted first, which costs about 15 µs per 1,000 tokens.
Internally an edge label is the int32 little-endian bytes of its tokens, so comparing an edge
is one memcmp and a child is found by the bytes of its first page.

Slot values are int64 numpy arrays and are read-only: `match_prefix` returns views of the tree's
own arrays where it can.

Not thread-safe: one engine loop owns a cache.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import numpy as np

from radixserve.cache.allocator import SLOT_DTYPE, PagedTokenToKVPoolAllocator, as_slot_array
from radixserve.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from radixserve.cache.evict import EvictionPolicy, make_eviction_policy
from radixserve.cache.hashing import TOKEN_BYTES, TOKEN_DTYPE, chain_page_hashes, namespace_seed
from radixserve.errors import CacheInvariantError, InvalidArgumentError, LockError

_INT32_MIN, _INT32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max
_EMPTY_SLOTS = np.empty(0, dtype=SLOT_DTYPE)
_EMPTY_SLOTS.flags.writeable = False


class TreeNode:
    """One edge of the tree and the node below it.

    `key` holds the edge's token ids as int32 LE bytes and `value` their KV slots. A root has an
    empty key and no parent. A node that was evicted has a non-empty key and no parent.
    """

    __slots__ = (
        "children",
        "creation_time",
        "eviction_state",
        "extra_key",
        "hashes",
        "heap_entry",
        "hit_count",
        "key",
        "last_access_time",
        "lock_ref",
        "parent",
        "priority",
        "value",
    )

    def __init__(
        self,
        key: bytes,
        value: np.ndarray,
        parent: TreeNode | None,
        now: float,
        extra_key: Hashable | None,
        priority: float = 0,
    ) -> None:
        self.children: dict[bytes, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = priority
        self.hashes: list[bytes] | None = None
        self.heap_entry: list | None = None
        self.extra_key = extra_key
        self.eviction_state: object = None

    def __len__(self) -> int:
        return len(self.value)

    @property
    def token_ids(self) -> np.ndarray:
        """The edge's token ids (int32)."""
        return np.frombuffer(self.key, dtype=TOKEN_DTYPE)

    @property
    def evicted(self) -> bool:
        """True once the node has left the tree."""
        return self.parent is None and bool(self.key)

    def __repr__(self) -> str:
        return (
            f"TreeNode(len={len(self.value)}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)}, hit_count={self.hit_count})"
        )


class MatchResult(NamedTuple):
    """What `match_prefix` found: the prefix's KV slots, the deepest node reached, its length."""

    indices: np.ndarray
    last_node: TreeNode
    prefix_len: int


def encode_key(key: object) -> bytes:
    """Token ids as int32 little-endian bytes; raises `InvalidArgumentError` on non-token input."""
    if isinstance(key, np.ndarray):
        arr = key
    elif isinstance(key, (bytes, str)):
        raise InvalidArgumentError(f"key must be a sequence of token ids, got {type(key).__name__}")
    else:
        if isinstance(key, Sequence) and len(key) == 0:
            return b""
        try:
            arr = np.asarray(key)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"key must be a sequence of token ids: {exc}") from None
    if arr.dtype == TOKEN_DTYPE and arr.ndim == 1:
        return arr.tobytes()
    if arr.ndim != 1:
        raise InvalidArgumentError(f"key must be 1-D token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return b""
        raise InvalidArgumentError(f"key must hold integer token ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX):
        raise InvalidArgumentError("token ids must fit in int32")
    return arr.astype(TOKEN_DTYPE).tobytes()


class RadixCache:
    """A prefix tree from token sequences to the KV slots that hold them.

    The tree owns the slots of its nodes: `evict` and `reset` hand them back to `allocator`.
    Locked nodes (`inc_lock_ref`) are protected and never evicted. Every node's tokens are
    counted exactly once, as evictable (lock_ref == 0) or protected (lock_ref > 0).
    """

    def __init__(
        self,
        allocator: PagedTokenToKVPoolAllocator,
        page_size: int = 1,
        eviction_policy: str | EvictionPolicy = "lru",
        disable: bool = False,
        enable_kv_events: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise InvalidArgumentError(f"page_size must be an integer >= 1, got {page_size!r}")
        if page_size % allocator.page_size:
            raise InvalidArgumentError(
                f"page_size={page_size} must be a multiple of the allocator's page_size="
                f"{allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.policy = make_eviction_policy(eviction_policy)
        self._on_evict = getattr(self.policy, "on_evict", None)
        self._on_insert = getattr(self.policy, "on_insert", None)
        self._on_reference = getattr(self.policy, "on_reference", None)
        self.disable = bool(disable)
        self.enable_kv_events = bool(enable_kv_events)
        self._clock = clock
        self._page_bytes = page_size * TOKEN_BYTES
        # Called with each node `evict` removes, while it and its path are still in the tree
        # and its slots still hold its KV (a host tier's write-back).
        self.evict_listener: Callable[[TreeNode], None] | None = None
        self._events: list[KVCacheEvent] = []
        self._counter = itertools.count()
        self._init_tree()

    def _init_tree(self) -> None:
        self.root_node = self._new_root(None)
        self._roots: dict[Hashable | None, TreeNode] = {None: self.root_node}
        self._heap: list[list] = []
        self._num_evictable_leaves = 0
        self._evictable_size = 0
        self._protected_size = 0
        bind = getattr(self.policy, "bind", None)
        if bind is not None:
            bind(self)  # a new or emptied tree: the policy starts afresh

    def _new_root(self, extra_key: Hashable | None) -> TreeNode:
        root = TreeNode(b"", _EMPTY_SLOTS, None, self._clock(), extra_key)
        root.lock_ref = 1
        root.hashes = []
        return root

    # -- sizes -----------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes: what `evict` could free."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        """Tokens in the tree."""
        return self._evictable_size + self._protected_size

    # -- lookup ----------------------------------------------------------------------------

    def _common_prefix_tokens(self, kb: bytes, pos: int, edge: bytes, end: int) -> int:
        """Whole-page tokens shared by kb[pos:end] and edge; the first page is known equal."""
        count = min(len(edge), end - pos) // TOKEN_BYTES
        mine = np.frombuffer(kb, dtype=TOKEN_DTYPE, count=count, offset=pos)
        theirs = np.frombuffer(edge, dtype=TOKEN_DTYPE, count=count)
        differ = mine != theirs
        first = int(differ.argmax())
        if not differ[first]:
            first = count
        return first - first % self.page_size

    def match_prefix(
        self, key: object, extra_key: Hashable | None = None, *, count_hit: bool = True
    ) -> MatchResult:
        """The longest cached whole-page prefix of `key` in namespace `extra_key`.

        Splits a node when the match ends inside its edge, so `last_node` ends exactly at
        `prefix_len`. Sets `last_access_time` (one clock reading) on every node it reaches, and
        bumps their `hit_count` unless `count_hit` is false (a request re-pointed at the tree's
        copy of what it just inserted is not a reuse). Never changes sizes or slot ownership.
        """
        kb = encode_key(key)
        root = self._roots.get(extra_key)
        if self.disable or root is None:
            return MatchResult(_EMPTY_SLOTS, self.root_node, 0)
        step = self._page_bytes
        end = len(kb) - len(kb) % step
        now = self._clock()
        node = root
        pos = 0
        values = []
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                break
            edge = child.key
            if not kb.startswith(edge, pos):
                child = self._split(child, self._common_prefix_tokens(kb, pos, edge, end))
            child.last_access_time = now
            child.hit_count += count_hit
            values.append(child.value)
            pos += len(child.key)
            node = child
            if len(child.key) != len(edge):
                break
        if node.heap_entry is not None and self.policy.tracks_access:
            self._rekey(node)
        if not values:
            return MatchResult(_EMPTY_SLOTS, root, 0)
        indices = values[0] if len(values) == 1 else np.concatenate(values)
        return MatchResult(indices, node, pos // TOKEN_BYTES)

    def has_namespace(self, extra_key: Hashable | None) -> bool:
        """Whether the tree holds anything under `extra_key` (always true for None)."""
        return extra_key in self._roots

    def peek_prefix(self, key: object, extra_key: Hashable | None = None) -> int:
        """The length `match_prefix` would return, changing nothing at all."""
        return self.peek_node(key, extra_key)[1]

    def peek_node(self, key: object, extra_key: Hashable | None = None) -> tuple[TreeNode, int]:
        """Like `peek_prefix`, also naming the deepest node whose whole edge `key` matches.

        The length may reach into a child of that node when the match ends inside an edge.
        Changes nothing at all.
        """
        kb = encode_key(key)
        root = self._roots.get(extra_key)
        if self.disable or root is None:
            return self.root_node, 0
        step = self._page_bytes
        end = len(kb) - len(kb) % step
        node = root
        pos = 0
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                break
            edge = child.key
            if not kb.startswith(edge, pos):
                return node, (pos // TOKEN_BYTES + self._common_prefix_tokens(kb, pos, edge, end))
            pos += len(edge)
            node = child
        return node, pos // TOKEN_BYTES

    def _split(self, child: TreeNode, tokens: int) -> TreeNode:
        """Cut `child`'s edge after `tokens` tokens; return the new upper node."""
        cut = tokens * TOKEN_BYTES
        parent = child.parent
        upper = TreeNode(
            child.key[:cut], child.value[:tokens], parent, child.last_access_time, child.extra_key
        )
        upper.creation_time = child.creation_time
        upper.lock_ref = child.lock_ref
        upper.priority = child.priority
        upper.hit_count = child.hit_count
        if child.hashes is not None:
            pages = tokens // self.page_size
            upper.hashes = child.hashes[:pages]
            child.hashes = child.hashes[pages:]
        child.key = child.key[cut:]
        child.value = child.value[tokens:]
        child.parent = upper
        upper.children[child.key[: self._page_bytes]] = child
        parent.children[upper.key[: self._page_bytes]] = upper
        if child.heap_entry is not None:
            self._rekey(child)  # its length and first page changed
        return upper

    # -- insertion -------------------------------------------------------------------------

    def insert(
        self,
        key: object,
        value: object,
        priority: float = 0,
        extra_key: Hashable | None = None,
    ) -> int:
        """Cache the whole pages of `key` with KV slots `value`; return how many were cached before.

        With r the return value and a the page-aligned length of `key`: slots value[:r]
        duplicate the tree's own and stay the caller's to free; value[r:a] now belong to the
        tree; value[a:] (a partial last page) are not inserted and stay the caller's. `priority`
        is raised to at least `priority` on every node of the path. With `disable=True` nothing
        is cached and the return value is len(key).
        """
        kb = encode_key(key)
        slots = as_slot_array(value, "value")
        num_tokens = len(kb) // TOKEN_BYTES
        if slots.size != num_tokens:
            raise InvalidArgumentError(
                f"value has {slots.size} slots but key has {num_tokens} tokens"
            )
        if self.disable:
            return num_tokens
        step = self._page_bytes
        end = len(kb) - len(kb) % step
        root = self._roots.get(extra_key)
        if root is None:
            if not end:
                return 0
            root = self._roots[extra_key] = self._new_root(extra_key)
        now = self._clock()
        node = root
        pos = 0
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                break
            edge = child.key
            if not kb.startswith(edge, pos):
                child = self._split(child, self._common_prefix_tokens(kb, pos, edge, end))
            child.last_access_time = now
            if priority > child.priority:
                child.priority = priority
            pos += len(child.key)
            node = child
            if len(child.key) != len(edge):
                break
        cached = pos // TOKEN_BYTES
        if pos < end:
            node = self._add_leaf(
                node, kb[pos:end], slots[cached : end // TOKEN_BYTES], now, priority
            )
        elif node.heap_entry is not None and self.policy.tracks_access:
            self._rekey(node)
        if self._on_reference is not None and end:
            self._on_reference(node, cached)
        return cached

    def _add_leaf(
        self, parent: TreeNode, key: bytes, slots: np.ndarray, now: float, priority: float
    ) -> TreeNode:
        value = slots.copy()
        value.flags.writeable = False
        leaf = TreeNode(key, value, parent, now, parent.extra_key, priority)
        if parent.heap_entry is not None:
            self._unlist(parent)
        parent.children[key[: self._page_bytes]] = leaf
        self._evictable_size += len(value)
        if self._on_insert is not None:
            self._on_insert(leaf)
        self._push(leaf)
        if self.enable_kv_events:
            previous = self.page_hashes(parent)[-1] if parent.parent is not None else None
            leaf.hashes = chain_page_hashes(
                key, self.page_size, previous or namespace_seed(leaf.extra_key)
            )
            self._events.append(
                BlockStored(
                    tuple(leaf.hashes),
                    previous,
                    tuple(leaf.token_ids.tolist()),
                    self.page_size,
                    leaf.extra_key,
                )
            )
        return leaf

    # -- the evictable-leaf heap -----------------------------------------------------------

    def _push(self, node: TreeNode) -> None:
        entry = [self.policy.key(node), next(self._counter), node]
        node.heap_entry = entry
        heapq.heappush(self._heap, entry)
        self._num_evictable_leaves += 1
        if len(self._heap) > 2 * self._num_evictable_leaves + 1024:
            # In place: evict() holds this list while it pops.
            self._heap[:] = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)

    def _unlist(self, node: TreeNode) -> None:
        node.heap_entry[2] = None
        node.heap_entry = None
        self._num_evictable_leaves -= 1

    def _rekey(self, node: TreeNode) -> None:
        self._unlist(node)
        self._push(node)

    def refresh_eviction_key(self, node: TreeNode) -> None:
        """Recompute `node`'s eviction key after something the policy reads changed on it.

        Policies whose keys depend on state outside the tree (an oracle reading a trace's
        future, say) call this for the nodes whose keys they know to have changed.
        """
        if node.heap_entry is not None:
            self._rekey(node)

    def refresh_all_eviction_keys(self) -> None:
        """Recompute every evictable leaf's key: for a policy whose ranking changed wholesale."""
        key = self.policy.key
        entries = [entry for entry in self._heap if entry[2] is not None]
        for entry in entries:  # a leaf keeps its entry, and its place among equal keys
            entry[0] = key(entry[2])
        self._heap[:] = entries  # in place: evict() may hold this list
        heapq.heapify(self._heap)

    # -- eviction --------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` from unlocked leaves in policy order; return tokens freed.

        Frees fewer only when no unlocked leaf is left. A parent left as an unlocked leaf becomes
        a candidate in turn. Freed slots go back to the allocator.
        """
        if not isinstance(num_tokens, (int, np.integer)):
            raise InvalidArgumentError(f"num_tokens must be an integer, got {num_tokens!r}")
        if num_tokens <= 0 or self.disable:
            return 0
        heap = self._heap
        freed = 0
        released = []
        events = self.enable_kv_events
        on_evict = self._on_evict
        now = self._clock() if on_evict is not None else 0.0
        while freed < num_tokens and heap:
            key, _, node = heapq.heappop(heap)
            if node is None:
                continue
            if on_evict is not None:
                on_evict(node, key, now)
            if self.evict_listener is not None:
                self.evict_listener(node)
            node.heap_entry = None
            self._num_evictable_leaves -= 1
            parent = node.parent
            del parent.children[node.key[: self._page_bytes]]
            node.parent = None
            released.append(node.value)
            size = len(node.value)
            freed += size
            self._evictable_size -= size
            if events:
                self._events.append(BlockRemoved(tuple(self.page_hashes(node)), node.extra_key))
            if parent.children:
                continue
            if parent.parent is not None:
                if parent.lock_ref == 0:
                    self._push(parent)
            elif parent.extra_key is not None:
                del self._roots[parent.extra_key]
        if released:
            self.allocator.free(released[0] if len(released) == 1 else np.concatenate(released))
        return freed

    # -- locking ---------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path from `node` to its root; return the change in evictable size (<= 0)."""
        if node.parent is None:
            if node.key:
                raise LockError("cannot lock a node that was evicted")
            return 0
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                size = len(node.value)
                delta -= size
                if node.heap_entry is not None:
                    self._unlist(node)
            node.lock_ref += 1
            node = node.parent
        self._evictable_size += delta
        self._protected_size -= delta
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock the path from `node` to its root; return the change in evictable size (>= 0)."""
        if node.parent is None:
            if node.key:
                raise LockError("cannot unlock a node that was evicted")
            return 0
        if node.lock_ref <= 0:
            raise LockError("dec_lock_ref on a node whose lock_ref is 0")
        delta = 0
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.value)
                if not node.children:
                    self._push(node)
            node = node.parent
        self._evictable_size += delta
        self._protected_size -= delta
        return delta

    # -- page hashes and events ------------------------------------------------------------

    def page_hashes(self, node: TreeNode) -> list[bytes]:
        """The chained SHA-256 digest of each page of `node`'s edge, computed on first use."""
        if node.hashes is not None:
            return node.hashes
        pending = []
        while node.hashes is None:
            pending.append(node)
            node = node.parent
            if node is None:
                raise InvalidArgumentError("page hashes of a node evicted before they were known")
        previous = node.hashes[-1] if node.hashes else namespace_seed(pending[-1].extra_key)
        for todo in reversed(pending):
            todo.hashes = chain_page_hashes(todo.key, self.page_size, previous)
            previous = todo.hashes[-1]
        return pending[0].hashes

    def take_events(self) -> list[KVCacheEvent]:
        """Drain and return the queued KV events, oldest first."""
        events, self._events = self._events, []
        return events

    # -- whole-tree operations -------------------------------------------------------------

    def _nodes(self) -> list[TreeNode]:
        """Every non-root node, parents before children."""
        order = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                order.append(node)
                stack.extend(node.children.values())
        return order

    def reset(self) -> None:
        """Empty the tree and return its slots to the allocator; refuses while a node is locked."""
        if self._protected_size:
            raise LockError(f"reset while {self._protected_size} tokens are locked")
        nodes = self._nodes()
        if nodes:
            self.allocator.free(np.concatenate([node.value for node in nodes]))
        for node in nodes:
            node.parent = None
            node.heap_entry = None
        self._init_tree()
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Raise `CacheInvariantError` with a precise message unless the bookkeeping is exact."""

        def fail(message: str) -> None:
            raise CacheInvariantError(message)

        evictable = protected = leaves = 0
        slot_arrays = []
        step = self._page_bytes
        for extra_key, root in self._roots.items():
            if root.parent is not None or root.key or root.extra_key != extra_key:
                fail(f"root of namespace {extra_key!r} is malformed")
            if extra_key is not None and not root.children:
                fail(f"namespace {extra_key!r} has an empty root that was not dropped")
        depth: dict[TreeNode, int] = {root: 0 for root in self._roots.values()}
        for node in self._nodes():
            parent = node.parent
            depth[node] = depth[parent] + 1
            where = f"node at depth {depth[node]} ({len(node.value)} tokens)"
            if len(node.key) != len(node.value) * TOKEN_BYTES:
                fail(f"{where}: key has {len(node.key) // TOKEN_BYTES} tokens, value {len(node)}")
            if not node.value.size or node.value.size % self.page_size:
                fail(f"{where}: length is not a positive multiple of page_size={self.page_size}")
            if parent.children.get(node.key[:step]) is not node:
                fail(f"{where}: not filed under its first page in its parent")
            if node.extra_key != parent.extra_key:
                fail(f"{where}: namespace {node.extra_key!r} differs from its parent's")
            if node.lock_ref < 0:
                fail(f"{where}: lock_ref {node.lock_ref} < 0")
            if parent.parent is not None and parent.lock_ref < node.lock_ref:
                fail(f"{where}: lock_ref {node.lock_ref} exceeds its parent's {parent.lock_ref}")
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
            is_leaf = node.lock_ref == 0 and not node.children
            entry = node.heap_entry
            if is_leaf != (entry is not None):
                fail(f"{where}: evictable leaf {is_leaf} but listed {entry is not None}")
            if entry is not None:
                leaves += 1
                if entry[2] is not node:
                    fail(f"{where}: heap entry points elsewhere")
                if entry[0] != self.policy.key(node):
                    fail(f"{where}: heap key {entry[0]!r} != policy key {self.policy.key(node)!r}")
            if node.hashes is not None and len(node.hashes) != len(node.value) // self.page_size:
                fail(f"{where}: {len(node.hashes)} page hashes for {len(node)} tokens")
            slot_arrays.append(node.value)
        if evictable != self._evictable_size or protected != self._protected_size:
            fail(
                f"sizes: counted evictable={evictable} protected={protected}, recorded "
                f"evictable={self._evictable_size} protected={self._protected_size}"
            )
        live = sum(1 for entry in self._heap if entry[2] is not None)
        if live != leaves or leaves != self._num_evictable_leaves:
            fail(
                f"evictable-leaf index: {live} live heap entries, {leaves} evictable leaves, "
                f"{self._num_evictable_leaves} recorded"
            )
        if slot_arrays:
            slots = np.sort(np.concatenate(slot_arrays))
            dup = np.flatnonzero(slots[1:] == slots[:-1])
            if dup.size:
                fail(f"slot {int(slots[dup[0]])} is owned by two nodes")
            if slots[0] < self.allocator.page_size or slots[-1] >= self.allocator.num_slots:
                fail("a node owns a slot outside the allocator's pool")
            free = self.allocator.is_free(slots)
            if free.any():
                fail(f"slot {int(slots[np.argmax(free)])} is owned by a node and free")

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, policy={self.policy.name!r}, "
            f"evictable={self._evictable_size}, protected={self._protected_size}, "
            f"disable={self.disable})"
        )


def pool_check(cache: RadixCache, held: Sequence[np.ndarray] = ()) -> None:
    """Raise `CacheInvariantError` unless tree slots + `held` + free slots are exactly the pool.

    `held` lists slots owned by running requests. For tests and debug builds.
    """
    parts = [node.value for node in cache._nodes()]
    parts += [as_slot_array(h) for h in held]
    parts.append(cache.allocator.free_slots())
    page = cache.allocator.page_size
    owned = np.concatenate(parts) if parts else _EMPTY_SLOTS
    pages = np.unique(owned // page) if page > 1 else np.sort(owned)
    expected = np.arange(1, cache.allocator.num_pages + 1, dtype=SLOT_DTYPE)
    if pages.size != expected.size or not np.array_equal(pages, expected):
        missing = np.setdiff1d(expected, pages)
        raise CacheInvariantError(
            f"pool accounting: {expected.size} pages in the pool, {pages.size} accounted for "
            f"({owned.size} slots); first missing page: "
            f"{int(missing[0]) if missing.size else None}"
        )
