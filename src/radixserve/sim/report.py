"""Reports of policy-lab replays: a markdown table, CSV and JSON files, and a hit-rate plot."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

from radixserve.sim.replay import ReplayResult

COLUMNS = (
    ("eviction", lambda r: r.eviction_policy),
    ("schedule", lambda r: r.schedule_policy),
    ("cache {unit}", lambda r: f"{r.kv_tokens:,}"),
    ("cache %", lambda r: f"{100 * r.cache_fraction:.2f}"),
    ("hit rate %", lambda r: f"{100 * r.token_hit_rate:.2f}"),
    ("load (peak)", lambda r: f"{r.offered_load:.2f} ({r.peak_load:.2f})"),
    ("prefill computed %", lambda r: f"{100 * r.prefill_computed_fraction:.1f}"),
    ("tok/s", lambda r: f"{r.throughput_tokens_per_s:,.0f}"),
    ("TTFT p50 s", lambda r: f"{r.ttft_p50:.3f}"),
    ("TTFT p99 s", lambda r: f"{r.ttft_p99:.3f}"),
    ("e2e p99 s", lambda r: f"{r.e2e_p99:.3f}"),
    ("queue p99 s", lambda r: f"{r.queue_delay_p99:.3f}"),
    ("evicted", lambda r: f"{r.evicted_tokens:,}"),
    ("retractions", lambda r: str(r.retractions)),
    ("failed", lambda r: str(r.failed)),
    ("µs/req", lambda r: f"{r.sched_cache_us_per_request:.0f}"),
)


def markdown_table(
    results: Sequence[ReplayResult], infinite_bound: float | None = None, unit: str = "tokens"
) -> str:
    """One row per replay; the first percentage column is the hit rate over `unit` (tokens,
    or blocks with block keys)."""
    columns = COLUMNS
    tiers = []
    for tier in ("host", "storage"):
        if any(getattr(r, f"{tier}_cache_tokens", 0) for r in results):
            tiers += [
                (f"{tier} {{unit}}", lambda r, t=tier: f"{getattr(r, f'{t}_cache_tokens'):,}"),
                (f"{tier} hit %", lambda r, t=tier: f"{100 * getattr(r, f'{t}_hit_rate'):.2f}"),
            ]
    if tiers:
        columns = (*COLUMNS[:5], *tiers, *COLUMNS[5:])
    lines = [
        "| " + " | ".join(name.format(unit=unit) for name, _ in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in results]
    if infinite_bound is not None:
        lines.append(f"\nInfinite-cache bound: {100 * infinite_bound:.2f}% hit rate.")
    return "\n".join(lines)


def cache_only_table(results: Sequence, unit: str, infinite_bound: float | None = None) -> str:
    """One row per pure cache simulation (`CacheOnlyResult`); hit rates are over `unit`."""
    tiers = [t for t in ("host", "storage") if any(getattr(r, f"{t}_tokens", 0) for r in results)]
    head = f"| eviction | cache {unit} | cache % | hit rate % | evicted | µs/req |"
    rule = "|---|---|---|---|---|---|"
    if tiers:
        head += "".join(f" {t} {unit} |" for t in tiers) + " device hit % |"
        head += "".join(f" {t} hit % |" for t in tiers)
        rule += "---|" * (2 * len(tiers) + 1)
    lines = [head, rule]
    for r in results:
        line = (
            f"| {r.eviction_policy} | {r.kv_tokens:,} | {100 * r.cache_fraction:.2f} | "
            f"{100 * r.hit_rate:.2f} | {r.evicted_tokens:,} | {r.us_per_request:.1f} |"
        )
        if tiers:
            rates = [getattr(r, f"{t}_hit_rate") for t in tiers]
            line += "".join(f" {getattr(r, f'{t}_tokens'):,} |" for t in tiers)
            line += f" {100 * (r.hit_rate - sum(rates)):.2f} |"
            line += "".join(f" {100 * rate:.2f} |" for rate in rates)
        lines.append(line)
    if infinite_bound is not None:
        lines.append(f"\nInfinite-cache bound: {100 * infinite_bound:.2f}% hit rate.")
    return "\n".join(lines)


def policy_summary_lines(results: Sequence, unit: str) -> list[str]:
    """A line for each result whose eviction policy gave an account of itself
    (`policy_summary`): what it evicts by at the end, how often it switched, and its shadows'
    estimates of each policy's hit rate over its latest epochs."""
    lines = []
    for r in results:
        summary = getattr(r, "policy_summary", None)
        if not summary:
            continue
        where = f"{r.eviction_policy} at {100 * r.cache_fraction:.2f}% ({r.kv_tokens:,} {unit})"
        known = ("following", "switches", "epochs", "sampled_references", "sample_rate")
        if all(k in summary for k in known):
            text = (
                f"{where}: evicts as {summary['following']} at the end, after "
                f"{summary['switches']} switches in {summary['epochs']} epochs "
                f"({summary['sampled_references']:,} sampled references, rate "
                f"{summary['sample_rate']:.3g})"
            )
            estimates = summary.get("estimated_hit_rates") or {}
            if estimates:
                text += "; estimated hit rates over its latest epochs, %: " + ", ".join(
                    f"{name} {100 * rate:.1f}" for name, rate in estimates.items()
                )
        else:
            text = f"{where}: " + ", ".join(f"{k} {v}" for k, v in summary.items())
        lines.append(text + ".")
    return lines


def write_csv(path: str | Path, results: Sequence[ReplayResult]) -> None:
    rows = [r.as_dict() for r in results]
    for row in rows:  # a nested account goes in one cell, as JSON
        if isinstance(row.get("policy_summary"), dict):
            row["policy_summary"] = json.dumps(row["policy_summary"])
    with Path(path).open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: str | Path, results: Sequence[ReplayResult], **extra) -> None:
    payload = {**extra, "results": [r.as_dict() for r in results]}
    Path(path).write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n")


def plot_hit_rate_lines(
    path: str | Path,
    lines: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    infinite_bound: float,
    title: str,
    highlight: str | None = None,
) -> None:
    """Token hit rate (fractions) against cache size (% of unique tokens), one line per label.

    A label starting with `belady` is dashed, `highlight` is drawn heavier, and the
    infinite-cache bound is a dotted horizontal line. Writes a PNG to `path`.
    """
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, sizes, hit_rates in lines:
        ax.plot(
            list(sizes),
            [100 * h for h in hit_rates],
            "--" if label.startswith("belady") else "-",
            marker="o",
            linewidth=2.5 if label == highlight else 1.5,
            label=label,
        )
    ax.axhline(100 * infinite_bound, color="black", linestyle=":", label="infinite cache")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("KV cache size, % of unique tokens")
    ax.set_ylabel("token hit rate, %")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hit_rates(
    path: str | Path,
    results: Sequence[ReplayResult],
    infinite_bound: float,
    title: str = "token hit rate by cache size",
) -> None:
    """Hit rate against cache size (% of unique tokens), one line per policy pair.

    The offline Belady lines, when present, are dashed; the infinite-cache bound is a
    horizontal line.
    """
    series: dict[tuple[str, str], list[ReplayResult]] = {}
    for r in results:
        series.setdefault((r.eviction_policy, r.schedule_policy), []).append(r)
    lines = []
    for (eviction, schedule), rows in series.items():
        rows = sorted(rows, key=lambda r: r.cache_fraction)
        lines.append(
            (
                f"{eviction} / {schedule}",
                [100 * r.cache_fraction for r in rows],
                [r.token_hit_rate for r in rows],
            )
        )
    plot_hit_rate_lines(path, lines, infinite_bound, title)
