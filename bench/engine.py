"""How fast is the engine on the embedded model, and how close to the machine's limits?

    python bench/engine.py                  # everything, CPU, 2 threads
    python bench/engine.py --parts d,c      # only the roofline and decode parts
    python bench/engine.py --device cuda --dtype bfloat16 --parts a

(a) Shared prefix: 8 groups x 16 prompts, a 1,024-token system prompt per group, a 64-token
    question each, 32 output tokens. Radix cache on and off, same run: throughput, mean TTFT,
    the speed-up, and the ideal speed-up (prefill time scaled by unique/total prompt tokens,
    decode time the same on both sides).
(b) The same workload through transformers' batched `generate` (left-padded batches of one
    group) on the same dequantized weights.
(c) Decode throughput at batch 1, 8 and 32.
(d) The roofline: the matmul rate and the weight-streaming bandwidth, measured here, against
    prefill of 1,024-token chunks and batch-1 decode.
(e) Weight formats side by side (float32, bfloat16, int8, int4): prefill of 512 tokens, decode
    at batch 1 over 128 tokens and at batch 32, the weight bytes each decode step streams and
    the share of the streaming bound reached, each as a ratio to float32 in the same run.

(f) Mixed chunks on and off: 8 streams decode while a 2,048-token prompt arrives and is
    prefilled in 256-token chunks; the streams' time per output token (p50, p99, max) and
    their throughput.

(h) Prefill attention on CUDA: the part (a) workload prefilled (one output token each), radix
    cache off then on, with one variable-length FlashAttention call a layer over the whole
    batch against one SDPA call a request, alternating, best of `--repeats`.

(g) The peer, llama.cpp (`--llama-cpp`): llama-cpp-python's `Llama` on the same GGUF with the
    same threads, each side in a fresh process: prefill of 512 tokens, batch-1 decode over 128
    tokens, and resident memory after the run. `--install-llama-cpp` first builds
    llama-cpp-python from its PyPI sdist with LLAMA_CPP_CMAKE_ARGS (GGML_NATIVE=OFF with
    AVX2/AVX512 named: a native build of 0.3.36 segfaulted on its first eval here).

`--compile` runs decode steps through torch.compile (`EngineConfig.compile`) in parts a-f, and
adds a compiled radixserve row to part (g) beside the eager one. `--compile-aot` does the same
with the batch-1 step compiled ahead of time (`EngineConfig.compile_aot`); its first run
compiles for a few minutes, later ones load the cached package.

`--weight-format` picks the format of parts a, c and d (default auto); part b, the
transformers comparison, always runs on the float32 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

from radixserve.engine import Engine
from radixserve.model.llama import hf_state_dict
from radixserve.model.quant import weight_bytes_per_token
from radixserve.sched.scheduler import ForwardMode

GROUPS, PER_GROUP, SYSTEM, QUESTION, OUTPUT = 8, 16, 1024, 64, 32


def shared_prefix_prompts(vocab: int, groups: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(groups):
        system = rng.integers(100, vocab, SYSTEM).tolist()
        prompts += [system + rng.integers(100, vocab, QUESTION).tolist() for _ in range(PER_GROUP)]
    return prompts


def timed_run(engine: Engine, prompts, params) -> dict:
    """Submit everything at once and step to completion, timing extend and decode steps."""
    for p in prompts:
        engine.add_request(p, params)
    times = {ForwardMode.EXTEND: 0.0, ForwardMode.DECODE: 0.0}
    results = []
    start = time.perf_counter()
    original = engine.scheduler.step

    def step():
        batch = original()
        if batch is not None:
            step.mode = batch.mode
        return batch

    engine.scheduler.step = step
    try:
        while engine.has_work():
            step.mode = None
            t0 = time.perf_counter()
            chunks = engine.step()
            if step.mode is not None:
                times[step.mode] += time.perf_counter() - t0
            results += [c.result for c in chunks if c.finished]
    finally:
        engine.scheduler.step = original
    wall = time.perf_counter() - start
    out_tokens = sum(len(r.token_ids) for r in results)
    return {
        "wall": wall,
        "prefill": times[ForwardMode.EXTEND],
        "decode": times[ForwardMode.DECODE],
        "out_tokens": out_tokens,
        "ttft": float(np.mean([r.meta["ttft"] for r in results])),
        "cached": sum(r.usage.cached_tokens for r in results),
        "prompt": sum(r.usage.prompt_tokens for r in results),
        "results": results,
    }


def part_a(args, make_engine) -> None:
    params = {"max_new_tokens": OUTPUT, "ignore_eos": True}
    runs = {}
    for on in (True, False):
        engine = make_engine(enable_radix_cache=on, kv_cache_tokens=40_960)
        prompts = shared_prefix_prompts(engine.model.config.vocab_size, args.groups)
        runs[on] = timed_run(engine, prompts, params)
        engine.check_invariants()
        del engine
    on, off = runs[True], runs[False]
    unique = args.groups * SYSTEM + args.groups * PER_GROUP * QUESTION
    total = on["prompt"]
    ideal_on = off["prefill"] * unique / total + off["decode"]
    ideal = off["wall"] / ideal_on
    speedup = off["wall"] / on["wall"]
    print(
        f"(a) shared prefix, {args.groups}x{PER_GROUP} prompts of {SYSTEM}+{QUESTION} tokens, "
        f"{OUTPUT} out"
    )
    for name, r in (("radix on", on), ("radix off", off)):
        rate = (r["prompt"] + r["out_tokens"]) / r["wall"]
        print(
            f"    {name:<10} {r['wall']:8.1f} s  {r['out_tokens'] / r['wall']:7.1f} out tok/s  "
            f"{rate:8.1f} tok/s  mean TTFT {r['ttft']:6.2f} s  (prefill {r['prefill']:.1f} s, "
            f"decode {r['decode']:.1f} s, cached {r['cached']})"
        )
    print(
        f"    speed-up {speedup:.2f}x; ideal {ideal:.2f}x (prompt tokens {total} / unique "
        f"{unique}); ratio {speedup / ideal:.2f} (target >= 0.8)"
    )
    pairs = list(zip(on["results"], off["results"], strict=True))
    same = sum(a.token_ids == b.token_ids for a, b in pairs)
    print(f"    greedy outputs identical on and off: {same} of {len(pairs)}")
    return on


def part_b(args, make_engine, on_run) -> None:
    import transformers

    engine = make_engine(kv_cache_tokens=1024, weight_format="float32")
    cfg = engine.model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(hf_config).to(engine.dtype).eval()
    model.load_state_dict(hf_state_dict(engine.model), strict=False)
    prompts = shared_prefix_prompts(cfg.vocab_size, args.hf_groups)
    start = time.perf_counter()
    out_tokens = 0
    with torch.inference_mode():
        for g in range(args.hf_groups):
            batch = torch.tensor(prompts[g * PER_GROUP : (g + 1) * PER_GROUP])
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=OUTPUT,
                min_new_tokens=OUTPUT,
                do_sample=False,
                pad_token_id=0,
            )
            out_tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    wall = time.perf_counter() - start
    hf_rate = out_tokens / wall
    print(
        f"(b) transformers generate, {args.hf_groups} batches of {PER_GROUP}: {wall:.1f} s, "
        f"{hf_rate:.1f} out tok/s"
    )
    if on_run is not None:
        ours = on_run["out_tokens"] / on_run["wall"]
        print(
            f"    radixserve (radix on) / transformers throughput: {ours / hf_rate:.2f}x "
            f"(target >= 3)"
        )


def part_c(args, make_engine) -> dict:
    """Decode rates by batch size, each variant beside eager in the same run: on CUDA eager
    is without CUDA graphs and a second variant replays them; --compile adds a compiled one."""
    cuda = args.device.startswith("cuda")
    variants = {"eager": dict(compile=False, compile_aot=False, cuda_graph=False)}
    if cuda:
        variants["cuda graphs"] = dict(compile=False, compile_aot=False, cuda_graph=True)
    if args.compile or args.compile_aot:
        variants["compiled"] = dict(compile=True, compile_aot=args.compile_aot, cuda_graph=cuda)
    rates: dict[str, dict[int, float]] = {}
    for name, options in variants.items():
        engine = make_engine(kv_cache_tokens=8192, **options)
        rates[name] = {}
        rng = np.random.default_rng(1)
        for batch in (1, 8, 32):
            prompts = [rng.integers(100, 40_000, 16).tolist() for _ in range(batch)]
            params = {"max_new_tokens": 64, "ignore_eos": True}
            if cuda:  # graphs for the widths this run reaches are captured before timing
                timed_run(engine, prompts, params)
            run = timed_run(engine, prompts, params)
            decoded = run["out_tokens"] - batch  # the first token of each comes from prefill
            rates[name][batch] = rate = decoded / run["decode"]
            ratio = f"  {rate / rates['eager'][batch]:.2f}x eager" if name != "eager" else ""
            label = "" if name == "eager" else f" {name}"
            print(
                f"(c) decode, batch {batch:>2}{label}: "
                f"{rate:8.1f} tok/s ({rate / batch:.1f} per request){ratio}"
            )
    return rates[list(variants)[-1]]


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work, so that a timer brackets only what it should."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def streaming_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a float32 matrix-vector product over 512 MiB."""
    w = torch.randn(8192, 16384, device=dev)
    x = torch.randn(16384, device=dev)
    w @ x
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        w @ x
    sync(dev)
    return 5 * w.numel() * w.element_size() / (time.perf_counter() - t0)


def part_d(args, make_engine, decode_rates) -> None:
    threads = torch.get_num_threads()
    engine = make_engine(kv_cache_tokens=4096, chunked_prefill_size=1024)
    dtype = engine.dtype  # prefill's large matmuls run in the activation dtype
    dev = torch.device(args.device)
    a = torch.randn(2048, 2048, dtype=dtype, device=dev)
    b = torch.randn(2048, 2048, dtype=dtype, device=dev)
    for _ in range(2):
        a @ b
    reps = 10
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    flops = 2 * 2048**3 * reps / (time.perf_counter() - t0)
    del a, b
    bandwidth = streaming_bandwidth(dev)
    cfg = engine.model.config
    layer_params = cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size * (
        1 if cfg.tie_word_embeddings else 2
    )
    head_params = cfg.vocab_size * cfg.hidden_size
    # Decode streams every linear weight (the embedding is a one-row lookup) once per step.
    weight_bytes = weight_bytes_per_token(engine.model)
    # Prefill FLOPs per token of a 1,024-token chunk: the projections, plus QK^T and PV over
    # an average causal context of 512, plus the LM head once per chunk.
    chunk = 1024
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * chunk / 2
    flops_per_token = 2 * layer_params + attention + 2 * head_params / chunk
    rng = np.random.default_rng(2)
    prompt = rng.integers(100, 40_000, 1024).tolist()
    engine.generate([prompt], {"max_new_tokens": 1})  # warm-up
    engine.cache.reset()
    run = timed_run(engine, [rng.integers(100, 40_000, 1024).tolist()], {"max_new_tokens": 1})
    prefill_rate = 1024 / run["prefill"]
    prefill_bound = flops / flops_per_token
    decode_bound = bandwidth / weight_bytes
    print(
        f"(d) roofline, {threads} threads, weights {engine.weight_format}: {dtype} matmul "
        f"{flops / 1e9:.1f} GFLOP/s, weight streaming {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"    prefill, one 1,024-token chunk: {prefill_rate:.0f} tok/s = "
        f"{prefill_rate / prefill_bound:.0%} of the matmul bound {prefill_bound:.0f} tok/s "
        f"(target >= 60%)"
    )
    if decode_rates is None:
        decode_rates = part_c(args, make_engine)
    print(
        f"    decode, batch 1: {decode_rates[1]:.1f} tok/s = "
        f"{decode_rates[1] / decode_bound:.0%} of the streaming bound {decode_bound:.1f} tok/s "
        f"({weight_bytes / 2**20:.0f} MiB of weights; target >= 60%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--parts", default="a,b,c,d,e,f")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument(
        "--model", default=None, help="a checkpoint other than the embedded model (parts a-f)"
    )
    parser.add_argument("--llama-cpp", action="store_true", help="part (g): llama.cpp beside us")
    parser.add_argument("--install-llama-cpp", action="store_true", help="build it first")
    parser.add_argument("--peer-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="EngineConfig.compile")
    parser.add_argument("--compile-aot", action="store_true", help="EngineConfig.compile_aot")
    parser.add_argument("--groups", type=int, default=GROUPS)
    parser.add_argument("--hf-groups", type=int, default=GROUPS)
    parser.add_argument("--repeats", type=int, default=3, help="part (h): runs of each side")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peer_child:
        print(json.dumps(peer_figures(args.peer_child, args.threads, args.weight_format)))
        return
    parts = set(args.parts.split(","))

    def make_engine(**options):
        options.setdefault("weight_format", args.weight_format)
        options.setdefault("dtype", args.dtype)
        options.setdefault("compile", args.compile)
        options.setdefault("compile_aot", args.compile_aot)
        return Engine(args.model, device=args.device, threads=args.threads, **options)

    on_run = part_a(args, make_engine) if "a" in parts else None
    if "b" in parts:
        part_b(args, make_engine, on_run)
    rates = part_c(args, make_engine) if "c" in parts else None
    if "d" in parts:
        part_d(args, make_engine, rates)
    if "e" in parts:
        part_e(args, make_engine)
    if "f" in parts:
        part_f(args, make_engine)
    if "h" in parts:
        part_h(args, make_engine)
    if args.install_llama_cpp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-binary",
                "llama-cpp-python",
                f"llama-cpp-python=={LLAMA_CPP_VERSION}",
            ],
            env={**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS},
            check=True,
        )
    if args.llama_cpp or args.install_llama_cpp:
        part_g(args)


LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
)


def peer_figures(side: str, threads: int, weight_format: str) -> dict:
    """Prefill 512 / decode 128 / RSS of one side, measured in this (fresh) process."""
    from radixserve.model.loader import default_model_path

    rng = np.random.default_rng(5)
    prompt = rng.integers(100, 40_000, 512).tolist()
    if side == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(
            model_path=str(default_model_path()),
            n_ctx=2048,
            n_threads=threads,
            n_batch=512,
            verbose=False,
        )
        llm.eval(prompt[:64])  # warm-up
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefill = 512 / (time.perf_counter() - start)
        llm.reset()
        llm.eval([100, 200, 300])
        start = time.perf_counter()
        for _ in range(128):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        decode = 128 / (time.perf_counter() - start)
    else:
        engine = Engine(
            threads=threads,
            weight_format=weight_format,
            kv_cache_tokens=4096,
            compile=side == "radixserve --compile",
            compile_aot=side == "radixserve --compile-aot",
        )
        engine.generate([prompt[:64]], {"max_new_tokens": 2})
        run = timed_run(engine, [prompt], {"max_new_tokens": 1})
        prefill = 512 / run["prefill"]
        run = timed_run(engine, [[100, 200, 300]], {"max_new_tokens": 129, "ignore_eos": True})
        decode = 128 / run["decode"]
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
    return {"prefill": prefill, "decode": decode, "rss_mib": rss}


def part_g(args) -> None:
    sides = [
        "radixserve",
        *(["radixserve --compile"] if args.compile else []),
        *(["radixserve --compile-aot"] if args.compile_aot else []),
        "llama.cpp",
    ]
    rows = {}
    for side in sides:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--peer-child",
                side,
                "--threads",
                str(args.threads),
                "--weight-format",
                args.weight_format,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        rows[side] = json.loads(out.stdout.strip().splitlines()[-1])
    peer = rows["llama.cpp"]
    print(f"(g) against llama.cpp {LLAMA_CPP_VERSION} on the same GGUF, {args.threads} threads")
    for side in sides[:-1]:
        ours = rows[side]
        for key, name in (("prefill", "prefill 512, tok/s"), ("decode", "decode b1, tok/s")):
            print(
                f"    {name:<20} {side:<26} {ours[key]:7.1f}  llama.cpp {peer[key]:7.1f}  "
                f"ratio {ours[key] / peer[key]:.2f}x"
            )
        print(
            f"    {'RSS, MiB':<20} {side:<26} {ours['rss_mib']:7.0f}  "
            f"llama.cpp {peer['rss_mib']:7.0f}"
        )


def part_f(args, make_engine) -> None:
    print("(f) mixed chunks: 8 streams, a 2,048-token prompt arrives at step 10")
    for mixed in (False, True):
        engine = make_engine(enable_mixed_chunk=mixed, chunked_prefill_size=256)
        rng = np.random.default_rng(4)
        params = {"max_new_tokens": 120, "ignore_eos": True}
        streams = {
            engine.add_request(rng.integers(100, 40_000, 32).tolist(), params) for _ in range(8)
        }
        last: dict[str, float] = {}
        gaps, out, steps = [], 0, 0
        start = time.perf_counter()
        while engine.has_work():
            if steps == 10:
                engine.add_request(rng.integers(100, 40_000, 2048).tolist(), {"max_new_tokens": 1})
            chunks = engine.step()
            steps += 1
            now = time.perf_counter()
            for c in chunks:
                if c.rid in streams and c.token_ids:
                    if c.rid in last:
                        gaps.append((now - last[c.rid]) / len(c.token_ids))
                    last[c.rid] = now
                    out += len(c.token_ids)
        wall = time.perf_counter() - start
        ms = np.array(gaps) * 1000
        print(
            f"    mixed {'on ' if mixed else 'off'}: TPOT p50 {np.percentile(ms, 50):5.0f} ms, "
            f"p99 {np.percentile(ms, 99):5.0f} ms, max {ms.max():5.0f} ms; "
            f"streams {out / wall:6.1f} tok/s"
        )


def part_h(args, make_engine) -> None:
    print(
        f"(h) prefill attention, {args.groups}x{PER_GROUP} prompts of {SYSTEM}+{QUESTION} "
        "tokens, 1 out: varlen (one call a layer) against the per-request loop"
    )
    probe = make_engine(kv_cache_tokens=1024, cuda_graph=False)
    if probe.device.type != "cuda" or probe.dtype not in (torch.bfloat16, torch.float16):
        print(
            f"    skipped: the varlen kernel runs on CUDA in half precision, not {probe.dtype} "
            f"on {probe.device.type}"
        )
        return
    del probe
    params = {"max_new_tokens": 1, "ignore_eos": True}
    for radix in (False, True):
        best: dict[bool, dict] = {}
        for _ in range(args.repeats):
            for varlen in (True, False):
                engine = make_engine(
                    enable_radix_cache=radix, kv_cache_tokens=40_960, cuda_graph=False
                )
                engine.attention.varlen = varlen
                engine.generate([[100, 200, 300]], params)  # warm-up
                prompts = shared_prefix_prompts(engine.model.config.vocab_size, args.groups)
                run = timed_run(engine, prompts, params)
                if varlen and not engine.attention.varlen:
                    print("    varlen prefill fell back to the loop (see the log)")
                engine.check_invariants()
                if varlen not in best or run["prefill"] < best[varlen]["prefill"]:
                    best[varlen] = run
                del engine
        rates = {v: (r["prompt"] - r["cached"]) / r["prefill"] for v, r in best.items()}
        pairs = list(zip(best[True]["results"], best[False]["results"], strict=True))
        same = sum(a.token_ids == b.token_ids for a, b in pairs)
        print(
            f"    radix {'on ' if radix else 'off'}: varlen {best[True]['prefill']:6.3f} s "
            f"({rates[True]:9.0f} tok/s), loop {best[False]['prefill']:6.3f} s "
            f"({rates[False]:9.0f} tok/s), ratio {rates[True] / rates[False]:.2f}x; "
            f"same first token in {same} of {len(pairs)}"
        )


def part_e(args, make_engine) -> None:
    bandwidth = streaming_bandwidth(torch.device(args.device))
    rng = np.random.default_rng(3)
    rows = {}
    for fmt in ("float32", "bfloat16", "int8", "int4"):
        engine = make_engine(weight_format=fmt, dtype=None, kv_cache_tokens=8192)
        engine.generate([rng.integers(100, 40_000, 512).tolist()], {"max_new_tokens": 1})
        prefill = timed_run(
            engine, [rng.integers(100, 40_000, 512).tolist()], {"max_new_tokens": 1}
        )
        one = timed_run(engine, [[100, 200, 300]], {"max_new_tokens": 129, "ignore_eos": True})
        prompts = [rng.integers(100, 40_000, 16).tolist() for _ in range(32)]
        many = timed_run(engine, prompts, {"max_new_tokens": 33, "ignore_eos": True})
        streamed = weight_bytes_per_token(engine.model)
        rows[fmt] = (
            512 / prefill["prefill"],
            128 / one["decode"],
            32 * 32 / many["decode"],
            streamed,
        )
        del engine
    base = rows["float32"]
    print(
        f"(e) weight formats, {args.threads} threads, streaming bound at {bandwidth / 1e9:.1f} GB/s"
    )
    print("    format    prefill 512  decode b1       bound  decode b32   MiB/token")
    for fmt, (pre, b1, b32, streamed) in rows.items():
        share = b1 / (bandwidth / streamed)
        print(
            f"    {fmt:<9} {pre:7.0f} ({pre / base[0]:.2f}x) {b1:6.1f} ({b1 / base[1]:.2f}x) "
            f"{share:5.0%}  {b32:6.0f} ({b32 / base[2]:.2f}x)  {streamed / 2**20:6.1f}"
        )


if __name__ == "__main__":
    main()
