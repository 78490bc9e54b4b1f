"""Incremental detokenization never splits a character, and holds back possible stop strings."""

from __future__ import annotations

from tokenizers import ByteLevelBPETokenizer

from radixserve.model.tokenizer import IncrementalDetokenizer, TextTokenizer

TEXT = "héllo wörld 😀 naïve café 日本語 ok 🚀!"


def byte_level() -> TextTokenizer:
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world ok"], vocab_size=260, min_frequency=1)
    return TextTokenizer(bpe._tokenizer, frozenset())


def test_pieces_never_split_a_multibyte_character():
    tok = byte_level()
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT) / 2, "multi-byte characters span several tokens"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT


def test_stop_string_is_held_back_then_cut():
    tok = byte_level()
    detok = IncrementalDetokenizer(tok, stop=["wörld"])
    out = "".join(detok.push([t]) for t in tok.encode(TEXT)) + detok.flush()
    assert out == "héllo " and detok.stopped == "wörld"
