"""Trace formats for the policy lab: Mooncake JSONL and radixserve's own token JSONL.

Mooncake JSONL (the FAST'25 traces): one request per line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids`. Each hash id names a block of `block_size`
tokens (512 in the published traces): equal ids mean equal content, and a request's prompt is
its blocks in order, cut to `input_length`. Block `h` becomes the token ids
`h * block_size + [0, block_size)`, so distinct ids give distinct blocks. With `block_keys`
each block is instead one key, the token id `h`: a 512-token block is one unit of cache, the
prompt is its `ceil(input_length / block_size)` blocks (a partial last block counts whole), and
hit rates are block hit rates, as cache studies of these traces report them. An answer of L
tokens is then 1 + ceil((L - 1) / block_size) keys (`answer_keys`): the prefill's first token,
then one key per block of decode; the replay's cost model charges each key its real tokens.

radixserve JSONL: one request per line with `input_ids` (a list of token ids) and optionally
`rid`, `arrival` (seconds), `output_len` (default 128), `output_ids` (what the model will
answer, so that later prompts can reuse it), `priority`, and `after` (the rid of a request that
must finish before this one is sent, as a chat client waits for the previous answer).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from radixserve.cache.hashing import TOKEN_DTYPE
from radixserve.errors import InvalidArgumentError

_TOKEN_LIMIT = 2**31 - 1


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives, its prompt, and how long its answer is."""

    rid: str
    arrival: float
    input_ids: np.ndarray
    output_len: int
    output_ids: np.ndarray | None = None
    priority: int = 0
    after: str | None = None
    """The rid of a request whose answer this prompt quotes: it is sent once that one ends."""
    key_tokens: int = 1
    """How many tokens one key of `input_ids` stands for: 1, or the block size of block keys."""
    answer_tokens: int | None = None
    """The answer's length in tokens, where `output_len` counts keys that stand for several."""


def _fail(path: Path, line_no: int, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{path}:{line_no}: {message}")


def _records(path: Path) -> Iterable[tuple[int, dict]]:
    with path.open() as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as exc:
                message = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
                yield line_no, _fail(path, line_no, f"not JSON: {message}")
                continue
            if not isinstance(record, dict):
                yield line_no, _fail(path, line_no, "each line must be a JSON object")
                continue
            yield line_no, record


def _parse_lines(
    path: Path,
    parse: Callable[[int, dict, int], TraceRequest],
    skipped: list[str] | None,
    ordered: bool,
) -> list[TraceRequest]:
    """`parse(line_no, record, index)` for every line. A bad line raises, or with `skipped`
    is recorded there and left out. With `ordered`, arrivals must not decrease."""
    out: list[TraceRequest] = []
    last_line = 0
    for line_no, record in _records(path):
        try:
            if isinstance(record, InvalidArgumentError):
                raise record
            request = parse(line_no, record, len(out))
            if ordered and out and request.arrival < out[-1].arrival:
                raise _fail(
                    path,
                    line_no,
                    f"timestamp {1000 * request.arrival:g} ms is before line {last_line}'s "
                    f"{1000 * out[-1].arrival:g} ms: a trace must be in timestamp order",
                )
        except InvalidArgumentError as exc:
            if skipped is None:
                raise
            skipped.append(str(exc))
            continue
        out.append(request)
        last_line = line_no
    if not out:
        extra = f" ({len(skipped)} bad lines skipped)" if skipped else ""
        raise InvalidArgumentError(f"{path}: the trace holds no requests{extra}")
    return out


def _int_field(path: Path, line_no: int, record: dict, name: str, lo: int = 0) -> int:
    value = record.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise _fail(path, line_no, f"{name} must be an integer >= {lo}, got {value!r}")
    return value


def answer_keys(answer_tokens: int, block_size: int) -> int:
    """The keys an answer of `answer_tokens` takes with block keys: the first token, which the
    prefill emits alone, then one key per `block_size` tokens after it."""
    return 0 if answer_tokens == 0 else 1 + -(-(answer_tokens - 1) // block_size)


def read_mooncake(
    path: str | Path,
    block_size: int = 512,
    *,
    block_keys: bool = False,
    skipped: list[str] | None = None,
) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace; prompts are built from `hash_ids` blocks (one key per block
    with `block_keys`, else `block_size` token ids per block).

    Raises `InvalidArgumentError` naming the line and field of the first bad line: not JSON, a
    missing or mistyped field, `hash_ids` whose length is not ceil(input_length / block_size),
    or a timestamp before the previous line's. Given a list as `skipped`, bad lines are left
    out and their messages appended there instead. An empty trace is an error.
    """
    path = Path(path)
    if not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an integer >= 1, got {block_size!r}")
    offsets = np.arange(block_size, dtype=np.int64)

    def parse(line_no: int, record: dict, index: int) -> TraceRequest:
        timestamp = record.get("timestamp")
        if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool):
            raise _fail(path, line_no, f"timestamp must be a number (ms), got {timestamp!r}")
        input_len = _int_field(path, line_no, record, "input_length", lo=1)
        output_len = _int_field(path, line_no, record, "output_length")
        hash_ids = record.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
        ):
            raise _fail(path, line_no, "hash_ids must be a list of non-negative integers")
        needed = -(-input_len // block_size)
        if len(hash_ids) != needed:
            raise _fail(
                path,
                line_no,
                f"hash_ids has {len(hash_ids)} blocks but input_length {input_len} needs "
                f"{needed} blocks of {block_size}",
            )
        blocks = np.asarray(hash_ids, dtype=np.int64)
        scale = 1 if block_keys else block_size
        if blocks.size and (blocks.max() + 1) * scale > _TOKEN_LIMIT:
            raise _fail(path, line_no, "a hash id is too large for int32 token ids")
        answer_tokens = output_len
        if block_keys:
            tokens = blocks
            output_len = answer_keys(output_len, block_size)
        else:
            tokens = (blocks[:, None] * block_size + offsets).ravel()[:input_len]
        return TraceRequest(
            rid=str(record.get("rid", f"req-{index}")),
            arrival=float(timestamp) / 1000.0,
            input_ids=tokens.astype(TOKEN_DTYPE),
            output_len=output_len,
            key_tokens=block_size if block_keys else 1,
            answer_tokens=answer_tokens if block_keys else None,
        )

    return _parse_lines(path, parse, skipped, ordered=True)


def read_token_jsonl(path: str | Path, *, skipped: list[str] | None = None) -> list[TraceRequest]:
    """Read radixserve's own JSONL trace (explicit token ids), sorted by arrival.

    Bad lines raise `InvalidArgumentError` naming the line and field, or with a `skipped` list
    are left out and recorded there (see `read_mooncake`). An empty trace is an error.
    """
    path = Path(path)

    def parse(line_no: int, record: dict, index: int) -> TraceRequest:
        ids = record.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise _fail(path, line_no, "input_ids must be a non-empty list of token ids")
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > _TOKEN_LIMIT:
            raise _fail(path, line_no, "input_ids must be integers in [0, 2**31)")
        output_ids = record.get("output_ids")
        out_arr = None
        if output_ids is not None:
            out_arr = np.asarray(output_ids)
            if out_arr.ndim != 1 or (out_arr.size and out_arr.dtype.kind not in "iu"):
                raise _fail(path, line_no, "output_ids must be a list of token ids")
            out_arr = out_arr.astype(TOKEN_DTYPE)
        output_len = record.get("output_len", len(out_arr) if out_arr is not None else 128)
        if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 0:
            raise _fail(path, line_no, f"output_len must be an integer >= 0, got {output_len!r}")
        arrival = record.get("arrival", 0.0)
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or arrival < 0:
            raise _fail(path, line_no, f"arrival must be seconds >= 0, got {arrival!r}")
        priority = record.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise _fail(path, line_no, f"priority must be an integer, got {priority!r}")
        after = record.get("after")
        if after is not None and not isinstance(after, str):
            raise _fail(path, line_no, f"after must be a request id string, got {after!r}")
        return TraceRequest(
            rid=str(record.get("rid", f"req-{index}")),
            arrival=float(arrival),
            input_ids=arr.astype(TOKEN_DTYPE),
            output_len=output_len,
            output_ids=out_arr,
            priority=priority,
            after=after,
        )

    return sorted(_parse_lines(path, parse, skipped, ordered=False), key=lambda r: r.arrival)


def write_token_jsonl(path: str | Path, trace: Iterable[TraceRequest]) -> None:
    """Write `trace` in radixserve's JSONL format (readable by `read_token_jsonl`)."""
    with Path(path).open("w") as handle:
        for r in trace:
            record = {
                "rid": r.rid,
                "arrival": r.arrival,
                "input_ids": r.input_ids.tolist(),
                "output_len": r.output_len,
                "priority": r.priority,
            }
            if r.after is not None:
                record["after"] = r.after
            if r.output_ids is not None:
                record["output_ids"] = r.output_ids.tolist()
            handle.write(json.dumps(record) + "\n")


def write_mooncake(path: str | Path, records: Iterable[dict]) -> None:
    """Write Mooncake JSONL records (`timestamp`, `input_length`, `output_length`,
    `hash_ids`), one per line, as `read_mooncake` reads them."""
    with Path(path).open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def sniff_format(path: str | Path) -> str:
    """`mooncake` if the first record of the trace file has `hash_ids`, else `tokens`."""
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"trace file {path} does not exist")
    for _, record in _records(path):
        if isinstance(record, dict):
            return "mooncake" if "hash_ids" in record else "tokens"
    return "tokens"


def load_trace(
    path: str | Path,
    fmt: str = "auto",
    block_size: int = 512,
    *,
    block_keys: bool = False,
    skipped: list[str] | None = None,
) -> list[TraceRequest]:
    """Read a trace file; `fmt` is `mooncake`, `tokens`, or `auto` (sniffed from its first
    record). `block_keys` applies to Mooncake traces; `skipped` as in `read_mooncake`."""
    path = Path(path)
    if fmt == "auto":
        fmt = sniff_format(path)
    elif not path.is_file():
        raise InvalidArgumentError(f"trace file {path} does not exist")
    if fmt == "mooncake":
        return read_mooncake(path, block_size, block_keys=block_keys, skipped=skipped)
    if fmt == "tokens":
        return read_token_jsonl(path, skipped=skipped)
    raise InvalidArgumentError(f"trace format must be auto, mooncake or tokens, got {fmt!r}")
