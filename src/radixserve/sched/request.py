"""Requests and their sampling parameters, as the scheduler sees them. No tensors."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.allocator import SLOT_DTYPE
from radixserve.cache.hashing import TOKEN_DTYPE
from radixserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from radixserve.cache.radix import TreeNode


def _check_range(name: str, value: float, lo: float, hi: float, *, integer: bool = False) -> None:
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not lo <= value <= hi:
        raise InvalidArgumentError(
            f"{name} must be {kind} in [{lo}, {hi}], got {value!r}", field=name
        )


GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
"""Sampling params that constrain the output to a grammar (at most one per request)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Every field is validated; a bad value names itself.

    `stop_token_ids` always stop; the model's end-of-sequence ids stop unless `ignore_eos`.
    `stop` strings are matched by the engine's detokenizer, across token boundaries.
    At most one of `GRAMMAR_FIELDS` constrains the output; the engine compiles it.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        _check_range("max_new_tokens", self.max_new_tokens, 0, 2**31 - 1, integer=True)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidArgumentError("top_p must be in (0, 1], got 0")
        _check_range("top_k", self.top_k, 0, 2**31 - 1, integer=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0)
        if self.repetition_penalty == 0.0:
            raise InvalidArgumentError("repetition_penalty must be in (0, 10], got 0")
        if self.seed is not None:
            _check_range("seed", self.seed, 0, 2**63 - 1, integer=True)
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, 20, integer=True)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidArgumentError("stop must be a string or a list of non-empty strings")
        ids = frozenset(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InvalidArgumentError("stop_token_ids must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", ids)
        grammars = [k for k in GRAMMAR_FIELDS if getattr(self, k) is not None]
        for k in grammars:
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise InvalidArgumentError(f"{k} must be a non-empty string", field=k)
        if len(grammars) > 1:
            raise InvalidArgumentError(
                f"give at most one of {', '.join(GRAMMAR_FIELDS)}; got {', '.join(grammars)}",
                field=grammars[1],
            )

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the grammar the output must follow, or None."""
        for kind in GRAMMAR_FIELDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @classmethod
    def from_dict(cls, params: dict | SamplingParams | None) -> SamplingParams:
        """Build from a dict (unknown keys are refused by name), or pass an instance through."""
        if params is None:
            return cls()
        if isinstance(params, cls):
            return params
        if not isinstance(params, dict):
            raise InvalidArgumentError(f"sampling params must be a dict, got {type(params)}")
        unknown = set(params) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidArgumentError(
                f"unknown sampling parameter(s): {sorted(unknown)}", field=sorted(unknown)[0]
            )
        values = dict(params)
        for name in ("stop", "stop_token_ids"):
            value = values.get(name)
            if value is None:
                values.pop(name, None)
            elif isinstance(value, str) and name == "stop":
                values[name] = (value,)
            elif isinstance(value, (list, tuple)) and all(
                isinstance(v, str if name == "stop" else int) for v in value
            ):
                values[name] = tuple(value)
            else:
                kind = "strings" if name == "stop" else "integer token ids"
                raise InvalidArgumentError(f"{name} must be a list of {kind}", field=name)
        if not isinstance(values.get("ignore_eos", False), bool):
            raise InvalidArgumentError("ignore_eos must be true or false", field="ignore_eos")
        for kind in ("json_schema", "structural_tag"):  # SGLang takes these as JSON text
            if isinstance(values.get(kind), (dict, list)):
                values[kind] = json.dumps(values[kind])
        return cls(**values)


class ReqState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


ABORT_CAUSES = ("client", "timeout", "shutdown", "error", "memory", "too_long", "invalid")
"""Why an `abort` happened: the client went away or asked; a server-side timeout; the server
is shutting down; a model step failed; the KV pool ran out; the request can never fit; the
request's grammar does not compile."""


@dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a request ended: `stop` (a stop token or string), `length`, or `abort`.

    An `abort` carries a `message` for people and a `cause` from `ABORT_CAUSES` for code.
    """

    kind: str
    matched: int | str | None = None
    message: str | None = None
    cause: str | None = None

    def __post_init__(self) -> None:
        if self.kind == "abort" and self.cause not in ABORT_CAUSES:
            raise InvalidArgumentError(
                f"an abort needs a cause from {ABORT_CAUSES}, got {self.cause!r}"
            )


@dataclass(eq=False)
class Req:
    """One generation request and everything the scheduler holds for it.

    KV bookkeeping: `kv_slots[:kv_allocated]` are the slots the request uses, a whole number of
    pages; the KV of tokens [0, kv_len) is computed. Slots [0, cached_len) belong to the radix
    tree and are locked through `last_node`; the rest are the request's own.
    """

    rid: str
    input_ids: np.ndarray
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    arrival_time: float | None = None
    extra_key: Hashable | None = None
    eos_token_ids: frozenset[int] = frozenset()

    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    finish_reason: FinishReason | None = None

    last_node: TreeNode | None = None
    cached_len: int = 0
    prefix_len: int = 0
    cached_tokens: int | None = None
    kv_len: int = 0
    kv_allocated: int = 0
    kv_slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=SLOT_DTYPE))

    queued_time: float = 0.0
    arrival_index: int = -1
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_retractions: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.rid, str) or not self.rid:
            raise InvalidArgumentError(f"rid must be a non-empty string, got {self.rid!r}")
        ids = np.asarray(self.input_ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise InvalidArgumentError("input_ids must be a 1-D sequence of integer token ids")
        if ids.size == 0:
            raise InvalidArgumentError("input_ids must not be empty")
        if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
            raise InvalidArgumentError("input_ids must be token ids in [0, 2**31)")
        self.input_ids = ids.astype(TOKEN_DTYPE, copy=False)
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidArgumentError(f"priority must be an integer, got {self.priority!r}")
        self.sampling = SamplingParams.from_dict(self.sampling)
        self.eos_token_ids = frozenset(self.eos_token_ids)
        if self.arrival_time is not None:
            self.queued_time = self.arrival_time

    # -- sequence ------------------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.input_ids) + len(self.output_ids)

    def token_ids(self, end: int | None = None) -> np.ndarray:
        """The sequence so far (prompt then output) as int32, cut at `end`."""
        n = self.seq_len if end is None else end
        if n <= len(self.input_ids) or not self.output_ids:
            return self.input_ids[:n]
        out = np.asarray(self.output_ids[: n - len(self.input_ids)], dtype=TOKEN_DTYPE)
        return np.concatenate([self.input_ids, out])

    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling.max_new_tokens - len(self.output_ids))

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED

    # -- KV slots ------------------------------------------------------------------------

    def kv_indices(self, end: int | None = None) -> np.ndarray:
        """KV slots of tokens [0, end) (default: all computed tokens)."""
        return self.kv_slots[: self.kv_len if end is None else end]

    def own_slots(self) -> np.ndarray:
        """The slots this request owns (not the tree's)."""
        return self.kv_slots[self.cached_len : self.kv_allocated]

    def append_slots(self, slots: np.ndarray) -> None:
        """Record newly allocated slots after the ones already held."""
        end = self.kv_allocated + len(slots)
        if end > len(self.kv_slots):
            grown = np.empty(max(end, 2 * len(self.kv_slots), 64), dtype=SLOT_DTYPE)
            grown[: self.kv_allocated] = self.kv_slots[: self.kv_allocated]
            self.kv_slots = grown
        self.kv_slots[self.kv_allocated : end] = slots
        self.kv_allocated = end

    def reset_kv(self) -> None:
        """Forget every slot (after they were released)."""
        self.last_node = None
        self.cached_len = self.kv_len = self.kv_allocated = 0


def pages(tokens: int, page_size: int) -> int:
    """The slots `tokens` tokens take when rounded up to whole pages."""
    return math.ceil(tokens / page_size) * page_size


def prepare_request(
    prompt: str | Sequence[int],
    sampling_params: dict | SamplingParams | None,
    tokenizer,
    vocab_size: int,
    max_context: int,
) -> tuple[list[int], SamplingParams]:
    """The token ids and checked sampling params of a request to a model with this tokenizer,
    vocabulary and context length; bad input raises `InvalidArgumentError` naming the field."""
    params = SamplingParams.from_dict(sampling_params)
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise InvalidArgumentError("token ids must be integers", field="prompt")
        if any(not 0 <= t < vocab_size for t in ids):
            raise InvalidArgumentError(f"token ids must lie in [0, {vocab_size})", field="prompt")
    if not ids:
        raise InvalidArgumentError("the prompt is empty", field="prompt")
    if len(ids) + params.max_new_tokens > max_context:
        raise InvalidArgumentError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
            f"the context length {max_context}",
            field="prompt" if len(ids) >= max_context else "max_new_tokens",
        )
    return [int(t) for t in ids], params
