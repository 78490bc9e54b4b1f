"""The `adaptive` eviction policy: follow whichever of wgd, LRU and LFU is winning, with a floor.

No fixed eviction order wins everywhere. `wgd` gains most when the cache holds a few percent of
the working set and loses to LRU once the cache holds the recency working set; LFU wins on
static popularity and collapses when popularity moves. A deployment cannot know its regime in
advance, and the regime changes over a day. So this policy runs all three and measures them:

- **Shadows.** Small caches of the three policies (`cache.shadow`) are fed a hash-sampled
  subset of the pages every request references, so each estimates what its policy would hit at
  the real cache's size. The LRU shadow is exact up to sampling (per-page LRU is tree LRU).
- **The real tree** ranks its leaves by one expert's key at a time: `wgd`'s GreedyDual
  priorities, LRU's last use, or LFU's (hits, last use). Its own hits on the sampled pages are
  counted against the shadows', reference by reference.
- **Epochs.** Every `epoch` sampled references (default: one shadow capacity, at least 1,024),
  each expert's estimate is its shadow's hit rate, smoothed over epochs, plus a bias: what the
  real tree got minus what the shadow got, measured while the tree followed that expert (from
  its second epoch on). The bias corrects the wgd and LFU shadows, which see pages as
  independent objects where the tree sees prefixes. If another expert's estimate leads the
  followed one by more than `margin`, the tree switches to it and re-keys every leaf.

The floor: while the tree follows an expert, its measured hit rate is compared every epoch with
the LRU and LFU shadows on the same references. A shortfall larger than `margin` sustained
over an epoch moves it to the leader, so the steady-state loss to the better of LRU and LFU is
bounded by `margin` plus sampling error; what is lost in between is the switching lag, about two
epochs of the slower policy's hit rate.

State of its own: one record per tree node (its prefix hash and sampled page names, about
150 bytes), three shadows of `sample_pages` names each plus the wgd shadow's ghosts
(2 x `sample_pages`), and wgd's own window and ghosts (see `WindowedGreedyDualPolicy`). With
the default 4,096 sampled pages the shadows hold about 20,000 names in all (a few MB),
whatever the pool size.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

from radixserve.cache.evict import WindowedGreedyDualPolicy
from radixserve.cache.hashing import namespace_seed
from radixserve.cache.shadow import GreedyDualShadow, LFUShadow, LRUShadow, PrefixHasher
from radixserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from radixserve.cache.radix import RadixCache, TreeNode

EXPERTS = ("wgd", "lru", "lfu")
_SMOOTHING = 0.5
_GD_SHARE = 4
_UNMEASURED = 0.02
_WINDOW_EPOCHS = 8


def _seed(extra_key: object) -> int:
    """Where the prefix hashes of a namespace start: the same in every process."""
    return int.from_bytes(hashlib.sha256(b"radixserve" + namespace_seed(extra_key)).digest()[:8])


def _mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean of `values` and its standard error (infinite below two values)."""
    n = len(values)
    mean = sum(values) / n if n else 0.0
    if n < 2:
        return mean, math.inf
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


class AdaptivePolicy(WindowedGreedyDualPolicy):
    """Evict in the order of whichever of wgd, LRU and LFU its shadows say is winning.

    `window` and `ghost` are wgd's (and its shadow's). `sample_pages` is the shadows' size in
    pages: the sampling rate is `sample_pages` / the pool's pages, capped at 1. `margin` is the
    lead, as a hit-rate fraction, another expert needs before the tree switches to it.
    `epoch` is the number of sampled references between decisions (None: the shadows' size,
    at least 1,024). `switches` lists (sampled references so far, expert) at each switch.
    """

    name = "adaptive"
    tracks_access = True

    def __init__(
        self,
        window: float = 0.1,
        ghost: float = 2.0,
        sample_pages: int = 1024,
        margin: float = 0.005,
        epoch: int | None = None,
    ) -> None:
        if not isinstance(sample_pages, int) or sample_pages < 16:
            raise InvalidArgumentError(f"sample_pages must be an integer >= 16, got {sample_pages}")
        if not 0 <= margin < 1:
            raise InvalidArgumentError(f"margin must be in [0, 1), got {margin!r}")
        if epoch is not None and (not isinstance(epoch, int) or epoch < 1):
            raise InvalidArgumentError(f"epoch must be an integer >= 1 or None, got {epoch!r}")
        self.sample_pages = sample_pages
        self.margin = margin
        self._epoch_arg = epoch
        super().__init__(window, ghost)

    def bind(self, cache: RadixCache | None) -> None:
        super().bind(cache)
        pages = cache.allocator.size // cache.page_size if cache is not None else 1
        page_size = cache.page_size if cache is not None else 1
        rate = min(1.0, self.sample_pages / pages)
        size = max(1, round(rate * pages))
        self._hasher = PrefixHasher(page_size, rate)
        self._lru = LRUShadow(size)
        self._lfu = LFUShadow(size)
        # The wgd shadow costs most per access, so past 256 pages it sees a share of the sample.
        share = _GD_SHARE if size >= 256 * _GD_SHARE else 1
        self._gd = GreedyDualShadow(max(1, size // share), self.window, self.ghost)
        self._gd_threshold = int(self._hasher.threshold) // share
        self._records: dict[TreeNode, tuple[int, int, int, list[int]]] = {}
        self.epoch = self._epoch_arg or 1024
        self._turnover = size if self._epoch_arg is None else 0
        self.mode = "lru"
        self.switches: list[tuple[int, str]] = []
        self.decisions: list[tuple[int, str, float, dict[str, float]]] = []
        self.references = 0
        self._misses_in_mode = 0
        self._refs = self._real = self._gd_refs = 0
        self._hits = dict.fromkeys(EXPERTS, 0)
        self._rate: dict[str, float | None] = dict.fromkeys(EXPERTS)
        self._bias: dict[str, float | None] = dict.fromkeys(EXPERTS)
        self._leads: dict[str, list[float]] = {name: [] for name in EXPERTS}

    # -- keys ------------------------------------------------------------------------------

    def key(self, node: TreeNode):
        mode = self.mode
        if mode == "lru":
            return node.last_access_time
        if mode == "lfu":
            return (node.hit_count, node.last_access_time)
        return super().key(node)

    # wgd's own bookkeeping (window, ghosts, L) runs only while the tree follows wgd. Nodes
    # inserted meanwhile have no wgd state, which wgd reads as probation (or protected once
    # hit): after a switch to wgd the window starts empty and refills with new leaves.

    def on_insert(self, node: TreeNode) -> None:
        if self.mode == "wgd":
            super().on_insert(node)

    def on_evict(self, node: TreeNode, key: tuple, now: float) -> None:
        if self.mode == "wgd":
            super().on_evict(node, key, now)
        self._records.pop(node, None)

    # -- prefix hashes of tree nodes -------------------------------------------------------

    def _record(self, node: TreeNode) -> tuple[int, int, int, list[int]]:
        """(edge bytes, hash at the node's end, its first page's name, its sampled pages)."""
        records = self._records
        record = records.get(node)
        if record is not None and record[0] == len(node.key):
            return record
        stale = [node]
        above = node.parent
        while above.parent is not None:
            record = records.get(above)
            if record is not None and record[0] == len(above.key):
                break
            stale.append(above)
            above = above.parent
        start = record[1] if above.parent is not None else _seed(above.extra_key)
        for todo in reversed(stale):
            end, first, sampled = self._hasher.end_and_samples(start, todo.key)
            record = records[todo] = (len(todo.key), end, first, sampled)
            start = end
        return record

    def _identity(self, node: TreeNode) -> int:
        return self._record(node)[2]

    def _close_window(self) -> None:
        """Leaving wgd: demote the window's leaves to probation, as if the window were 0."""
        for node in self._window:
            state = node.eviction_state
            if state.segment == "window":
                self._demotions += 1
                state.segment, state.stamp = "probation", self._demotions
                state.level = self._levels[-1]
        self._window.clear()
        self._window_tokens = 0

    def _demoted(self, node: TreeNode) -> None:
        if self.mode == "wgd":  # the other experts' keys ignore segments
            self.cache.refresh_eviction_key(node)

    # -- measuring and switching -----------------------------------------------------------

    def on_reference(self, node: TreeNode, cached: int) -> None:
        """`insert` placed a sequence ending at `node`; its first `cached` tokens were cached."""
        path = []
        walker = node
        while walker.parent is not None:
            path.append(walker)
            walker = walker.parent
        # A request uses its whole path at one instant, and a tree evicts deepest first at
        # equal recency: the shadows get the path's pages deepest first.
        depth = sum(len(walker) for walker in path)
        pages: list[int] = []
        real = 0
        for walker in path:
            sampled = self._record(walker)[3]
            if sampled:
                pages.extend(reversed(sampled))
                if depth <= cached:
                    real += len(sampled)
            depth -= len(walker)
        if not pages:
            return
        self._refs += len(pages)
        self._real += real
        hits = self._hits
        hits["lru"] += self._lru.reference(pages)
        hits["lfu"] += self._lfu.reference(pages)
        threshold = self._gd_threshold
        gd_pages = [page for page in pages if page < threshold]
        if gd_pages:
            self._gd_refs += len(gd_pages)
            hits["wgd"] += self._gd.reference(gd_pages)
        if self._refs >= self.epoch and 4 * (self._refs - self._real) >= self._turnover:
            self._decide()

    def _decide(self) -> None:
        refs = self._refs
        self.references += refs
        real = self._real / refs
        raw = {name: self._hits[name] / refs for name in EXPERTS}
        if self._gd_refs:
            raw["wgd"] = self._hits["wgd"] / self._gd_refs
        else:  # no page of this epoch fell in the wgd shadow's share of the sample
            raw["wgd"] = self._rate["wgd"] if self._rate["wgd"] is not None else real
        self._rate = raw
        self._hits = dict.fromkeys(EXPERTS, 0)
        self._refs = self._real = self._gd_refs = 0
        misses_before = self._misses_in_mode
        self._misses_in_mode += refs - round(real * refs)
        self.decisions.append((self.references, self.mode, real, raw))
        # Until the tree has filled, or replaced its contents since a switch, it is in
        # transition: its hit rate says little about the expert it follows.
        if misses_before < self._turnover:
            return
        gap = real - raw[self.mode]
        old = self._bias[self.mode]
        self._bias[self.mode] = gap if old is None else old + _SMOOTHING * (gap - old)
        # Each other expert's estimated lead over what the tree really got, epoch by epoch.
        for name in EXPERTS:
            if name != self.mode:
                leads = self._leads[name]
                leads.append(raw[name] + (self._bias[name] or 0.0) - real)
                del leads[:-_WINDOW_EPOCHS]
        best, lead, noise = max(
            ((name, *_mean_and_error(self._leads[name])) for name in EXPERTS if name != self.mode),
            key=lambda item: item[1],
        )
        needed = self.margin
        if best == "wgd" and self._bias["wgd"] is None:
            needed += _UNMEASURED  # the wgd shadow's model error was never measured
        # Switch on a lead that is both large enough and unlikely to be sampling noise.
        if len(self._leads[best]) >= 2 and lead > needed and lead > 2.0 * noise:
            if self.mode == "wgd":
                self._close_window()
            self.mode = best
            self._misses_in_mode = 0
            self._leads = {name: [] for name in EXPERTS}
            self.switches.append((self.references, best))
            self.cache.refresh_all_eviction_keys()

    def estimates(self) -> dict[str, float | None]:
        """Each expert's current estimated hit rate on sampled pages (None before an epoch)."""
        return {
            name: None if self._rate[name] is None else self._rate[name] + (self._bias[name] or 0)
            for name in EXPERTS
        }
