"""The `adaptive` eviction policy: follow whichever of wgd, LRU and LFU is winning, with a floor.

No fixed eviction order wins everywhere. `wgd` gains most when the cache holds a few percent of
the working set and loses to LRU once the cache holds the recency working set; LFU wins on
static popularity and collapses when popularity moves. A deployment cannot know its regime in
advance, and the regime changes over a day. So this policy runs all three and measures them:

- **Shadows.** Small caches of the three policies (`cache.shadow`) are fed a hash-sampled
  subset of the blocks every request references, so each estimates what its policy would hit
  at the real cache's size. A block is a page in small pools and grows to 64 tokens in large
  ones (where the sample is at most one block in four). The shadows take the sampled
  references in batches of up to 64 requests, cut before every decision and every change
  of the base expert's tolerances, so a batch changes no count. The LRU shadow tracks tree
  LRU closely (per-page LRU is tree LRU); the LFU shadow treats blocks as independent
  objects, and the wgd shadow, which models a policy of tree nodes with blocks, can be a
  few points off. Every shadow sees the whole sample: a wgd shadow fed a quarter of it was
  up to 16 points optimistic from its own sampling error.
- **The real tree** ranks its leaves by one expert's key at a time: the base expert's (at
  first), LFU's (hits, last use), or `wgd`'s GreedyDual priorities. Its own hits on the sampled
  pages are counted reference by reference. The base expert, named `lru` in `switches` and
  `decisions`, is `learned-lru` (`cache.learned`): LRU with a tolerated age per hit class,
  learned from reuse times in every mode. It is exactly LRU until it has evidence, and it
  takes, without switching, what a few hit classes can tell (measured in the lab study: the
  gains of `wgd` on drifting popularity at small caches, LRU's at large ones).
- **Epochs.** Every `epoch` sampled references (and a quarter of a shadow's worth of misses),
  each other expert's lead is recorded: its shadow's hit rate minus what the tree really got
  (or the LRU shadow's, where higher, while the tree follows the base expert). The wgd shadow
  is corrected by what the tree got while following wgd, and until then handicapped by 5
  points or the reference's own rate, whichever is less (a wrong trial of wgd cannot lose more
  than that). The tree leaves the base expert for the one with the largest mean lead over the last
  16 epochs if that lead is over `margin` and over twice its standard error; it goes back to
  the base expert on a lead of the LRU shadow over `margin` alone, the shadow lowered by the
  optimism it surely showed while the tree followed the base expert. No lead is recorded until
  the tree has replaced its contents once since it filled or switched.

The floor: while the tree follows another expert, its measured hit rate is compared every epoch
with the LRU shadow on the same references, and a mean shortfall over `margin` sends it back to
the base expert. The shadows still compare too: when, on the mean of two or more epochs since
the switch, the LRU shadow leads every other expert's shadow (wgd's corrected) by over
`margin`, the evidence the switch was made on is gone and the tree goes back at once (a
switch that paid for some epochs, then turned, would otherwise hold the mean shortfall under
`margin` for as long again). During the transition after a switch, when the tree's rate says
little about the expert it follows, the floor still holds: on the mean of two or more epochs,
a lead of the LRU shadow (lowered as above) over the tree of over `margin` sends it back.
What is lost in between is the lag: two epochs in a transition, else two epochs.

The base expert has a floor of its own: a fourth shadow runs `learned-lru` with the base
expert's tolerances on the same sample. Both it and the LRU shadow treat blocks as
independent objects, so their difference estimates the base expert's gain over LRU without
the bias of either against the tree (in the lab study's 84 cells on seed 0 it tracked the
tree's `learned-lru` minus LRU with a correlation of 0.93). On a mean shortfall over
`margin` in the last 16 epochs, the tree ranks by plain recency while following the base
expert (`plain`), and takes the learned tolerances back on a mean gain over `margin` and
twice its standard error.

State of its own: one record per tree node (its prefix's checksums, its first page's name
and its sampled blocks' names, about 200 bytes); four shadows of `sample_pages` names each
(LRU, LFU, `learned-lru`, wgd) plus the wgd shadow's ghosts (2 x its size), about 6,000
names with the default 1,024, whatever the pool size; wgd's own window and ghosts (see
`WindowedGreedyDualPolicy`), kept only while the tree follows wgd; and the base expert's
counts, node entries and ghosts (see `LearnedLRUPolicy`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.cache.evict import WindowedGreedyDualPolicy
from radixserve.cache.hashing import TOKEN_BYTES
from radixserve.cache.learned import LearnedLRUPolicy
from radixserve.cache.shadow import (
    GreedyDualShadow,
    LearnedLRUShadow,
    LFUShadow,
    LRUShadow,
    PrefixHasher,
    PrefixRecords,
)
from radixserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from radixserve.cache.radix import RadixCache, TreeNode

EXPERTS = ("wgd", "lru", "lfu")
_GD_HANDICAP = 0.05
_WINDOW_EPOCHS = 16
_BLOCK_TOKENS = 64
_BATCH = 64  # requests whose sampled references the shadows take at once, at most
_HISTORY = 1024  # entries kept in `decisions`, `switches` and `plain_switches`


@dataclass(frozen=True)
class AdaptiveSummary:
    """What `adaptive` follows and what its shadows estimate, as of its latest epoch.

    `following` is the order the tree evicts in: `learned-lru` (the base expert), `lru` (the
    base expert's floor: plain recency), `lfu` or `wgd`. `estimated_hit_rates` holds, over
    the latest epochs (up to 16), the hit rate on the sampled blocks of the tree itself
    (`tree`) and of each shadow (`lru`, `lfu`, `wgd`, `learned-lru`): what each policy would
    have hit at this cache's size, estimated from the sample. It is empty until the first
    epoch. `shadow_entries` counts the names the shadows and their ghosts hold, and
    `node_records` the tree nodes the policy keeps a record of (about 200 bytes each).
    """

    following: str
    switches: int
    epochs: int
    sampled_references: int
    sample_rate: float
    estimated_hit_rates: dict[str, float] = field(default_factory=dict)
    shadow_entries: int = 0
    node_records: int = 0


def _lfu_key(node: TreeNode) -> tuple[int, float]:
    return (node.hit_count, node.last_access_time)


def _recency_key(node: TreeNode) -> float:
    return node.last_access_time


def _mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean of `values` and its standard error (infinite below two values)."""
    n = len(values)
    mean = sum(values) / n if n else 0.0
    if n < 2:
        return mean, math.inf
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


class _BaseExpert(LearnedLRUPolicy):
    """`learned-lru` as the adaptive policy's base expert: it learns in every mode, and its
    tolerances re-key the tree only while the tree follows it."""

    def __init__(self, owner: AdaptivePolicy) -> None:
        super().__init__()
        self._owner = owner

    def tolerance_changed(self) -> None:
        if self._owner.mode == "lru" and not self._owner.plain:
            super().tolerance_changed()

    def _renew(self) -> None:
        # The learned-lru shadow reads these tolerances when it evicts: it takes the
        # references held back before they move, as if it had been fed each one at once.
        self._owner._feed_shadows()
        super()._renew()

    def identity(self, node: TreeNode) -> int:
        return self._owner._names.identity(node)  # the names the shadows already keep

    def _forget(self, node: TreeNode) -> None:
        pass  # the owner's records: it forgets evicted nodes


class AdaptivePolicy(WindowedGreedyDualPolicy):
    """Evict in the order of whichever of wgd, LRU and LFU its shadows say is winning.

    `window` and `ghost` are wgd's (and its shadow's). `sample_pages` is the shadows' size in
    pages: the sampling rate is `sample_pages` / the pool's pages, capped at 1. `margin` is the
    lead, as a hit-rate fraction, another expert needs before the tree switches to it.
    `epoch` is the least number of sampled references between decisions (None: 1,024, and a
    quarter of a shadow's worth of misses; given, decisions need no misses and there is no
    transition). `switches` holds (sampled references so far, expert) for each switch, and
    `decisions` (sampled references, followed expert, the tree's hit rate, each shadow's) for
    each epoch. `plain` says whether the base expert's floor has the tree rank by plain
    recency while it follows the base expert; `plain_switches` holds (sampled references,
    plain) for each change. Each keeps its latest 1,024 entries; `switch_count` and `epochs`
    count all. `summary()` reports the policy's state for monitoring.
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
        # The shadows' unit is a block of pages. Blocks grow, to _BLOCK_TOKENS at most, while
        # the shadows still sample at most one block in four: the hashing then costs a call
        # per block instead of per page, and small pools, where the shadows see every page,
        # keep the page as the unit.
        per_block = 1
        while (
            2 * per_block * page_size <= _BLOCK_TOKENS
            and pages // (2 * per_block) >= 4 * self.sample_pages
        ):
            per_block *= 2
        blocks = pages // per_block
        rate = min(1.0, self.sample_pages / blocks)
        size = max(1, round(rate * blocks))
        self._hasher = PrefixHasher(per_block * page_size, rate, page_size)
        self._lru = LRUShadow(size)
        self._lfu = LFUShadow(size)
        # The wgd shadow sees the whole sample: at a quarter of it (256 names by default) its
        # sampling error alone set it 3-16 points off the tree on chat (docs/eviction.md).
        self._gd = GreedyDualShadow(size, self.window, self.ghost)
        self._names = PrefixRecords(self._hasher)
        self._pending: list[list[int]] = []
        self._pending_times: list[float] = []
        # The base expert's own floor: a shadow of it, beside the LRU shadow on the same
        # sample. While it trails that shadow, the tree ranks by plain recency (`plain`).
        self._learned_hits = 0
        self._learned_gaps: list[float] = []
        self._filled = False
        self.plain = False
        self.plain_switches: deque[tuple[int, bool]] = deque(maxlen=_HISTORY)
        self.epoch = self._epoch_arg or 1024
        self._turnover = size if self._epoch_arg is None else 0
        self.mode = "lru"
        self.switches: deque[tuple[int, str]] = deque(maxlen=_HISTORY)
        self.switch_count = 0
        self.decisions: deque[tuple[int, str, float, dict[str, float]]] = deque(maxlen=_HISTORY)
        self.epochs = 0
        # Per epoch of the latest ones: sampled references, and hits of the tree and each shadow.
        self._recent: deque[tuple[int, int, int, int, int, int]] = deque(maxlen=_WINDOW_EPOCHS)
        self.references = 0
        self._misses_in_mode = 0
        self._refs = self._real = 0
        self._hits = dict.fromkeys(EXPERTS, 0)
        self._gd_bias: float | None = None
        self._base_gaps: list[float] = []
        self._leads: dict[str, list[float]] = {name: [] for name in EXPERTS}
        self._reversal: list[float] = []
        self._transition_shortfall: list[float] = []
        self._base = _BaseExpert(self)
        self._base.bind(cache)
        self._learned = LearnedLRUShadow(size, self._base, self._base.classes)
        self._use_keys_of(self.mode)

    # -- keys ------------------------------------------------------------------------------

    def _key_of(self, mode: str):
        """The key function of the expert `mode`."""
        if mode == "lru":
            return _recency_key if self.plain else self._base.key
        if mode == "lfu":
            return _lfu_key
        return super().key

    def _use_keys_of(self, mode: str) -> None:
        # `key` (the tree asks for one per leaf pushed) is the followed expert's own function,
        # set here from bind() on, not a dispatch on the mode.
        self.key = self._key_of(mode)

    # wgd's own bookkeeping (window, ghosts, L) runs only while the tree follows wgd. Nodes
    # inserted meanwhile have no wgd state, which wgd reads as probation (or protected once
    # hit): after a switch to wgd the window starts empty and refills with new leaves.

    def on_insert(self, node: TreeNode) -> None:
        self._base.on_insert(node)
        if self.mode == "wgd":
            super().on_insert(node)

    def on_evict(self, node: TreeNode, key: tuple, now: float) -> None:
        self._base.on_evict(node, key, now)
        if self.mode == "wgd":
            super().on_evict(node, key, now)
        self._names.forget(node)

    # -- prefix hashes of tree nodes -------------------------------------------------------

    def _identity(self, node: TreeNode) -> int:
        return self._names.identity(node)

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
        self._base.on_reference(node, cached)
        # A request uses its whole path at one instant, and a tree evicts deepest first at
        # equal recency: the shadows get the path's pages deepest first.
        pages: list[int] = []
        real = 0
        cached_bytes = TOKEN_BYTES * cached
        path = self._names.path(node)
        end = sum([record[0] for record in path])  # where the node looked at ends, in key bytes
        for length, _, _, sampled in path:
            if sampled:
                pages.extend(reversed(sampled))
                if end <= cached_bytes:
                    real += len(sampled)
            end -= length
        if not pages:
            return
        self._refs += len(pages)
        self._real += real
        pending = self._pending
        pending.append(pages)
        self._pending_times.append(node.last_access_time)
        due = self._refs >= self.epoch and 4 * (self._refs - self._real) >= self._turnover
        if due or len(pending) >= _BATCH:
            self._feed_shadows()
        if due:
            self._decide()

    def _feed_shadows(self) -> None:
        """Give the shadows the references held back, in order, one shadow at a time.

        The shadows do not act on the tree, and they are fed before every decision and every
        change of the base expert's tolerances (which the learned-lru shadow reads), so holding
        references back changes nothing but speed: a shadow's state stays in the CPU's caches
        through a batch. A test holds the counts equal for batches of 1, 16 and 64.
        """
        pending, self._pending = self._pending, []
        times, self._pending_times = self._pending_times, []
        hits = self._hits
        self._learned_hits += self._learned.reference_all(pending, times)
        hits["lru"] += self._lru.reference_all(pending)
        hits["lfu"] += self._lfu.reference_all(pending)
        hits["wgd"] += self._gd.reference_all(pending)

    def _decide(self) -> None:
        refs = self._refs
        self.references += refs
        self.epochs += 1
        hits = self._hits
        self._recent.append(
            (
                refs,
                self._real,
                hits["lru"],
                hits["lfu"],
                self._learned_hits,
                hits["wgd"],
            )
        )
        real = self._real / refs
        raw = {name: self._hits[name] / refs for name in EXPERTS}
        self._hits = dict.fromkeys(EXPERTS, 0)
        self._refs = self._real = 0
        misses_before = self._misses_in_mode
        self._misses_in_mode += refs - round(real * refs)
        self.decisions.append((self.references, self.mode, real, raw))
        learned, self._learned_hits = self._learned_hits / refs, 0
        self._filled = self._filled or misses_before >= self._turnover
        if self._filled:
            self._judge_base_expert(learned - raw["lru"])
        # Until the tree has filled, or replaced its contents since a switch, it is in
        # transition: its hit rate says little about the expert it follows.
        transition = misses_before < self._turnover
        if self.mode != "lru" and self._filled:
            self._check_reversal(real, raw, transition)
            if self.mode == "lru":
                return
        if transition:
            return
        # Each other expert's lead, epoch by epoch: its shadow against what the tree really
        # got. Under the base expert, against the LRU shadow where that is higher: it shares
        # the other shadows' sampling and its small optimism, and the base expert's learned
        # tolerances can make the tree better than LRU, which a lead must then beat.
        reference = max(raw["lru"], real) if self.mode == "lru" else real
        # The wgd shadow models a tree policy with independent pages and can be several points
        # optimistic: it is corrected by what the tree got while following wgd, and until that
        # is known, handicapped (by no more than the reference's rate: where LRU hits nothing,
        # a wrong trial of wgd has nothing to lose).
        if self.mode == "wgd":
            gap = real - raw["wgd"]
            old = self._gd_bias
            self._gd_bias = gap if old is None else old + 0.5 * (gap - old)
        gd_correction = self._gd_correction(reference)
        # The LRU shadow can be optimistic too: it evicts a block at a time where the tree
        # evicts whole leaves. While the tree follows another expert, the LRU shadow is lowered
        # by how far it surely stood above the tree under the base expert: the mean over the
        # last window of base-mode epochs, less twice its standard error (one noisy epoch
        # kept the tree on stale LFU through popularity drift). Never raised: that would send
        # the tree back on the base expert's early, noisy gains.
        gaps = self._base_gaps
        if self.mode == "lru":
            gaps.append(real - raw["lru"])
            del gaps[:-_WINDOW_EPOCHS]
        corrections = {"wgd": gd_correction, "lru": self._lru_correction(), "lfu": 0.0}
        for name in EXPERTS:
            if name != self.mode:
                leads = self._leads[name]
                leads.append(raw[name] + corrections[name] - reference)
                del leads[:-_WINDOW_EPOCHS]
        best, lead, noise = max(
            ((name, *_mean_and_error(self._leads[name])) for name in EXPERTS if name != self.mode),
            key=lambda item: item[1],
        )
        # Leave LRU, the default, on a lead that is both over the margin and unlikely to be
        # sampling noise. Go back to it on a lead over the margin alone: the floor is LRU's.
        confident = best == "lru" or lead > 2.0 * noise
        if len(self._leads[best]) >= 2 and lead > self.margin and confident:
            self.follow(best)

    def _gd_correction(self, reference: float) -> float:
        """What the wgd shadow's rate is corrected by: the measured bias once the tree has
        followed wgd, else minus the handicap, at most `reference` (the rate a trial risks)."""
        if self._gd_bias is not None:
            return self._gd_bias
        return -min(_GD_HANDICAP, reference)

    def _lru_correction(self) -> float:
        """What the LRU shadow is lowered by while the tree follows another expert: how far it
        surely stood above the tree under the base expert (never a rise)."""
        base_gap, base_error = _mean_and_error(self._base_gaps)
        return min(0.0, base_gap + 2.0 * base_error)

    def _check_reversal(self, real: float, raw: dict[str, float], transition: bool) -> None:
        """While the tree follows another expert, the shadows still compare. The tree goes
        back to the base expert when, on the mean of two or more epochs since the switch (the
        latest 16), the LRU shadow leads the shadows of every other expert by over `margin`:
        the evidence the switch was made on is gone. In transition, when the tree's rate says
        little about the expert it now follows but the floor is still LRU's, it also goes
        back when the LRU shadow (corrected) leads the tree by over `margin` on the mean of
        the epochs since the switch: the trial is costing what the floor protects."""
        lru = raw["lru"]
        best_other = max(raw["lfu"], raw["wgd"] + self._gd_correction(lru))
        reversal, shortfall = self._reversal, self._transition_shortfall
        reversal.append(lru - best_other)
        del reversal[:-_WINDOW_EPOCHS]
        if transition:
            shortfall.append(lru + self._lru_correction() - real)
        if len(reversal) < 2:
            return
        turned = sum(reversal) / len(reversal) > self.margin
        short = transition and sum(shortfall) / len(shortfall) > self.margin
        if turned or short:
            self.follow("lru")

    def _judge_base_expert(self, gap: float) -> None:
        """The base expert's floor. Its shadow and the LRU shadow see the same sample and err
        alike (pages, not nodes), so their difference is its gain over LRU without that
        bias: the tree ranks by plain recency on a mean shortfall over `margin`, and by the
        learned tolerances again on a mean gain over `margin` and twice its standard error."""
        gaps = self._learned_gaps
        gaps.append(gap)
        del gaps[:-_WINDOW_EPOCHS]
        if len(gaps) < 2:
            return
        mean, noise = _mean_and_error(gaps)
        if not self.plain and mean < -self.margin:
            self._set_plain(True)
        elif self.plain and mean > self.margin and mean > 2.0 * noise:
            self._set_plain(False)

    def _set_plain(self, plain: bool) -> None:
        self.plain = plain
        self.plain_switches.append((self.references, plain))
        if self.mode == "lru":
            self._use_keys_of("lru")
            if self.cache is not None:
                self.cache.refresh_all_eviction_keys()

    def follow(self, expert: str) -> None:
        """Rank the tree's leaves by `expert` (wgd, lru or lfu) from now on.

        Re-keys every evictable leaf. The policy switches by itself; this is for tests and for
        pinning an expert by hand.
        """
        if expert not in EXPERTS:
            raise InvalidArgumentError(f"expert must be one of {EXPERTS}, got {expert!r}")
        if expert == self.mode:
            return
        if self.mode == "wgd":
            self._close_window()
        self.mode = expert
        self._use_keys_of(expert)
        self._misses_in_mode = 0
        self._reversal = []
        self._transition_shortfall = []
        self._leads = {name: [] for name in EXPERTS}
        self.switches.append((self.references, expert))
        self.switch_count += 1
        if self.cache is not None:
            self.cache.refresh_all_eviction_keys()

    def summary(self) -> AdaptiveSummary:
        """What the policy follows and what its shadows estimate (see `AdaptiveSummary`)."""
        following = self.mode
        if following == "lru":
            following = "lru" if self.plain else "learned-lru"
        estimates: dict[str, float] = {}
        if self._recent:
            refs, real, lru, lfu, learned, gd = map(sum, zip(*self._recent, strict=True))
            estimates = {
                "tree": real / refs,
                "lru": lru / refs,
                "lfu": lfu / refs,
                "wgd": gd / refs,
                "learned-lru": learned / refs,
            }
        shadows = (self._lru, self._lfu, self._learned, self._gd)
        return AdaptiveSummary(
            following=following,
            switches=self.switch_count,
            epochs=self.epochs,
            sampled_references=self.references,
            sample_rate=self._hasher.rate,
            estimated_hit_rates=estimates,
            shadow_entries=sum(map(len, shadows)) + len(self._gd._ghosts),
            node_records=len(self._names),
        )
