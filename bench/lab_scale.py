"""The policy lab on a trace of production size: block-level replay time and memory.

The trace is synthetic (`chat_traffic`, 512-token blocks) and only its size follows the
public Mooncake conversation trace: about 12,000 requests over an hour and about 150M prompt
tokens. Its hit rates say nothing about that trace; the figures here are time and memory.

Each cell runs `radixserve replay` in its own process, as a user would, one policy per
process, at 1% of the trace's unique blocks with fcfs:
- the scheduled replay with one key per block (the default for Mooncake traces);
- the pure cache simulation (`--cache-only`);
- with `--token-baseline`, the same scheduled LRU replay at token level (`--keys tokens
  --page-size 512`), the way the lab ran such a trace before block keys, as the baseline in
  the same run. It takes a few minutes and about 3 GB.

Targets (issue 13): lru and wgd <= 30 s, belady <= 60 s, cache-only <= 10 s per policy, peak
RSS <= 4 GB.

    python bench/lab_scale.py
    python bench/lab_scale.py --token-baseline
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from radixserve.sim.traces import write_mooncake
from radixserve.sim.workloads import chat_traffic

# Sized to the public trace's request count and prompt volume, nothing else.
TRACE_ARGS = dict(
    num_sessions=6000,
    mean_turns=2.0,
    doc_share=0.35,
    doc_blocks=(8, 40),
    duration_s=3600.0,
    block_size=512,
    seed=0,
)
TARGETS = {"lru": 30.0, "wgd": 30.0, "belady": 60.0}
CACHE_ONLY_TARGET = 10.0

# Runs the CLI in a child process and prints its peak RSS (KiB on Linux) as the last line.
CHILD = """
import resource, sys
from radixserve.cli import main
code = main(sys.argv[1:])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def run_cell(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB, the table's row) of one `radixserve` run."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"radixserve {' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    lines = done.stdout.splitlines()
    rss = float(lines[-1].split()[1]) / 1024
    return wall, rss, [line for line in lines if line.startswith("| ")][-1]


def hit_rate(row: str, column: int) -> str:
    return row.strip("|").split("|")[column].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", default="lru,wgd,belady")
    parser.add_argument("--token-baseline", action="store_true")
    args = parser.parse_args()
    policies = args.policies.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "chat-12k.jsonl"
        records = chat_traffic(**TRACE_ARGS)
        write_mooncake(trace, records)
        blocks = sum(len(r["hash_ids"]) for r in records)
        unique = len({h for r in records for h in r["hash_ids"]})
        tokens = sum(r["input_length"] for r in records)
        print(
            f"trace: {len(records):,} requests, {tokens / 1e6:.1f}M prompt tokens, "
            f"{blocks:,} blocks, {unique:,} unique blocks (synthetic, sized like the public "
            "Mooncake conversation trace)\n"
        )
        common = [str(trace), "--schedule", "fcfs", "--cache", "1%"]
        results = []
        print("| run | policy | wall s | target s | peak RSS MB | hit rate % |")
        print("|---|---|---|---|---|---|")
        for policy in policies:
            wall, rss, row = run_cell(["replay", *common, "--eviction", policy])
            results.append(("scheduled, block keys", policy, wall, rss, hit_rate(row, 4)))
            print(
                f"| scheduled, block keys | {policy} | {wall:.1f} | "
                f"{TARGETS.get(policy, float('nan')):g} | {rss:.0f} | {hit_rate(row, 4)} |"
            )
        for policy in policies:
            wall, rss, row = run_cell(["replay", *common, "--eviction", policy, "--cache-only"])
            results.append(("cache only", policy, wall, rss, hit_rate(row, 3)))
            print(
                f"| cache only | {policy} | {wall:.1f} | {CACHE_ONLY_TARGET:g} | {rss:.0f} | "
                f"{hit_rate(row, 3)} |"
            )
        if args.token_baseline:
            argv = ["replay", *common, "--eviction", "lru", "--keys", "tokens"]
            wall, rss, row = run_cell([*argv, "--page-size", "512"])
            results.append(
                ("scheduled, token level (baseline)", "lru", wall, rss, hit_rate(row, 4))
            )
            print(
                f"| scheduled, token level, page 512 (baseline) | lru | {wall:.1f} | - | "
                f"{rss:.0f} | {hit_rate(row, 4)} |"
            )
            block_lru = next(r for r in results if r[:2] == ("scheduled, block keys", "lru"))
            print(
                f"\nblock keys against token level, lru: {block_lru[2] / wall:.3f}x the time, "
                f"{block_lru[3] / rss:.3f}x the peak RSS"
            )


if __name__ == "__main__":
    main()
