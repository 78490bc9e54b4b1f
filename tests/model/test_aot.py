"""The batch-1 decode step compiled ahead of time (`EngineConfig.compile_aot`)."""

from __future__ import annotations

import logging

import torch
from model_helpers import make_engine
from test_compiled import staggered

from radixserve.model.aot import AOTDecode, package_key
from radixserve.model.aot import _example as aot_example


def test_the_ahead_of_time_step_gives_the_eager_greedy_tokens(
    llama_dir, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    eager = staggered(make_engine(llama_dir, dtype="float64"))
    with caplog.at_level(logging.INFO):
        engine = make_engine(llama_dir, dtype="float64", compile_aot=True, max_running_requests=4)
    compiled = engine.compiled_decode
    assert compiled is not None and compiled.aot is not None, caplog.text
    assert "compiled the batch-1 decode step ahead of time" in caplog.text
    calls = {"n": 0}
    aot = compiled.aot

    def counted(*args):
        calls["n"] += 1
        return aot(*args)

    counted.max_width = aot.max_width
    compiled.aot = counted
    assert staggered(engine) == eager
    assert calls["n"] >= 4  # the steps where one request decoded alone
    assert engine.compiled_decode is compiled  # no step failed over to eager
    assert list((tmp_path / "aot").glob("*.pt2"))


def test_a_package_is_cached_and_reads_the_models_own_int4_tensors(llama_dir, tmp_path):
    engine = make_engine(llama_dir, weight_format="int4", max_running_requests=1)
    model, kv = engine.model, engine.kv
    assert any(type(m).__name__ == "Int4Linear" for m in model.modules())
    AOTDecode.build(model, kv, tmp_path)  # compiles; build refuses a step unlike the eager one
    packages = list(tmp_path.glob("*.pt2"))
    assert [p.name for p in packages] == [f"decode-b1-{package_key(model, kv)}.pt2"]
    stamp = packages[0].stat().st_mtime_ns
    step = AOTDecode.build(model, kv, tmp_path)  # loaded from the cache
    assert packages[0].stat().st_mtime_ns == stamp
    example = aot_example(kv)
    before = step(*example)[0].clone()
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    assert not torch.equal(step(*example)[0], before), "the runner reads the model's tensors"
