"""Fixtures for the model and engine tests: tiny checkpoints, built once per session."""

from __future__ import annotations

import pytest
from model_helpers import tiny_checkpoint


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, llama_dir, qwen2_dir):
    return {
        "llama": llama_dir,
        "qwen2": qwen2_dir,
        "qwen3": tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3"),
        "llama-tied-rope3": tiny_checkpoint(
            tmp_path_factory.mktemp("llama3"),
            "llama",
            seed=1,
            tie_word_embeddings=True,
            rope_theta=500_000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    }
