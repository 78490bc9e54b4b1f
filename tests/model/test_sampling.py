"""Sampling rules, seeds, stop strings, penalties and logprobs."""

from __future__ import annotations

import pytest
import torch
from model_helpers import make_engine

from radixserve.model.sampling import SamplingState, filter_probs, greedy_tokens, sample
from radixserve.sched import SamplingParams


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    kept = filter_probs(probs, top_k=0, top_p=0.6, min_p=0.0)
    assert kept.tolist() == pytest.approx([0.0, 0.0, 3 / 7, 4 / 7])


def test_top_k_and_min_p():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert (filter_probs(probs, top_k=3, top_p=1.0, min_p=0.0) > 0).tolist() == [
        False,
        True,
        True,
        True,
    ]
    assert (filter_probs(probs, top_k=0, top_p=1.0, min_p=0.6) > 0).tolist() == [
        False,
        False,
        True,
        True,
    ]


def state(**params) -> SamplingState:
    return SamplingState.create(SamplingParams(**params), [1, 2], "cpu", fallback_seed=0)


def test_greedy_ignores_the_seed_and_sampling_follows_it():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    greedy = [sample(logits, [state(seed=s)])[0].token for s in range(5)]
    assert len(set(greedy)) == 1 and greedy[0] == int(logits.argmax())
    draws_a = [sample(logits, [s])[0].token for s in [state(temperature=1.0, seed=3)] * 8]
    draws_b = [sample(logits, [s])[0].token for s in [state(temperature=1.0, seed=3)] * 8]
    assert draws_a == draws_b


def test_greedy_tokens_are_torchs_argmax_ties_and_nans_included():
    rows = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    rows[1, [7, 40]] = 50.0  # a tie: the first index wins
    rows[2, :] = float("-inf")
    rows[2, 9] = -1.0
    rows[3, 12] = float("nan")  # NaN is the largest, as in torch
    rows[4, :] = 0.0
    assert greedy_tokens(rows) == rows.argmax(dim=-1).tolist() == greedy_tokens(rows.double())
    assert greedy_tokens(rows)[1:4] == [7, 9, 12]


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-8])
def test_a_vanishing_temperature_is_greedy_not_a_crash(temperature):
    """Found by the fuzz test: logits / 5e-324 overflow to inf, and softmax gave NaN."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1)) * 30
    tiny = state(temperature=temperature, seed=1, frequency_penalty=0.5)
    picked = sample(logits, [tiny, state(temperature=temperature)])
    assert [p.token for p in picked] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        {"top_p": 5e-324},
        {"top_p": 1e-30, "top_k": 1},
        {"repetition_penalty": 5e-324},
        {"min_p": 1.0},
    ],
)
def test_extreme_filters_and_penalties_still_draw_a_token(params):
    """Found by the fuzz test in CI: top_p 5e-324 kept no token, and sampling raised."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2)) * 10
    [out] = sample(logits.clone(), [state(temperature=1.0, seed=4, **params)])
    assert 0 <= out.token < 50
    if "top_p" in params or "min_p" in params:
        assert out.token == int(logits.argmax())


def test_penalties_push_seen_tokens_down():
    logits = torch.zeros(1, 5)
    logits[0, 2] = 1.0
    s = state(frequency_penalty=2.0)
    s.observe(2)
    assert sample(logits, [s])[0].token != 2
    logits = torch.full((1, 5), 0.5)
    logits[0, 2] = 1.0
    r = state(repetition_penalty=5.0)  # prompt tokens 1 and 2 count as seen: 1.0 -> 0.2
    assert sample(logits, [r])[0].token not in (1, 2)


def test_logprobs_report_the_chosen_token_and_the_top_n():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    (out,) = sample(logits, [state(logprobs=2)])
    assert out.token == 3
    assert out.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 3]))
    assert [t for t, _ in out.top_logprobs] == [3, 2]


@pytest.fixture(scope="module")
def engine(llama_dir):
    return make_engine(llama_dir, dtype="float64")


def test_same_seed_same_output_in_the_engine(engine):
    params = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 11}
    a = engine.generate([[5, 6, 7]], params)[0].token_ids
    b = engine.generate([[5, 6, 7]], params)[0].token_ids
    c = engine.generate([[5, 6, 7]], {**params, "seed": 12})[0].token_ids
    assert a == b and a != c
    # A seeded request draws the same tokens whatever else shares its batch.
    batch = engine.generate([[5, 6, 7], [8, 9]], [params, {"max_new_tokens": 16}])
    assert batch[0].token_ids == a


def test_temperature_zero_ignores_the_seed_in_the_engine(engine):
    outs = {
        tuple(engine.generate([[5, 6, 7]], {"max_new_tokens": 8, "seed": s})[0].token_ids)
        for s in (1, 2, 3)
    }
    assert len(outs) == 1


def test_stop_strings_are_cut_even_across_tokens(engine):
    full = engine.generate([[5, 9, 13]], {"max_new_tokens": 12})[0]
    words = full.text.split()
    assert len(words) == 12
    stop = f"{words[3]} {words[4]}"  # spans two tokens
    cut = engine.generate([[5, 9, 13]], {"max_new_tokens": 12, "stop": [stop]})[0]
    assert cut.finish_reason == "stop"
    assert cut.meta["matched_stop"] == stop
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text
    streamed = "".join(engine.stream([5, 9, 13], {"max_new_tokens": 12, "stop": [stop]}))
    assert streamed == cut.text
    engine.check_invariants()


def test_stop_token_ids_end_the_request(engine):
    full = engine.generate([[5, 9, 13]], {"max_new_tokens": 12})[0]
    stop_id = full.token_ids[2]
    cut = engine.generate([[5, 9, 13]], {"max_new_tokens": 12, "stop_token_ids": [stop_id]})[0]
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert cut.finish_reason == "stop"
