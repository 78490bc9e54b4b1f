"""The eviction study: every lab workload, a range of cache sizes, several policies.

Each cell is a pure cache simulation (`radixserve.sim.cacheonly`): the server's radix cache
alone serves the workload in arrival order, so policies are compared without scheduling
effects, as the literature compares them. A cell can be rerun alone with
`radixserve replay workload:NAME --cache-only` (`replay_command` prints the line).

The workloads span the regimes a deployment can be in, and the sizes span working sets from
well under to far over the cache:

- the SGLang-paper shapes at token level: shared prefixes (equal or Zipf popularity),
  multi-turn chat in round-robin or random order, few-shot, tree-of-thought, agents;
- production-style chat in the Mooncake trace format, one key per 512-token block
  (`chat_traffic`): system prompts shared by an application's sessions, multi-turn sessions
  whose returns are lognormal with a heavy tail, one-off long documents, popularity that
  drifts over the day; plus `mooncake-conversation`.

`scale` multiplies the number of sessions, groups, subjects, trees or agents (a test runs the
study at a small scale). `summarize` compares a policy with LRU, LFU and Belady.
`write_report` writes the markdown tables, one PNG per workload and the raw rows as JSON.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from radixserve.errors import InvalidArgumentError
from radixserve.sim.cacheonly import simulate_cache
from radixserve.sim.oracle import infinite_cache
from radixserve.sim.report import plot_hit_rate_lines
from radixserve.sim.sweep import run_grid
from radixserve.sim.traces import TraceRequest, read_mooncake, write_mooncake
from radixserve.sim.workloads import MOONCAKE_WORKLOADS, make_workload

SIZES = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0)
POLICIES = ("lru", "lfu", "slru", "wgd", "learned-lru", "adaptive", "belady")
JUDGED = "adaptive"
CLASSICAL = ("lru", "lfu")
GAP_SIZES = (1.0, 5.0)

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
    "mooncake-conversation": dict(num_sessions=3000),
    "chat": dict(num_sessions=4000),
    "chat-long-gaps": dict(num_sessions=4000),
    "chat-documents": dict(num_sessions=4000),
    "system-prompts": dict(num_sessions=4000),
    "popularity-drift": dict(num_sessions=4000),
}


@dataclass(frozen=True)
class StudyRow:
    """One cell of the study: a pure cache simulation. Sizes and hit rates are in `unit`."""

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
    unit: str = "tokens"


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


def workload_trace(name: str, seed: int = 0, block_keys: bool = True, **kwargs):
    """A synthetic workload by name, as a list of `TraceRequest`.

    Workloads in `MOONCAKE_WORKLOADS` are generated as Mooncake JSONL, written to a file and
    read back with `read_mooncake` (one key per block with `block_keys`), so they take the same
    path as a published trace; the others come from `make_workload`.
    """
    if name not in MOONCAKE_WORKLOADS:
        return make_workload(name, seed=seed, **kwargs)
    import tempfile

    generate, block_size = MOONCAKE_WORKLOADS[name]
    try:
        records = generate(block_size=block_size, seed=seed, **kwargs)
    except TypeError as exc:
        raise InvalidArgumentError(f"workload {name}: {exc}") from None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.jsonl"
        write_mooncake(path, records)
        return read_mooncake(path, block_size, block_keys=block_keys)


def unit_of(name: str) -> str:
    """What one key of a study workload is: a block of a Mooncake-format trace, or a token."""
    return "blocks" if name in MOONCAKE_WORKLOADS else "tokens"


@lru_cache(maxsize=4)
def study_trace(name: str, scale: float = 1.0, seed: int = 0) -> tuple[TraceRequest, ...]:
    """The study's trace for workload `name` at `scale`."""
    return tuple(workload_trace(name, seed=seed, **_scaled(name, scale)))


def replay_command(workload: str, policy: str, size: float, scale: float = 1.0) -> str:
    """The `radixserve replay` command line that reproduces one cell of the study."""
    args = ",".join(f"{k}={v}" for k, v in _scaled(workload, scale).items())
    return (
        f"radixserve replay workload:{workload} --workload-args {args} --cache-only "
        f"--eviction {policy} --cache {size:g}%"
    )


@lru_cache(maxsize=4)
def _bound(name: str, scale: float, seed: int) -> tuple[float, int]:
    return infinite_cache(study_trace(name, scale, seed))


def run_cell(
    workload: str, policy: str, size: float, scale: float = 1.0, seed: int = 0
) -> StudyRow:
    """Simulate one cell of the study and return its `StudyRow`."""
    trace = study_trace(workload, scale, seed)
    bound, unique = _bound(workload, scale, seed)
    result = simulate_cache(trace, policy, cache_fraction=size, unique=unique)
    return StudyRow(
        workload=workload,
        policy=policy,
        size_percent=size,
        kv_tokens=result.kv_tokens,
        hit_rate=result.hit_rate,
        infinite_bound=bound,
        unique_tokens=unique,
        requests=result.requests,
        evicted_tokens=result.evicted_tokens,
        wall_seconds=result.wall_seconds,
        unit=unit_of(workload),
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
    journal: str | Path | None = None,
) -> list[StudyRow]:
    """Simulate every (workload, policy, size); rows come back in that order.

    With `journal` (a JSONL file) each finished cell is appended as it ends, and a study run
    again with the same journal reads finished cells back instead of simulating them.
    `progress` is called for each cell simulated now.
    """
    for name in workloads:
        _scaled(name, scale)
    cells = [
        {"workload": w, "policy": p, "size": float(s), "scale": scale, "seed": seed}
        for w in workloads
        for p in policies
        for s in sizes
    ]
    on_result = None
    if progress is not None:
        on_result = lambda cell, result: progress(StudyRow(**result))  # noqa: E731
    results = run_grid(cells, _study_cell, jobs=jobs, journal=journal, on_result=on_result)
    return [StudyRow(**r) for r in results]


def _study_cell(cell: dict) -> dict:
    row = run_cell(cell["workload"], cell["policy"], cell["size"], cell["scale"], cell["seed"])
    return asdict(row)


@dataclass(frozen=True)
class PolicySummary:
    """How `policy` does against LRU, LFU and Belady on one workload.

    `gap_closed` is (policy - LRU) / (Belady - LRU), summed over `GAP_SIZES`; None where
    Belady is not ahead of LRU there by at least `min_gap` points in all, since the ratio
    then measures noise. `worst_vs_lru` is the lowest policy - LRU over every size, and
    `worst_vs_classical` the lowest policy - max(LRU, LFU), in points, each with its size.
    `lru_knee` is the smallest size at which LRU gets 95% of the infinite-cache hit rate (None
    if no size does): the working set, so at size s the working set is lru_knee / s caches.
    """

    workload: str
    policy: str
    gap_closed: float | None
    gap_points: float
    worst_vs_lru: float
    worst_size: float
    worst_vs_classical: float
    worst_classical_size: float
    lru_knee: float | None


def summarize(
    rows: Iterable[StudyRow],
    policy: str = JUDGED,
    baseline: str = "lru",
    oracle: str = "belady",
    gap_sizes: Sequence[float] = GAP_SIZES,
    min_gap: float = 0.5,
    classical: Sequence[str] = CLASSICAL,
) -> list[PolicySummary]:
    """One `PolicySummary` per workload that has `policy` and `baseline` rows."""
    table: dict[tuple[str, str, float], float] = {}
    bounds: dict[str, float] = {}
    order: list[str] = []
    for r in rows:
        table[(r.workload, r.policy, r.size_percent)] = 100 * r.hit_rate
        bounds[r.workload] = 100 * r.infinite_bound
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
        best_classical = [
            (
                table[(w, policy, s)]
                - max(table[(w, c, s)] for c in classical if (w, c, s) in table),
                s,
            )
            for s in sizes
        ]
        worst_classical, worst_classical_size = min(best_classical)
        gained = gap = 0.0
        for s in gap_sizes:
            if (w, oracle, s) in table and (w, policy, s) in table and (w, baseline, s) in table:
                gained += table[(w, policy, s)] - table[(w, baseline, s)]
                gap += table[(w, oracle, s)] - table[(w, baseline, s)]
        closed = gained / gap if gap >= min_gap else None
        knee = next((s for s in sizes if table[(w, baseline, s)] >= 0.95 * bounds[w]), None)
        out.append(
            PolicySummary(
                w,
                policy,
                closed,
                gap,
                worst,
                worst_size,
                worst_classical,
                worst_classical_size,
                knee,
            )
        )
    return out


def mean_gap_closed(summaries: Sequence[PolicySummary]) -> float:
    """The mean of `gap_closed` over the workloads where it is defined (nan if none)."""
    values = [s.gap_closed for s in summaries if s.gap_closed is not None]
    return sum(values) / len(values) if values else math.nan


def _percent(fraction: float) -> str:
    text = f"{fraction:.0%}"
    return "0%" if text == "-0%" else text


def _hit_table(rows: Sequence[StudyRow], workload: str, policy: str = JUDGED) -> list[str]:
    mine = [r for r in rows if r.workload == workload]
    policies = list(dict.fromkeys(r.policy for r in mine))
    sizes = sorted({r.size_percent for r in mine})
    cell = {(r.policy, r.size_percent): r for r in mine}
    judged = all(p in policies for p in (policy, "lru", "belady"))
    versus = policy in policies and all(c in policies for c in CLASSICAL)
    extra = f" {policy}: gap closed |" if judged else ""
    extra += f" {policy} - best of {', '.join(CLASSICAL)} |" if versus else ""
    lines = [
        f"| cache % | cache {mine[0].unit} | " + " | ".join(policies) + " | infinite |" + extra,
        "|---|---|" + "---|" * (len(policies) + 1 + judged + versus),
    ]
    for s in sizes:
        any_row = next(cell[(p, s)] for p in policies if (p, s) in cell)
        values = [f"{100 * cell[(p, s)].hit_rate:.1f}" if (p, s) in cell else "" for p in policies]
        line = (
            f"| {s:g} | {any_row.kv_tokens:,} | "
            + " | ".join(values)
            + f" | {100 * any_row.infinite_bound:.1f} |"
        )
        hit = {p: 100 * cell[(p, s)].hit_rate for p in policies if (p, s) in cell}
        if judged:
            gap = hit["belady"] - hit["lru"]
            closed = (hit[policy] - hit["lru"]) / gap if gap >= 0.5 else None
            line += f" {_percent(closed)} |" if closed is not None else " |"
        if versus:
            line += f" {hit[policy] - max(hit[c] for c in CLASSICAL):+.1f} |"
        lines.append(line)
    return lines


def _plot(path: Path, rows: Sequence[StudyRow], workload: str, policy: str) -> None:
    mine = [r for r in rows if r.workload == workload]
    lines = []
    for name in dict.fromkeys(r.policy for r in mine):
        line = sorted((r for r in mine if r.policy == name), key=lambda r: r.size_percent)
        lines.append((name, [r.size_percent for r in line], [r.hit_rate for r in line]))
    title = f"{workload}: {mine[0].unit[:-1]} hit rate by cache size"
    plot_hit_rate_lines(path, lines, mine[0].infinite_bound, title, highlight=policy)


BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"


def report_markdown(
    rows: Sequence[StudyRow], figures: str = "eviction", policy: str = JUDGED, scale: float = 1.0
) -> str:
    """The generated part of docs/eviction.md: the summary, then one table per workload."""
    summaries = summarize(rows, policy)
    workloads = list(dict.fromkeys(r.workload for r in rows))
    gap_sizes = " and ".join(f"{s:g}" for s in GAP_SIZES)
    lines = [
        f"Generated by `radixserve study --scale {scale:g}`; {len(rows)} pure cache "
        f"simulations, {sum(r.wall_seconds for r in rows):.0f} s of simulation time.",
        "",
        f"### Summary: `{policy}` against LRU, LFU and Belady",
        "",
        f"- **Gap closed:** ({policy} - LRU) / (Belady - LRU) in hit-rate points, summed over "
        f"{gap_sizes}% cache; blank where Belady leads LRU there by under 0.5 points.",
        f"- **Worst vs LRU** and **worst vs best classical:** the lowest {policy} - LRU and "
        f"{policy} - max(LRU, LFU) over every size, in points (at that size, %).",
        "- **LRU knee:** the smallest size at which LRU gets 95% of the infinite-cache hit "
        "rate, a measure of the working set: at size s the working set is knee / s caches.",
        "",
        "| workload | unit | LRU knee, % | LRU→Belady gap, points | gap closed | "
        "worst vs LRU | worst vs best classical |",
        "|---|---|---|---|---|---|---|",
    ]
    units = {r.workload: r.unit for r in rows}
    for s in summaries:
        closed = "" if s.gap_closed is None else _percent(s.gap_closed)
        knee = f"{s.lru_knee:g}" if s.lru_knee is not None else f"> {max(SIZES):g}"
        lines.append(
            f"| {s.workload} | {units[s.workload]} | {knee} | {s.gap_points:.1f} | {closed} | "
            f"{s.worst_vs_lru:+.1f} ({s.worst_size:g}) | "
            f"{s.worst_vs_classical:+.1f} ({s.worst_classical_size:g}) |"
        )
    mean = mean_gap_closed(summaries)
    if summaries:
        worst = min(summaries, key=lambda s: s.worst_vs_lru)
        worst_c = min(summaries, key=lambda s: s.worst_vs_classical)
        lines += [
            "",
            f"Mean gap closed over the workloads with a gap: **{100 * mean:.0f}%**. "
            f"Worst case against LRU: **{worst.worst_vs_lru:+.1f} points** "
            f"({worst.workload}, {worst.worst_size:g}% cache). Worst case against the better "
            f"of LRU and LFU: **{worst_c.worst_vs_classical:+.1f} points** "
            f"({worst_c.workload}, {worst_c.worst_classical_size:g}% cache).",
        ]
    lines.append("")
    for w in workloads:
        first = next(r for r in rows if r.workload == w)
        unit = first.unit
        lines += [
            f"### {w}",
            "",
            f"{first.requests:,} requests, {first.unique_tokens:,} unique {unit}. "
            f"{unit[:-1].capitalize()} hit rate, %:",
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
    policy: str = JUDGED,
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
