"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, penalties, seeds, logprobs.

`sample(logits, states)` takes one row of logits per request and one `SamplingState` per row.
A state carries the request's parameters, its token counts (for penalties) and its own
`torch.Generator`, so a seeded request draws the same tokens whatever else is in the batch.
Temperature 0 (or below `GREEDY_BELOW`) is greedy and ignores the seed. A request with a
grammar only ever samples a token its grammar allows (the mask comes before penalties, filters
and logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from radixserve.model.grammar import GrammarMatcher, apply_masks
from radixserve.sched.request import SamplingParams


@dataclass
class SamplingState:
    """Per-request sampling state that lives as long as the request."""

    params: SamplingParams
    prompt_ids: torch.Tensor
    generator: torch.Generator | None = None
    output_counts: dict[int, int] = field(default_factory=dict)
    matcher: GrammarMatcher | None = None

    @classmethod
    def create(
        cls, params: SamplingParams, prompt_ids, device: torch.device | str, fallback_seed: int
    ) -> SamplingState:
        generator = None
        if not is_greedy(params):
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed if params.seed is not None else fallback_seed)
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
        return cls(params, prompt, generator)

    def observe(self, token: int) -> None:
        """Record a generated token (for penalties, and to advance the grammar if any)."""
        self.output_counts[token] = self.output_counts.get(token, 0) + 1
        if self.matcher is not None:
            self.matcher.accept(token)


GREEDY_BELOW = 1e-5
"""Temperatures under this are greedy: dividing logits by a subnormal one overflows to inf."""


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


@dataclass
class SampleOutput:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def apply_penalties(logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """OpenAI frequency/presence penalties over output tokens; HF repetition penalty over all."""
    p = state.params
    if p.repetition_penalty != 1.0:
        seen = state.prompt_ids
        if state.output_counts:
            out = torch.tensor(list(state.output_counts), dtype=torch.long, device=logits.device)
            seen = torch.cat([seen, out])
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )
    if (p.frequency_penalty or p.presence_penalty) and state.output_counts:
        ids = torch.tensor(list(state.output_counts), dtype=torch.long, device=logits.device)
        counts = torch.tensor(
            list(state.output_counts.values()), dtype=logits.dtype, device=logits.device
        )
        logits[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return logits


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero out what top-k, top-p (smallest set reaching top_p) and min-p exclude; renormalise."""
    if top_k and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = before < top_p * sorted_probs.sum()
        keep_sorted[..., 0] = True  # a vanishing top_p still keeps the most likely token
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The first index of each row's largest value (a NaN counts as largest), as torch's
    `argmax` gives it. On the CPU numpy finds it: torch's `argmax` over a 49,152-token vocabulary
    took 51 µs for one row and 1.3 ms for 32 here, numpy's 5 µs and 0.11 ms."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1).tolist()
    return np.argmax(logits.numpy(), axis=-1).tolist()


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[SampleOutput]:
    """One next token per row of `logits` [B, vocab], each by its own request's rules."""
    logits = logits.float()
    apply_masks(logits, [s.matcher for s in states])
    want_logprobs = any(s.params.logprobs is not None for s in states)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    greedy_rows = [
        i
        for i, s in enumerate(states)
        if is_greedy(s.params)
        and s.params.repetition_penalty == 1.0
        and not (s.params.frequency_penalty or s.params.presence_penalty)
    ]
    tokens: list[int] = [0] * len(states)
    if greedy_rows:
        picked = greedy_tokens(logits if len(greedy_rows) == len(states) else logits[greedy_rows])
        for row, token in zip(greedy_rows, picked, strict=True):
            tokens[row] = token
    greedy = set(greedy_rows)
    for i, state in enumerate(states):
        if i in greedy:
            continue
        p = state.params
        row = apply_penalties(logits[i].clone(), state)
        if is_greedy(p):
            tokens[i] = int(row.argmax())
            continue
        scaled = torch.nan_to_num(row / p.temperature, posinf=torch.finfo(row.dtype).max)
        probs = filter_probs(torch.softmax(scaled, dim=-1), p.top_k, p.top_p, p.min_p)
        tokens[i] = int(torch.multinomial(probs, 1, generator=state.generator))
    outputs = []
    for i, (state, token) in enumerate(zip(states, tokens, strict=True)):
        out = SampleOutput(token)
        n = state.params.logprobs
        if n is not None:
            out.logprob = float(logprobs[i, token])
            if n:
                top = torch.topk(logprobs[i], n)
                out.top_logprobs = [  # a grammar may leave fewer than n tokens possible
                    (t, lp)
                    for t, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                    if lp > float("-inf")
                ]
        outputs.append(out)
    return outputs
