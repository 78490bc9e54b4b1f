"""Admission arithmetic: how many KV tokens requests may take, and in what chunks.

The budget for admitting more work is `available + evictable - reserved`, where `reserved` is
what the requests already running will still need:

- a running request reserves `ceil(min(remaining new tokens, clip) * new_token_ratio)`,
  rounded up to whole pages;
- a request whose prompt is still being prefilled in chunks also reserves the rest of its
  prompt, in whole pages.

`new_token_ratio` is the scheduler's guess of what fraction of `max_new_tokens` requests will
actually generate. It starts at `init`, decays by `decay` each decode step down to `floor`, and
after a retraction is re-estimated from the progress of the requests still running.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from radixserve.errors import InvalidArgumentError
from radixserve.sched.request import Req, pages

RETRACT_LOOKAHEAD_STEPS = 20
"""After a retraction, assume each surviving request decodes at least this many more tokens."""


class NewTokenRatio:
    """The decaying estimate of the fraction of `max_new_tokens` that requests will use."""

    def __init__(self, init: float = 0.7, floor: float = 0.1, decay: float = 0.001) -> None:
        if not 0 < floor <= init <= 1:
            raise InvalidArgumentError(
                f"new_token_ratio needs 0 < floor <= init <= 1, got init={init}, floor={floor}"
            )
        if not 0 <= decay <= 1:
            raise InvalidArgumentError(f"new_token_ratio decay must be in [0, 1], got {decay}")
        self.init, self.floor, self.decay = init, floor, decay
        self.value = init

    def step(self) -> None:
        """One decode step passed without trouble: lean a little less on the reserve."""
        self.value = max(self.floor, self.value - self.decay)

    def reestimate(self, running: Iterable[Req]) -> None:
        """After a retraction: the ratio the surviving requests' progress implies, at most 1."""
        decoded = budgeted = count = 0
        for r in running:
            decoded += len(r.output_ids)
            budgeted += r.sampling.max_new_tokens
            count += 1
        if budgeted:
            estimate = (decoded + RETRACT_LOOKAHEAD_STEPS * count) / budgeted
            self.value = min(1.0, max(self.floor, estimate))
        else:
            self.value = self.init


def output_reserve(req: Req, ratio: float, clip: int, page_size: int) -> int:
    """KV tokens kept back for `req`'s future output tokens."""
    return pages(math.ceil(min(req.remaining_new_tokens(), clip) * ratio), page_size)


def future_need(req: Req, ratio: float, clip: int, page_size: int) -> int:
    """KV tokens `req` will still allocate: the rest of its prompt plus its output reserve."""
    prompt_left = max(0, pages(req.seq_len, page_size) - req.kv_allocated)
    return prompt_left + output_reserve(req, ratio, clip, page_size)


def chunk_tokens(extend_len: int, chunk_budget: int, page_size: int) -> int:
    """Tokens of an `extend_len`-token prefill to compute within `chunk_budget`.

    All of it when it fits; otherwise the largest whole number of pages that fits (possibly 0).
    """
    if extend_len <= chunk_budget:
        return extend_len
    return chunk_budget - chunk_budget % page_size
