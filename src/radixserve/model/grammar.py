"""Constrained decoding with xgrammar: compiled grammars, per-request matchers, logit masks.

A request names at most one grammar in its sampling params (`json_schema`, `regex`, `ebnf` or
`structural_tag`, as SGLang's native API spells them). `GrammarBackend.compile` compiles it on
a thread of its own and caches the result by the grammar's text, so the engine thread never
waits on a compile. `GrammarMatcher` follows one request's output: `apply_masks` sets the
logits the grammar forbids to -inf, `accept` advances on the sampled token.

xgrammar is an optional dependency (`pip install radixserve[structured]`); without it a request
that asks for a grammar gets an `InvalidArgumentError` that says so.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from radixserve.errors import InvalidArgumentError
from radixserve.model.tokenizer import TextTokenizer
from radixserve.sched.request import GRAMMAR_FIELDS

log = logging.getLogger(__name__)

_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One grammar by kind and source text; equal specs share one compiled grammar."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_FIELDS:
            raise InvalidArgumentError(f"grammar kind must be one of {GRAMMAR_FIELDS}")
        if not isinstance(self.text, str) or not self.text:
            raise InvalidArgumentError(f"{self.kind} must be a non-empty string", field=self.kind)


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def _require_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InvalidArgumentError(
            "structured output needs xgrammar, which is not installed on this server "
            "(pip install 'radixserve[structured]')"
        ) from None
    return xgrammar


class GrammarBackend:
    """Compiles grammars for one tokenizer and vocabulary, off the calling thread.

    `compile(spec)` returns a future of the compiled grammar and never blocks. Results are
    cached by spec (at most `cache_size`, least recently asked first out); a failed compile
    raises `InvalidArgumentError` naming the grammar's field, and is not cached.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        vocab_size: int,
        threads: int = 1,
        cache_size: int = 512,
    ) -> None:
        xgr = _require_xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(tokenizer.eos_token_ids)
        info = xgr.TokenizerInfo(
            _encoded_vocab(tokenizer, vocab_size),
            _vocab_type(xgr, tokenizer),
            vocab_size=vocab_size,
            stop_token_ids=self.stop_token_ids or None,
            add_prefix_space=_adds_prefix_space(tokenizer),
        )
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, threads))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixserve-grammar")
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the compiled grammar for `spec` (shared with equal specs)."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: f.exception() is None or self._forget(spec, f))
        return future

    def _forget(self, spec: GrammarSpec, future: Future) -> None:
        with self._lock:
            if self._cache.get(spec) is future:
                del self._cache[spec]

    def _compile(self, spec: GrammarSpec):
        compiler = self._compiler
        try:
            if spec.kind == "json_schema":
                grammar = self._xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
                return compiler.compile_grammar(_strict_string_chars(str(grammar)))
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return compiler.compile_grammar(spec.text)
            grammar = self._xgr.Grammar.from_structural_tag(spec.text)
            return compiler.compile_grammar(_strict_string_chars(str(grammar)))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidArgumentError(
                f"invalid {spec.kind}: {_first_line(exc)}", field=spec.kind
            ) from None

    def matcher(self, compiled) -> GrammarMatcher:
        """A fresh matcher over a grammar `compile` produced."""
        return GrammarMatcher(compiled, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarMatcher:
    """The state of one request inside its grammar."""

    def __init__(self, compiled, vocab_size: int) -> None:
        xgr = _require_xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.rejected: int | None = None  # a sampled token the grammar refused
        self.stuck = False  # the grammar allowed no token of the vocabulary

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a `new_bitmask` tensor."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance on `token`; False (and `rejected` set) when the grammar does not allow it."""
        if self._matcher.is_terminated():
            return True
        ok = self._matcher.accept_token(token)
        if not ok:
            self.rejected = token
        return ok

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""
        return self._matcher.is_terminated()

    def jump_forward_tokens(self) -> list[int]:
        """Token ids spelling the text the grammar forces next, whatever the model would
        sample ([] when nothing is forced). The matcher is not advanced."""
        return list(self._matcher.find_jump_forward_tokens())


def apply_masks(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
    """Set to -inf, in place, every logit the row's grammar forbids (rows without one stay).

    A row whose grammar allows no token of the vocabulary at all is marked `stuck` and left
    finite, so sampling stays defined; the token drawn there is then refused by `accept`.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    xgr = _require_xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_mask(bitmask, i)
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=rows
    )
    stuck = torch.isneginf(logits[rows]).all(dim=-1).tolist()
    for row, dead in zip(rows, stuck, strict=True):
        if dead:
            matchers[row].stuck = True
            logits[row] = 0.0


# -- the tokenizer as xgrammar sees it -----------------------------------------------------


def _encoded_vocab(tokenizer: TextTokenizer, vocab_size: int) -> list[str]:
    """Token strings by id; special tokens are "", so a grammar never emits them as text."""
    tok = tokenizer.tokenizer
    vocab = [""] * vocab_size
    for text, token_id in tok.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            vocab[token_id] = text
    for token_id, added in tok.get_added_tokens_decoder().items():
        if added.special and token_id < vocab_size:
            vocab[token_id] = ""
    return vocab


def _backend(tokenizer: TextTokenizer) -> dict:
    return json.loads(tokenizer.tokenizer.to_str())


def _components(node) -> Iterable[dict]:
    if not isinstance(node, dict):
        return
    yield node
    for child in node.get("decoders") or node.get("pretokenizers") or node.get("normalizers") or []:
        yield from _components(child)


def _vocab_type(xgr, tokenizer: TextTokenizer):
    spec = _backend(tokenizer)
    decoders = {d.get("type") for d in _components(spec.get("decoder"))}
    if "ByteLevel" in decoders:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in decoders:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _adds_prefix_space(tokenizer: TextTokenizer) -> bool:
    spec = _backend(tokenizer)
    for part in (*_components(spec.get("normalizer")), *_components(spec.get("pre_tokenizer"))):
        if part.get("type") == "Prepend" and part.get("prepend") == "▁":
            return True
        if part.get("type") == "Metaspace" and part.get("prepend_scheme", "always") != "never":
            return True
    return False


_LOOSE_STRING_CHARS = r"[^\"\\\r\n]"
_STRICT_STRING_CHARS = r"[^\0-\x1f\"\\\r\n]"


def _strict_string_chars(ebnf: str) -> str:
    """xgrammar 0.2.9 lets strings with `maxLength`/`minLength` hold raw control characters,
    which JSON forbids (its plain strings exclude them); exclude them there too."""
    return ebnf.replace(_LOOSE_STRING_CHARS, _STRICT_STRING_CHARS)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return _CPP_PREFIX.sub("", text)  # "[time] file.cc:line: " before xgrammar's C++ errors
