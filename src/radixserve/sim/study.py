"""The eviction study: every lab workload, a range of cache sizes, several policies.

Each cell of the study is one `replay` (the scheduler and radix cache the server runs), so a
cell can be rerun alone with `radixserve replay`. The study fixes what is not being studied:
fcfs scheduling, every request queued at once (`arrivals="burst"`) and at most
`max_running_requests` running, so the cache, not the arrival process, decides the hit rate.
Workloads are sized so that 1% of their unique tokens holds several requests; `scale`
multiplies the number of independent sessions, groups, subjects, trees or agents (a test runs
the study at a small scale).

`summarize` compares a policy with LRU and Belady: the fraction of the LRU-to-Belady gap it
closes and its worst case against LRU. `write_report` writes the markdown table, one PNG per
workload and the raw rows as JSON.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from radixserve.errors import InvalidArgumentError
from radixserve.sim.oracle import infinite_cache
from radixserve.sim.replay import ReplayConfig, replay
from radixserve.sim.report import plot_hit_rate_lines
from radixserve.sim.traces import TraceRequest, read_mooncake, write_mooncake
from radixserve.sim.workloads import make_workload, mooncake_conversation

SIZES = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
POLICIES = ("lru", "lfu", "slru", "wgd", "belady")
GAP_SIZES = (1.0, 2.0, 5.0)
MAX_RUNNING_REQUESTS = 4
MOONCAKE_BLOCK_SIZE = 16

# Generator arguments at scale 1. The first entry of each is the count that `scale` multiplies.
STUDY_WORKLOADS: dict[str, dict] = {
    "shared-prefix": dict(
        num_groups=512, prompts_per_group=8, system_len=512, question_len=64, output_len=8
    ),
    "shared-prefix-zipf": dict(
        num_groups=512, prompts_per_group=8, system_len=512, question_len=64, output_len=8
    ),
    "multi-turn": dict(num_sessions=1024, turns=4, system_len=128, user_len=64, output_len=16),
    "multi-turn-random": dict(
        num_sessions=1024, turns=4, system_len=128, user_len=64, output_len=16
    ),
    "few-shot": dict(num_subjects=512, questions_per_subject=8, example_len=96, shots=5),
    "tree-of-thought": dict(num_trees=512, output_len=16),
    "tree-of-thought-shuffled": dict(num_trees=512, output_len=16),
    "agent": dict(num_agents=512, steps=6, system_len=256, observation_len=64, output_len=16),
    "mooncake-conversation": dict(num_sessions=1500),
}


@dataclass(frozen=True)
class StudyRow:
    """One replay of the study."""

    workload: str
    policy: str
    size_percent: float
    kv_tokens: int
    hit_rate: float
    infinite_bound: float
    unique_tokens: int
    requests: int
    evicted_tokens: int
    wall_seconds: float


def _scaled(name: str, scale: float) -> dict:
    if name not in STUDY_WORKLOADS:
        raise InvalidArgumentError(
            f"study workload must be one of {sorted(STUDY_WORKLOADS)}, got {name!r}"
        )
    if not scale > 0:
        raise InvalidArgumentError(f"scale must be > 0, got {scale!r}")
    kwargs = dict(STUDY_WORKLOADS[name])
    count = next(iter(kwargs))
    kwargs[count] = max(2, round(kwargs[count] * scale))
    return kwargs


def workload_trace(name: str, seed: int = 0, **kwargs) -> list[TraceRequest]:
    """A synthetic workload by name: the lab's generators and `mooncake-conversation`.

    `mooncake-conversation` is generated as Mooncake JSONL (blocks of `MOONCAKE_BLOCK_SIZE`
    tokens), written to a file and read back with `read_mooncake`, so it takes the same path
    as a published trace.
    """
    if name != "mooncake-conversation":
        return make_workload(name, seed=seed, **kwargs)
    import tempfile

    try:
        records = mooncake_conversation(block_size=MOONCAKE_BLOCK_SIZE, seed=seed, **kwargs)
    except TypeError as exc:
        raise InvalidArgumentError(f"workload {name}: {exc}") from None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mooncake-conversation.jsonl"
        write_mooncake(path, records)
        return read_mooncake(path, MOONCAKE_BLOCK_SIZE)


@lru_cache(maxsize=4)
def study_trace(name: str, scale: float = 1.0, seed: int = 0) -> tuple[TraceRequest, ...]:
    """The study's trace for workload `name` at `scale`."""
    return tuple(workload_trace(name, seed=seed, **_scaled(name, scale)))


def replay_command(workload: str, policy: str, size: float, scale: float = 1.0) -> str:
    """The `radixserve replay` command line that reproduces one cell of the study."""
    args = ",".join(f"{k}={v}" for k, v in _scaled(workload, scale).items())
    return (
        f"radixserve replay workload:{workload} --workload-args {args} --eviction {policy} "
        f"--schedule fcfs --cache {size:g}% --arrivals burst "
        f"--max-running-requests {MAX_RUNNING_REQUESTS}"
    )


def study_config(policy: str, size: float) -> ReplayConfig:
    """The replay settings of one study cell."""
    return ReplayConfig(
        eviction_policy=policy,
        schedule_policy="fcfs",
        cache_fraction=size,
        arrivals="burst",
        max_running_requests=MAX_RUNNING_REQUESTS,
    )


@lru_cache(maxsize=4)
def _bound(name: str, scale: float, seed: int) -> tuple[float, int]:
    return infinite_cache(study_trace(name, scale, seed))


def run_cell(workload: str, policy: str, size: float, scale: float = 1.0, seed: int = 0):
    """Replay one cell of the study and return its `StudyRow`."""
    trace = study_trace(workload, scale, seed)
    bound, unique = _bound(workload, scale, seed)
    result = replay(trace, study_config(policy, size), unique=unique)
    return StudyRow(
        workload=workload,
        policy=policy,
        size_percent=size,
        kv_tokens=result.kv_tokens,
        hit_rate=result.token_hit_rate,
        infinite_bound=bound,
        unique_tokens=unique,
        requests=result.requests,
        evicted_tokens=result.evicted_tokens,
        wall_seconds=result.wall_seconds,
    )


def run_study(
    workloads: Sequence[str] = tuple(STUDY_WORKLOADS),
    policies: Sequence[str] = POLICIES,
    sizes: Sequence[float] = SIZES,
    *,
    scale: float = 1.0,
    seed: int = 0,
    jobs: int = 1,
    progress: Callable[[StudyRow], None] | None = None,
) -> list[StudyRow]:
    """Replay every (workload, policy, size); rows come back in that order."""
    for name in workloads:
        _scaled(name, scale)
    if not isinstance(jobs, int) or jobs < 1:
        raise InvalidArgumentError(f"jobs must be an integer >= 1, got {jobs!r}")
    cells = [(w, p, float(s), scale, seed) for w in workloads for p in policies for s in sizes]
    rows: list[StudyRow] = []
    if jobs == 1:
        for cell in cells:
            rows.append(run_cell(*cell))
            if progress:
                progress(rows[-1])
        return rows
    # Cells of one workload stay together, so each worker builds a trace once.
    with ProcessPoolExecutor(jobs) as pool:
        for row in pool.map(run_cell, *zip(*cells, strict=True), chunksize=max(1, len(policies))):
            rows.append(row)
            if progress:
                progress(row)
    return rows


@dataclass(frozen=True)
class PolicySummary:
    """How `policy` does against LRU and Belady on one workload.

    `gap_closed` is (policy - LRU) / (Belady - LRU), summed over `GAP_SIZES`; None where
    Belady is not ahead of LRU there by at least `min_gap` points in all, since the ratio
    then measures noise. `worst_vs_lru` is the lowest policy - LRU over every size, in points.
    """

    workload: str
    policy: str
    gap_closed: float | None
    gap_points: float
    worst_vs_lru: float
    worst_size: float


def summarize(
    rows: Iterable[StudyRow],
    policy: str = "wgd",
    baseline: str = "lru",
    oracle: str = "belady",
    gap_sizes: Sequence[float] = GAP_SIZES,
    min_gap: float = 0.5,
) -> list[PolicySummary]:
    """One `PolicySummary` per workload that has `policy`, `baseline` and `oracle` rows."""
    table: dict[tuple[str, str, float], float] = {}
    order: list[str] = []
    for r in rows:
        table[(r.workload, r.policy, r.size_percent)] = 100 * r.hit_rate
        if r.workload not in order:
            order.append(r.workload)
    out = []
    for w in order:
        sizes = sorted(s for (ww, p, s) in table if ww == w and p == policy)
        sizes = [s for s in sizes if (w, baseline, s) in table]
        if not sizes:
            continue
        deltas = [(table[(w, policy, s)] - table[(w, baseline, s)], s) for s in sizes]
        worst, worst_size = min(deltas)
        gained = gap = 0.0
        for s in gap_sizes:
            if (w, oracle, s) in table and (w, policy, s) in table and (w, baseline, s) in table:
                gained += table[(w, policy, s)] - table[(w, baseline, s)]
                gap += table[(w, oracle, s)] - table[(w, baseline, s)]
        closed = gained / gap if gap >= min_gap else None
        out.append(PolicySummary(w, policy, closed, gap, worst, worst_size))
    return out


def mean_gap_closed(summaries: Sequence[PolicySummary]) -> float:
    """The mean of `gap_closed` over the workloads where it is defined (nan if none)."""
    values = [s.gap_closed for s in summaries if s.gap_closed is not None]
    return sum(values) / len(values) if values else math.nan


def _percent(fraction: float) -> str:
    text = f"{fraction:.0%}"
    return "0%" if text == "-0%" else text


def _hit_table(rows: Sequence[StudyRow], workload: str, policy: str = "wgd") -> list[str]:
    mine = [r for r in rows if r.workload == workload]
    policies = list(dict.fromkeys(r.policy for r in mine))
    sizes = sorted({r.size_percent for r in mine})
    cell = {(r.policy, r.size_percent): r for r in mine}
    judged = all(p in policies for p in (policy, "lru", "belady"))
    extra = f" {policy}: gap closed |" if judged else ""
    lines = [
        "| cache % | KV tokens | " + " | ".join(policies) + " | infinite |" + extra,
        "|---|---|" + "---|" * (len(policies) + 1 + judged),
    ]
    for s in sizes:
        any_row = next(cell[(p, s)] for p in policies if (p, s) in cell)
        values = [f"{100 * cell[(p, s)].hit_rate:.1f}" if (p, s) in cell else "" for p in policies]
        line = (
            f"| {s:g} | {any_row.kv_tokens:,} | "
            + " | ".join(values)
            + f" | {100 * any_row.infinite_bound:.1f} |"
        )
        if judged:
            hit = {p: 100 * cell[(p, s)].hit_rate for p in (policy, "lru", "belady")}
            gap = hit["belady"] - hit["lru"]
            closed = (hit[policy] - hit["lru"]) / gap if gap >= 0.5 else None
            line += f" {_percent(closed)} |" if closed is not None else " |"
        lines.append(line)
    return lines


def _plot(path: Path, rows: Sequence[StudyRow], workload: str, policy: str) -> None:
    mine = [r for r in rows if r.workload == workload]
    lines = []
    for name in dict.fromkeys(r.policy for r in mine):
        line = sorted((r for r in mine if r.policy == name), key=lambda r: r.size_percent)
        lines.append((name, [r.size_percent for r in line], [r.hit_rate for r in line]))
    title = f"{workload}: token hit rate by cache size"
    plot_hit_rate_lines(path, lines, mine[0].infinite_bound, title, highlight=policy)


BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"


def report_markdown(
    rows: Sequence[StudyRow], figures: str = "eviction", policy: str = "wgd", scale: float = 1.0
) -> str:
    """The generated part of docs/eviction.md: the summary, then one table per workload."""
    summaries = summarize(rows, policy)
    workloads = list(dict.fromkeys(r.workload for r in rows))
    gap_sizes = ", ".join(f"{s:g}" for s in GAP_SIZES)
    lines = [
        f"Generated by `radixserve study --scale {scale:g}`; "
        f"{len(rows)} replays, {sum(r.wall_seconds for r in rows):.0f} s of replay time.",
        "",
        f"### Summary: `{policy}` against LRU and Belady",
        "",
        f"Gap closed: ({policy} - LRU) / (Belady - LRU) in hit-rate points, summed over "
        f"{gap_sizes}% cache; blank where Belady leads LRU by under 0.5 points there. Worst: "
        f"the lowest {policy} - LRU over every size, in points.",
        "",
        "| workload | LRU→Belady gap, points | gap closed | worst vs LRU, points (at %) |",
        "|---|---|---|---|",
    ]
    for s in summaries:
        closed = "" if s.gap_closed is None else _percent(s.gap_closed)
        lines.append(
            f"| {s.workload} | {s.gap_points:.1f} | {closed} | "
            f"{s.worst_vs_lru:+.1f} ({s.worst_size:g}) |"
        )
    mean = mean_gap_closed(summaries)
    worst = min(summaries, key=lambda s: s.worst_vs_lru) if summaries else None
    lines += [
        "",
        f"Mean gap closed over the workloads with a gap: **{100 * mean:.0f}%**. "
        + (
            f"Worst case against LRU: **{worst.worst_vs_lru:+.1f} points** "
            f"({worst.workload}, {worst.worst_size:g}% cache)."
            if worst
            else ""
        ),
        "",
    ]
    for w in workloads:
        first = next(r for r in rows if r.workload == w)
        lines += [
            f"### {w}",
            "",
            f"{first.requests:,} requests, {first.unique_tokens:,} unique tokens. Token hit "
            "rate, %:",
            "",
            *_hit_table(rows, w, policy),
            "",
            f"![{w}]({figures}/{w}.png)",
            "",
        ]
    return "\n".join(lines)


def write_report(
    out_dir: str | Path,
    rows: Sequence[StudyRow],
    markdown: str | Path | None = None,
    policy: str = "wgd",
    scale: float = 1.0,
) -> Path:
    """Write `study.json` and one PNG per workload under `out_dir`, and the markdown report.

    With `markdown` naming an existing file that holds the study markers, only the text
    between them is replaced; otherwise the file is written with the markers. Returns the
    markdown path (default: `out_dir`/../`out_dir.name`.md).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(
        json.dumps([asdict(r) for r in rows], indent=1, allow_nan=True) + "\n"
    )
    for w in dict.fromkeys(r.workload for r in rows):
        _plot(out / f"{w}.png", rows, w, policy)
    md = Path(markdown) if markdown is not None else out.parent / f"{out.name}.md"
    body = report_markdown(rows, figures=out.name, policy=policy, scale=scale)
    block = f"{BEGIN}\n{body}\n{END}"
    if md.is_file() and BEGIN in (text := md.read_text()) and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = block + "\n"
    md.write_text(text)
    return md
