"""Tokenizer, chat template and incremental detokenization.

`TextTokenizer` wraps a `tokenizers.Tokenizer` with the model's special token ids and chat
template (rendered with Jinja2 in a sandbox, as Hugging Face does). `IncrementalDetokenizer`
turns a growing list of token ids into text pieces that never split a multi-byte character,
and cuts the text at the first stop string, which may span several tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from radixserve.errors import InvalidArgumentError

_REPLACEMENT = "\ufffd"


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    bos_token_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"text to encode must be a string, got {type(text)}")
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        except TypeError:  # the Rust side refuses strings that are not valid Unicode
            if any("\ud800" <= ch <= "\udfff" for ch in text):
                raise InvalidArgumentError(
                    "the text holds a lone UTF-16 surrogate, which is not valid Unicode",
                    field="prompt",
                ) from None
            raise
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        if self.chat_template is None:
            raise InvalidArgumentError("this model has no chat template; send a plain prompt")
        if not messages:
            raise InvalidArgumentError("messages must not be empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InvalidArgumentError(f"messages[{i}] needs a string 'role'")
            if not isinstance(m.get("content", ""), str):
                raise InvalidArgumentError(f"messages[{i}].content must be a string")
        template = _compile(self.chat_template)
        from jinja2.exceptions import TemplateError

        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **kwargs,
            )
        except InvalidArgumentError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidArgumentError(
                f"the chat template failed on these messages: {exc}"
            ) from None


_COMPILED: dict[str, object] = {}


def _compile(source: str):
    template = _COMPILED.get(source)
    if template is None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise InvalidArgumentError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(source)
        except TemplateError as exc:
            raise InvalidArgumentError(f"the chat template does not compile: {exc}") from None
        _COMPILED[source] = template
    return template


class IncrementalDetokenizer:
    """Text of a token stream, emitted piece by piece.

    `push(token_ids)` adds tokens and returns the new text that is final: never half of a
    multi-byte character, and never text that might be the start of a stop string. Once a
    stop string appears, the text is cut before it, `stopped` holds the string, and nothing
    more is emitted.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all final text so far, stop string excluded
        self._emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped: str | None = None

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped is not None:
            return ""
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
        if self.stop:
            window = max(0, self._emitted - self._hold)
            hits = [(self.text.find(s, window), s) for s in self.stop]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                at, s = min(hits)
                self.stopped = s
                self.text = self.text[:at]
                return self._release(len(self.text))
        return self._release(len(self.text) - self._hold if self.stop else len(self.text))

    def flush(self) -> str:
        """Everything not yet emitted (at the end of the stream)."""
        if self.stopped is None:
            tail = self.tokenizer.decode(self.ids[self._prefix_offset :])
            prefix = self.tokenizer.decode(self.ids[self._prefix_offset : self._read_offset])
            if len(tail) > len(prefix):
                self.text += tail[len(prefix) :]
                self._read_offset = len(self.ids)
                self._prefix_offset = self._read_offset
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        piece = self.text[self._emitted : upto]
        self._emitted = upto
        return piece
