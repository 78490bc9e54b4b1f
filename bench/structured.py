"""What does a JSON schema cost, and does every output follow it?

On the embedded SmolLM2-135M-Instruct, 50 chat prompts ask for a record as JSON. Each runs
three times in the same process: free; constrained by a JSON schema (`json_schema` in the
sampling params, as `response_format` sets it) with jump-forward off; and with it on (the
default: forced text is appended without sampling). All greedy, same `max_new_tokens`.
Reported for batch 1 (the first `--batch1-prompts` prompts, one at a time) and batch 16 (all
50, 16 at a time): output tokens per second, end to end, the ratio free / constrained (the
issue's target is at most 1.15) and seconds per answer; the share of constrained outputs that
parse and validate against the schema (target 100%); and the compile time of the schema, cold
and cached (after the one-off build of the compiler for the vocabulary, which `radixserve
serve` does at start).

It also counts the forced positions in the outputs without jump-forward: where the grammar
allowed exactly one token.

    python bench/structured.py
    python bench/structured.py --batch1-prompts 20 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jsonschema
import torch

from radixserve import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 48},
        "country": {"type": "string", "maxLength": 48},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 5000},
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "maxItems": 4,
        },
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population_millions", "languages", "capital"],
    "additionalProperties": False,
}
PLACES = [
    "Paris", "Berlin", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Madrid", "Rome",
    "Seoul", "Quito", "Dakar", "Hanoi", "Kyiv", "Accra", "Bogota", "Vienna", "Prague", "Dublin",
    "Nairobi", "Manila", "Santiago", "Toronto", "Sydney",
]  # fmt: skip
ASKS = [
    "Give me a JSON record for the city of {}.",
    "Describe {} as JSON: its name, country, population in millions and languages.",
]


def prompts(engine: Engine) -> list[list[int]]:
    out = []
    for i in range(50):
        text = ASKS[i % 2].format(PLACES[i % len(PLACES)])
        rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        out.append(engine.tokenizer.encode(rendered, add_special_tokens=False))
    return out


def run(engine: Engine, batch: list[list[int]], params: dict, size: int):
    """(results, seconds) for `batch` run `size` at a time."""
    results = []
    start = time.perf_counter()
    for i in range(0, len(batch), size):
        results += engine.generate(batch[i : i + size], params)
    return results, time.perf_counter() - start


def forced_share(engine: Engine, results) -> float:
    """Share of output positions where the grammar allowed exactly one token."""
    import xgrammar as xgr

    compiled = engine.compile_grammar(
        engine.prepare_request([1], {"json_schema": SCHEMA})[1]
    ).result()
    vocab = engine.model.config.vocab_size
    forced = total = 0
    for r in results:
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        for token in r.token_ids:
            matcher.fill_next_token_bitmask(mask, 0)
            allowed = int(sum(bin(w & 0xFFFFFFFF).count("1") for w in mask[0].tolist()))
            forced += allowed == 1
            total += 1
            if not matcher.accept_token(token):
                break
    return forced / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch1-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--weight-format", default="auto")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(weight_format=args.weight_format, kv_cache_tokens=32_768)
    batch = prompts(engine)
    free = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    constrained = {**free, "json_schema": json.dumps(SCHEMA)}

    start = time.perf_counter()
    engine.grammar_backend()
    backend = time.perf_counter() - start
    start = time.perf_counter()
    engine.compile_grammar(engine.prepare_request([1], constrained)[1]).result()
    cold = time.perf_counter() - start
    start = time.perf_counter()
    engine.compile_grammar(engine.prepare_request([1], constrained)[1]).result()
    cached = time.perf_counter() - start
    print(
        f"grammar compiler for the vocabulary (once, at startup): {backend * 1e3:.0f} ms; "
        f"schema compile: cold {cold * 1e3:.1f} ms, cached {cached * 1e6:.0f} us"
    )
    engine.generate(batch[:2], free)  # warm up
    engine.generate(batch[:2], constrained)

    print(
        f"{'batch':>5} {'prompts':>7} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6} "
        f"{'json+jf tok/s':>14} {'ratio':>6} {'s/answer free, json, json+jf':>30}"
    )
    valid_all = []
    for size, count in ((1, args.batch1_prompts), (16, len(batch))):
        rates, latencies = [], []
        for params, jump in ((free, False), (constrained, False), (constrained, True)):
            engine.config = dataclasses.replace(engine.config, enable_jump_forward=jump)
            engine.cache.reset()
            results, seconds = run(engine, batch[:count], params, size)
            rates.append(sum(len(r.token_ids) for r in results) / seconds)
            latencies.append(seconds / count)
            if size == 16 and params is constrained:
                valid_all.append(results)
        print(
            f"{size:>5} {count:>7} {rates[0]:>11.1f} {rates[1]:>11.1f} {rates[0] / rates[1]:>6.2f} "
            f"{rates[2]:>14.1f} {rates[0] / rates[2]:>6.2f} "
            f"{'':>9}{latencies[0]:.2f}, {latencies[1]:.2f}, {latencies[2]:.2f}"
        )
    for results, label in zip(valid_all, ("json", "json+jf"), strict=True):
        valid = 0
        for r in results:
            try:
                jsonschema.validate(json.loads(r.text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                print(f"  invalid ({r.finish_reason}): {r.text[:120]!r}")
        print(f"{label}: valid against the schema: {valid}/{len(results)}")
    forced = forced_share(engine, valid_all[0])
    print(f"forced positions without jump-forward: {forced:.1%} of output tokens")
    print(f"example: {valid_all[1][0].text}")


if __name__ == "__main__":
    main()
