"""Loading: HF directories, refused formats, architectures, and GGUF's q/k row order."""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_helpers import make_engine

from radixserve.engine import Engine
from radixserve.errors import InvalidArgumentError
from radixserve.model.llama import LlamaConfig
from radixserve.model.loader import _unpermute, load_model


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (interleaves rotary pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    np.testing.assert_array_equal(_unpermute(llama_cpp_permute(w, 8), 8), w)
    b = np.arange(4 * 16, dtype=np.float32)
    np.testing.assert_array_equal(_unpermute(llama_cpp_permute(b, 4), 4), b)


def test_pickles_are_never_loaded(tmp_path, llama_dir):
    (tmp_path / "model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(InvalidArgumentError, match="never loaded"):
        load_model(tmp_path / "model.bin", None, "cpu")
    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(InvalidArgumentError, match="never loaded, use safetensors"):
        load_model(tmp_path, None, "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(InvalidArgumentError, match="lacks"):
        load_model(tmp_path, None, "cpu")


def test_missing_and_unsupported_models_are_clear_errors(tmp_path):
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        load_model(tmp_path / "nope.gguf", None, "cpu")
    with pytest.raises(InvalidArgumentError, match="not supported"):
        LlamaConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_engine_rejects_bad_requests_by_name(llama_dir):
    engine = make_engine(llama_dir, max_context=64)
    with pytest.raises(ValueError, match="context length 64"):
        engine.add_request(list(range(1, 60)), {"max_new_tokens": 10})
    with pytest.raises(ValueError, match="token ids must lie"):
        engine.add_request([1, 2, 10_000])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.add_request([1, 2], {"max_tokens": 3})
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1, 2], {"temperature": -1})
    with pytest.raises(ValueError, match="device"):
        Engine(str(llama_dir), device="tpu")
    assert not engine.has_work()
