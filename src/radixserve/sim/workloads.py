"""Seeded synthetic workloads in the shape of the SGLang paper's benchmarks.

Every generator returns a list of `TraceRequest` in arrival order, and is a pure function of
its arguments and `seed`. Token ids are drawn from a 32,000-token vocabulary, so unrelated
content never shares a prefix by accident. Answers are part of the trace (`output_ids`):
where a later prompt quotes an earlier answer (chat history, agent trajectories, thoughts),
the replayed model emits exactly that answer, so the cache can reuse its KV as a server would.

`rate` gives Poisson arrivals at that many requests per second; None puts every arrival at 0.
A request that quotes an earlier answer names it in `after`, and the replay sends it only once
that answer is complete, as a client would.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

import numpy as np

from radixserve.cache.hashing import TOKEN_DTYPE
from radixserve.errors import InvalidArgumentError
from radixserve.sim.traces import TraceRequest

VOCAB = 32_000


class _Gen:
    def __init__(self, seed: int, rate: float | None) -> None:
        if rate is not None and not rate > 0:
            raise InvalidArgumentError(f"rate must be > 0 requests/s or None, got {rate!r}")
        self.rng = _rng(seed)
        self.rate = rate

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, n, dtype=TOKEN_DTYPE)

    def finish(self, items: list[tuple]) -> list[TraceRequest]:
        """Items are (prompt, answer) or (prompt, answer, index of the item it follows)."""
        times = (
            np.cumsum(self.rng.exponential(1.0 / self.rate, len(items)))
            if self.rate
            else np.zeros(len(items))
        )
        out = []
        for i, (item, t) in enumerate(zip(items, times, strict=True)):
            prompt, answer = item[0], item[1]
            after = f"req-{item[2]}" if len(item) > 2 and item[2] is not None else None
            out.append(TraceRequest(f"req-{i}", float(t), prompt, len(answer), answer, 0, after))
        return out


def _rng(seed: int) -> np.random.Generator:
    """numpy's generator for `seed`, an integer >= 0 (numpy's own refusal is a bare traceback)."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise InvalidArgumentError(f"seed must be an integer >= 0, got {seed!r}")
    return np.random.default_rng(seed)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"{name} must be an integer >= 1, got {value!r}")


def _ranges(least: int, **ranges: tuple[int, int]) -> None:
    for name, (lo, hi) in ranges.items():
        if not least <= lo <= hi:
            raise InvalidArgumentError(f"{name} must be (lo, hi) with {least} <= lo <= hi")


def shared_prefix(
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 1024,
    question_len: int = 128,
    output_len: int = 64,
    zipf: float | None = None,
    seed: int = 0,
    rate: float | None = None,
) -> list[TraceRequest]:
    """Prompt groups sharing a system prompt, in random order (SGLang's generated-shared-prefix).

    With `zipf`, each of the num_groups * prompts_per_group requests picks its group with
    probability proportional to 1 / rank**zipf instead of every group getting the same count.
    """
    _positive(num_groups=num_groups, prompts_per_group=prompts_per_group, system_len=system_len)
    _positive(question_len=question_len, output_len=output_len)
    gen = _Gen(seed, rate)
    systems = [gen.tokens(system_len) for _ in range(num_groups)]
    total = num_groups * prompts_per_group
    if zipf is None:
        groups = np.repeat(np.arange(num_groups), prompts_per_group)
        gen.rng.shuffle(groups)
    else:
        if not zipf > 0:
            raise InvalidArgumentError(f"zipf must be > 0, got {zipf!r}")
        weights = 1.0 / np.arange(1, num_groups + 1) ** zipf
        groups = gen.rng.choice(num_groups, size=total, p=weights / weights.sum())
    items = [
        (np.concatenate([systems[g], gen.tokens(question_len)]), gen.tokens(output_len))
        for g in groups
    ]
    return gen.finish(items)


def multi_turn(
    num_sessions: int = 32,
    turns: int = 8,
    system_len: int = 256,
    user_len: int = 64,
    output_len: int = 64,
    order: str = "round-robin",
    seed: int = 0,
    rate: float | None = None,
) -> list[TraceRequest]:
    """Chat sessions; each turn's prompt is the whole history (answers included) plus a new message.

    `order` is `round-robin` (turn 1 of every session, then turn 2, ...) or `random` (sessions
    interleaved at random, turns in order within each).
    """
    _positive(num_sessions=num_sessions, turns=turns, user_len=user_len, output_len=output_len)
    if order not in ("round-robin", "random"):
        raise InvalidArgumentError(f"order must be round-robin or random, got {order!r}")
    gen = _Gen(seed, rate)
    histories = [gen.tokens(system_len) for _ in range(num_sessions)]
    last: list[int | None] = [None] * num_sessions
    if order == "round-robin":
        schedule = [s for _ in range(turns) for s in range(num_sessions)]
    else:
        schedule = list(np.repeat(np.arange(num_sessions), turns))
        gen.rng.shuffle(schedule)
    items = []
    for s in schedule:
        prompt = np.concatenate([histories[s], gen.tokens(user_len)])
        answer = gen.tokens(output_len)
        histories[s] = np.concatenate([prompt, answer])
        items.append((prompt, answer, last[s]))
        last[s] = len(items) - 1
    return gen.finish(items)


def few_shot(
    num_subjects: int = 16,
    shots: int = 5,
    example_len: int = 256,
    questions_per_subject: int = 32,
    instruction_len: int = 64,
    question_len: int = 64,
    output_len: int = 8,
    seed: int = 0,
    rate: float | None = None,
) -> list[TraceRequest]:
    """k-shot prompts: a shared instruction, each subject's fixed examples, then a question."""
    _positive(num_subjects=num_subjects, shots=shots, example_len=example_len)
    _positive(questions_per_subject=questions_per_subject, question_len=question_len)
    gen = _Gen(seed, rate)
    instruction = gen.tokens(instruction_len)
    examples = [
        np.concatenate([gen.tokens(example_len) for _ in range(shots)]) for _ in range(num_subjects)
    ]
    subjects = np.repeat(np.arange(num_subjects), questions_per_subject)
    gen.rng.shuffle(subjects)
    items = [
        (
            np.concatenate([instruction, examples[s], gen.tokens(question_len)]),
            gen.tokens(output_len),
        )
        for s in subjects
    ]
    return gen.finish(items)


def tree_of_thought(
    num_trees: int = 16,
    depth: int = 3,
    branching: int = 3,
    problem_len: int = 256,
    step_len: int = 32,
    output_len: int = 64,
    order: str = "in-order",
    seed: int = 0,
    rate: float | None = None,
) -> list[TraceRequest]:
    """Thought trees: each node's prompt is its parent's prompt, the parent's thought and a cue.

    `order` is `in-order` (each tree depth-first, one tree after another) or `shuffled`.
    """
    _positive(num_trees=num_trees, depth=depth, branching=branching, problem_len=problem_len)
    _positive(step_len=step_len, output_len=output_len)
    if order not in ("in-order", "shuffled"):
        raise InvalidArgumentError(f"order must be in-order or shuffled, got {order!r}")
    gen = _Gen(seed, rate)
    items: list[tuple] = []
    for _ in range(num_trees):
        stack = [(np.concatenate([gen.tokens(problem_len), gen.tokens(step_len)]), 0, None)]
        while stack:
            prompt, level, parent = stack.pop()
            thought = gen.tokens(output_len)
            items.append((prompt, thought, parent))
            if level + 1 < depth:
                for _ in range(branching):
                    child = np.concatenate([prompt, thought, gen.tokens(step_len)])
                    stack.append((child, level + 1, len(items) - 1))
    if order == "shuffled":
        perm = gen.rng.permutation(len(items))
        position = {int(old): new for new, old in enumerate(perm)}
        items = [
            (items[i][0], items[i][1], None if items[i][2] is None else position[items[i][2]])
            for i in perm
        ]
    return gen.finish(items)


def agent_sessions(
    num_agents: int = 16,
    steps: int = 16,
    system_len: int = 512,
    observation_len: int = 128,
    output_len: int = 32,
    seed: int = 0,
    rate: float | None = None,
) -> list[TraceRequest]:
    """Append-only agents: each step's prompt is the last prompt, its answer and a new observation.

    Agents take steps in turn (round-robin).
    """
    _positive(num_agents=num_agents, steps=steps, system_len=system_len)
    _positive(observation_len=observation_len, output_len=output_len)
    gen = _Gen(seed, rate)
    contexts = [gen.tokens(system_len) for _ in range(num_agents)]
    last: list[int | None] = [None] * num_agents
    items = []
    for _ in range(steps):
        for a in range(num_agents):
            prompt = np.concatenate([contexts[a], gen.tokens(observation_len)])
            action = gen.tokens(output_len)
            contexts[a] = np.concatenate([prompt, action])
            items.append((prompt, action, last[a]))
            last[a] = len(items) - 1
    return gen.finish(items)


def mooncake_conversation(
    num_sessions: int = 1500,
    num_apps: int = 40,
    app_zipf: float = 1.0,
    app_blocks: tuple[int, int] = (4, 32),
    mean_turns: float = 3.0,
    max_turns: int = 12,
    turn_blocks: tuple[int, int] = (1, 6),
    output_tokens: tuple[int, int] = (16, 48),
    block_size: int = 16,
    duration_s: float = 3600.0,
    mean_think_s: float = 120.0,
    seed: int = 0,
) -> list[dict]:
    """Mooncake JSONL records of chat traffic, in the shape the Mooncake paper describes.

    Built from public descriptions of the FAST'25 conversation trace (block hashes instead of
    text, sessions whose turns extend their own history, system prompts shared by the sessions
    of one application), not from the trace itself. Sessions start uniformly over
    `duration_s`; each picks an application by Zipf(`app_zipf`) popularity, whose system prompt
    is its first blocks; it runs a geometric number of turns (mean `mean_turns`), each adding
    `turn_blocks` new blocks (the previous answer and the new message) after an exponential
    think time. Blocks hold `block_size` tokens; the published traces use 512, scaled down here
    so a replay stays quick. Records are in timestamp order; read them with `read_mooncake`.
    """
    _positive(num_sessions=num_sessions, num_apps=num_apps, max_turns=max_turns)
    _positive(block_size=block_size)
    _ranges(1, app_blocks=app_blocks, turn_blocks=turn_blocks, output_tokens=output_tokens)
    if not mean_turns >= 1:
        raise InvalidArgumentError(f"mean_turns must be >= 1, got {mean_turns!r}")
    rng = _rng(seed)
    next_block = itertools.count()
    apps = [
        [next(next_block) for _ in range(rng.integers(app_blocks[0], app_blocks[1] + 1))]
        for _ in range(num_apps)
    ]
    weights = 1.0 / np.arange(1, num_apps + 1) ** app_zipf
    records = []
    for start in rng.uniform(0.0, duration_s, num_sessions):
        history = list(apps[rng.choice(num_apps, p=weights / weights.sum())])
        turns = min(max_turns, int(rng.geometric(1.0 / mean_turns)))
        t = float(start)
        for _ in range(turns):
            history += [next(next_block) for _ in range(rng.integers(*turn_blocks, endpoint=True))]
            records.append(
                {
                    "timestamp": round(t * 1000),
                    "input_length": len(history) * block_size - int(rng.integers(block_size)),
                    "output_length": int(rng.integers(*output_tokens, endpoint=True)),
                    "hash_ids": list(history),
                }
            )
            t += float(rng.exponential(mean_think_s))
    records.sort(key=lambda r: r["timestamp"])
    return records


def chat_traffic(
    num_sessions: int = 4000,
    duration_s: float = 4 * 3600.0,
    num_apps: int = 200,
    app_zipf: float = 1.0,
    system_blocks: tuple[int, int] = (1, 8),
    mean_turns: float = 2.5,
    message_blocks: tuple[int, int] = (1, 3),
    answer_blocks: tuple[int, int] = (0, 2),
    think_median_s: float = 60.0,
    think_sigma: float = 1.5,
    doc_share: float = 0.2,
    doc_blocks: tuple[int, int] = (8, 64),
    drift_every_s: float | None = None,
    block_size: int = 512,
    seed: int = 0,
) -> list[dict]:
    """Mooncake JSONL records of production-style chat traffic, one record per turn.

    Sessions start uniformly over `duration_s`. Each belongs to an application picked by
    Zipf(`app_zipf`) popularity and opens with that application's system prompt
    (`system_blocks` blocks, shared by all its sessions). A session runs a geometric number of
    turns (mean `mean_turns`): each turn's prompt is the whole history, the previous answer
    (`answer_blocks`) and a new message (`message_blocks`). With probability `doc_share` a
    message carries a long document (`doc_blocks` more blocks), which later turns quote, and
    which is never seen again if the session ends there. Think times between turns are
    lognormal with median `think_median_s` and shape `think_sigma`: at 1.5 one gap in ten is
    over 6.8 x the median, so sessions come back after long and varied absences.
    With `drift_every_s` the applications' popularity ranks are reshuffled at that interval,
    as traffic moves over a day. Block ids are unique per content; a record's
    `input_length` ends inside its last block.
    """
    _positive(num_sessions=num_sessions, num_apps=num_apps, block_size=block_size)
    _ranges(1, system_blocks=system_blocks, message_blocks=message_blocks, doc_blocks=doc_blocks)
    _ranges(0, answer_blocks=answer_blocks)
    if not mean_turns >= 1 or not 0 <= doc_share <= 1 or not duration_s > 0:
        raise InvalidArgumentError("need mean_turns >= 1, 0 <= doc_share <= 1, duration_s > 0")
    if not think_median_s > 0 or not think_sigma >= 0:
        raise InvalidArgumentError("need think_median_s > 0 and think_sigma >= 0")
    if drift_every_s is not None and not drift_every_s > 0:
        raise InvalidArgumentError(f"drift_every_s must be > 0 or None, got {drift_every_s!r}")
    rng = _rng(seed)
    next_block = itertools.count()

    def blocks(bounds: tuple[int, int]) -> list[int]:
        return [next(next_block) for _ in range(int(rng.integers(bounds[0], bounds[1] + 1)))]

    systems = [blocks(system_blocks) for _ in range(num_apps)]
    weights = 1.0 / np.arange(1, num_apps + 1) ** app_zipf
    weights /= weights.sum()
    phases = 1 if drift_every_s is None else int(duration_s // drift_every_s) + 1
    ranks = [rng.permutation(num_apps) for _ in range(phases)]
    records = []
    for start in np.sort(rng.uniform(0.0, duration_s, num_sessions)):
        phase = 0 if drift_every_s is None else int(start // drift_every_s)
        app = int(ranks[phase][rng.choice(num_apps, p=weights)])
        history = list(systems[app])
        t = float(start)
        for turn in range(int(rng.geometric(1.0 / mean_turns))):
            if turn:
                history += blocks(answer_blocks) if answer_blocks[1] else []
                t += float(think_median_s * np.exp(think_sigma * rng.standard_normal()))
            history += blocks(message_blocks)
            if rng.random() < doc_share:
                history += blocks(doc_blocks)
            records.append(
                {
                    "timestamp": round(t * 1000),
                    "input_length": len(history) * block_size - int(rng.integers(block_size)),
                    "output_length": int(rng.integers(16, 512)),
                    "hash_ids": list(history),
                }
            )
    records.sort(key=lambda r: r["timestamp"])
    return records


WORKLOADS: dict[str, Callable[..., list[TraceRequest]]] = {
    "shared-prefix": shared_prefix,
    "shared-prefix-zipf": lambda **kw: shared_prefix(zipf=kw.pop("zipf", 1.1), **kw),
    "multi-turn": multi_turn,
    "multi-turn-random": lambda **kw: multi_turn(order="random", **kw),
    "few-shot": few_shot,
    "tree-of-thought": tree_of_thought,
    "tree-of-thought-shuffled": lambda **kw: tree_of_thought(order="shuffled", **kw),
    "agent": agent_sessions,
}


# Workloads generated as Mooncake JSONL records: name -> (generator, block size in tokens).
MOONCAKE_WORKLOADS: dict[str, tuple[Callable[..., list[dict]], int]] = {
    "mooncake-conversation": (mooncake_conversation, 16),
    "chat": (chat_traffic, 512),
    "chat-long-gaps": (partial(chat_traffic, think_median_s=900.0, think_sigma=2.0), 512),
    "chat-documents": (partial(chat_traffic, doc_share=0.5, mean_turns=1.5), 512),
    "system-prompts": (
        partial(chat_traffic, num_apps=2000, mean_turns=1.0, doc_share=0.0, system_blocks=(2, 16)),
        512,
    ),
    "popularity-drift": (
        partial(
            chat_traffic,
            num_apps=1000,
            mean_turns=1.2,
            doc_share=0.05,
            system_blocks=(2, 16),
            drift_every_s=1800.0,
        ),
        512,
    ),
}


def make_workload(name: str, **kwargs) -> list[TraceRequest]:
    """The named synthetic workload; keyword arguments go to its generator."""
    if name not in WORKLOADS:
        raise InvalidArgumentError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    return WORKLOADS[name](**kwargs)
