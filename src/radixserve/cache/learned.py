"""`learned-lru`: LRU whose tolerated age per hit class is learned from observed reuse times.

A leaf's key is `last_access_time + tolerance[c]` (when it falls due), where c is its hit class
(`min(hit_count, classes - 1)`). With equal tolerances this is LRU. The tolerances come from
the reuse times the policy observes, per class:

- every reference to a cached node records the time since its previous reference (its reuse
  age), weighted by the node's tokens;
- an evicted node leaves a ghost (its prefix identity, class and last use). A node cached
  again where a ghost was records a reuse at the ghost's age, so reuses later than the cache
  could hold are still seen, and the estimate is not censored by the policy's own choices;
- a ghost older than the horizon, or a node evicted past it, records "no reuse within the
  horizon".

From these, for class c and age a, p_c(a) is the share of tokens still unreused at age a that
are reused within the next eviction age E (the running mean age at which leaves leave). A
class's tolerance is the first age at which its p (made non-increasing in age) falls below
the p of all classes pooled at age E. So a class whose tokens come back more often than the
average token at the eviction age is kept longer, one that comes back less often goes sooner,
and one class alone is LRU. Classes with under 1% of the observations keep E.

The policy reads only the tree and the past. It starts as LRU (no eviction yet, no estimate).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.shadow import PrefixHasher, PrefixRecords
from radixserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from radixserve.cache.radix import RadixCache, TreeNode

# Reuse ages are binned by log2, four bins per doubling, over 2**-30 .. 2**40 clock units, so
# that a wall clock in seconds and a logical clock both fit.
_BINS_PER_OCTAVE = 4
_LOW_OCTAVE = -30
_NUM_BINS = _BINS_PER_OCTAVE * 70
_EDGES = 2.0 ** (np.arange(_NUM_BINS) / _BINS_PER_OCTAVE + _LOW_OCTAVE)
# The weight of the eviction-age mean's newest sample.
_AGE_WEIGHT = 0.01
# A class with less than this share of the observations is not estimated on its own.
_MIN_SHARE = 0.01


def _bin(age: float) -> int:
    if age <= 0:
        return 0
    b = int((math.log2(age) - _LOW_OCTAVE) * _BINS_PER_OCTAVE)
    return min(max(b, 0), _NUM_BINS - 1)


def _bins(ages: np.ndarray) -> np.ndarray:
    b = np.floor((np.log2(ages) - _LOW_OCTAVE) * _BINS_PER_OCTAVE).astype(np.int64)
    return np.clip(b, 0, _NUM_BINS - 1)


def _window_ends(window: float) -> np.ndarray:
    """For every age bin, the end (exclusive) of the bins within `window` after its edge."""
    return np.minimum(_bins(_EDGES + window) + 1, _NUM_BINS)


class LearnedLRUPolicy:
    """LRU with a tolerated age per hit class, learned online (see the module docstring).

    Arguments: `classes` hit classes (hit counts 0 .. classes - 2, then the rest); ghosts of
    up to `ghost` x the pool's tokens; a horizon of `horizon` eviction ages; estimates renewed
    every `epoch` references, and halved every 16 epochs so that old traffic fades.
    Costs per reference: one walk up the referenced path; per node, once, checksums of its
    tokens continued from its parent's (`cache.shadow.PrefixRecords`), which name it for
    ghosts. Every epoch, one re-key of the evictable leaves (O(n)) if a tolerance changed.
    Memory: a record and a state per node (about 300 bytes), ghosts of evicted nodes.
    """

    name = "learned-lru"
    tracks_access = True

    def __init__(
        self, classes: int = 4, ghost: float = 2.0, horizon: float = 8.0, epoch: int = 256
    ) -> None:
        if not isinstance(classes, int) or classes < 1:
            raise InvalidArgumentError(f"classes must be an integer >= 1, got {classes!r}")
        if not ghost >= 0 or not horizon > 1:
            raise InvalidArgumentError(f"need ghost >= 0 and horizon > 1, got {ghost}, {horizon}")
        if not isinstance(epoch, int) or epoch < 1:
            raise InvalidArgumentError(f"epoch must be an integer >= 1, got {epoch!r}")
        self.classes, self.ghost, self.horizon, self.epoch = classes, ghost, horizon, epoch
        self.bind(None)

    def bind(self, cache: RadixCache | None) -> None:
        """Start afresh for `cache` (called by the tree when it is created or reset)."""
        self.cache = cache
        pool = cache.allocator.size if cache is not None else 0
        page_size = cache.page_size if cache is not None else 1
        self._names = PrefixRecords(PrefixHasher(None, 0.0, page_size))
        self._ghost_limit = self.ghost * pool
        self._ghosts: OrderedDict[int, tuple[int, float, int]] = OrderedDict()
        self._ghost_tokens = 0
        # Tokens reused at each age bin, and tokens not reused within the horizon, per class
        # (Python lists: one observation is one scalar update, cheaper than numpy's).
        self._reused = [[0.0] * _NUM_BINS for _ in range(self.classes)]
        self._never = [0.0] * self.classes
        self.eviction_age: float | None = None
        self.tolerance = [0.0] * self.classes
        self._references = 0
        self._epochs = 0
        self._state: dict[TreeNode, list] = {}  # node -> [last reference, hit class then]

    # -- the key ------------------------------------------------------------------------

    def hit_class(self, node: TreeNode) -> int:
        return min(node.hit_count, self.classes - 1)

    def key(self, node: TreeNode) -> float:
        hits, top = node.hit_count, self.classes - 1
        return node.last_access_time + self.tolerance[hits if hits < top else top]

    # -- observations -------------------------------------------------------------------

    def _horizon(self) -> float:
        return math.inf if self.eviction_age is None else self.horizon * self.eviction_age

    def _observe(self, cls: int, age: float, tokens: int) -> None:
        if age > self._horizon():
            self._never[cls] += tokens
        else:
            self._reused[cls][_bin(age)] += tokens

    def identity(self, node: TreeNode) -> int:
        """A name for where `node` starts, equal for a later node cached at the same place."""
        return self._names.identity(node)

    def _forget(self, node: TreeNode) -> None:
        self._names.forget(node)

    def on_insert(self, node: TreeNode) -> None:
        now = node.last_access_time
        if self._ghosts:
            ghost = self._ghosts.pop(self.identity(node), None)
            if ghost is not None:
                cls, last, tokens = ghost
                self._ghost_tokens -= tokens
                self._observe(cls, now - last, min(tokens, len(node.value)))
        self._state[node] = [now, 0]

    def on_reference(self, node: TreeNode, cached: int) -> None:
        now = node.last_access_time
        states = self._state
        top = self.classes - 1
        horizon = self._horizon()
        walker = node
        while walker.parent is not None:
            state = states.get(walker)
            cls = walker.hit_count if walker.hit_count < top else top
            if state is None:  # the upper half of a split: no history of its own
                states[walker] = [now, cls]
            elif state[0] != now:
                age = now - state[0]
                tokens = len(walker.value)
                if age > horizon:
                    self._never[state[1]] += tokens
                else:
                    self._reused[state[1]][_bin(age)] += tokens
                state[0], state[1] = now, cls
            else:
                state[1] = cls
            walker = walker.parent
        ghosts = self._ghosts
        if ghosts and now - next(iter(ghosts.values()))[1] > horizon:
            self._expire_ghosts(now)
        self._references += 1
        if self._references % self.epoch == 0:
            self._renew()

    def on_evict(self, node: TreeNode, key: float, now: float) -> None:
        state = self._state.pop(node, None)
        last, cls = (state[0], state[1]) if state is not None else (node.last_access_time, 0)
        age = now - last
        mean = self.eviction_age
        mean = self.eviction_age = (
            age if mean is None else (1 - _AGE_WEIGHT) * mean + _AGE_WEIGHT * age
        )
        tokens = len(node.value)
        if age > self.horizon * mean or not self._ghost_limit:
            self._never[cls] += tokens
            self._forget(node)
            return
        identity = self.identity(node)
        self._forget(node)
        old = self._ghosts.pop(identity, None)
        if old is not None:
            self._ghost_tokens -= old[2]
        self._ghosts[identity] = (cls, last, tokens)
        self._ghost_tokens += tokens
        while self._ghost_tokens > self._ghost_limit:
            _, (old_cls, _, tokens) = self._ghosts.popitem(last=False)
            self._ghost_tokens -= tokens
            self._never[old_cls] += tokens

    def _expire_ghosts(self, now: float) -> None:
        horizon = self._horizon()
        ghosts = self._ghosts
        while ghosts:
            identity, (cls, last, tokens) = next(iter(ghosts.items()))
            if now - last <= horizon:
                break
            del ghosts[identity]
            self._ghost_tokens -= tokens
            self._never[cls] += tokens

    # -- the estimate -------------------------------------------------------------------

    def reuse_within(self, reused: np.ndarray, never: float, window: float) -> np.ndarray:
        """p(a) for every age bin: the share of tokens unreused at age a that are reused
        within `window` after it, from a histogram of reuse ages and the tokens never reused."""
        return self._reuse_within(reused, never, _window_ends(window))

    @staticmethod
    def _reuse_within(reused: np.ndarray, never: float, ends: np.ndarray) -> np.ndarray:
        cum = np.concatenate([[0.0], np.cumsum(reused)])
        survivors = cum[-1] - cum[:-1] + never
        within = cum[ends] - cum[:-1]
        return np.divide(within, survivors, out=np.zeros(_NUM_BINS), where=survivors > 0)

    def estimate(self) -> list[float]:
        """The tolerated age per hit class from the observations so far (see the module
        docstring); all zero (LRU) before the first eviction."""
        if self.eviction_age is None:
            return [0.0] * self.classes
        # E at the histogram's resolution: the tolerances move, and the leaves are re-keyed,
        # only when E crosses a bin edge, not at every eviction.
        window = float(_EDGES[_bin(self.eviction_age)])
        ends = _window_ends(window)
        horizon = self.horizon * window
        last_bin = _bin(horizon)
        reused, never = np.array(self._reused), np.array(self._never)
        pooled = self._reuse_within(reused.sum(0), float(never.sum()), ends)
        reference = pooled[_bin(window)]
        totals = reused.sum(1) + never
        tolerance = []
        for cls in range(self.classes):
            if totals[cls] < _MIN_SHARE * totals.sum():
                tolerance.append(window)
                continue
            p = np.minimum.accumulate(self._reuse_within(reused[cls], float(never[cls]), ends))
            below = np.flatnonzero(p[: last_bin + 1] < reference)
            tolerance.append(float(_EDGES[below[0]]) if below.size else horizon)
        return tolerance

    def _renew(self) -> None:
        self._epochs += 1
        if self._epochs % 16 == 0:
            self._reused = [[0.5 * n for n in row] for row in self._reused]
            self._never = [0.5 * n for n in self._never]
        tolerance = self.estimate()
        if tolerance != self.tolerance:
            self.tolerance = tolerance
            self.tolerance_changed()

    def tolerance_changed(self) -> None:
        """The tolerances moved: every evictable leaf's key with them."""
        if self.cache is not None:
            self.cache.refresh_all_eviction_keys()
