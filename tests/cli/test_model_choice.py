"""Which import of a GGUF model the inference commands run: the quantized one with the default
--dtype auto, the float32 one with an explicit dtype."""
import argparse

import pytest

from kvslim.cli import engine_args
from kvslim_lab.cli import bench_engine_cmds
from kvslim.formats import registry


@pytest.fixture
def resolved(monkeypatch, tmp_path):
    calls = []

    def fake_resolve(name, show_progress=True, quantized=False):
        calls.append((name, quantized))
        return tmp_path

    monkeypatch.setattr(registry, "resolve_model", fake_resolve)
    return calls


@pytest.mark.parametrize("dtype,quantized", [("auto", True), ("float32", False)])
def test_bench_commands(resolved, dtype, quantized):
    args = argparse.Namespace(threads=None, model=None, dtype=dtype)
    bench_engine_cmds._setup(args)
    assert resolved == [(None, quantized)]


@pytest.mark.parametrize("dtype,quantized", [("auto", True), ("float32", False),
                                             ("bfloat16", False)])
def test_engine_commands(resolved, monkeypatch, dtype, quantized):
    import kvslim.engine.llm as llm_module
    monkeypatch.setattr(engine_args, "check_args", lambda args: None)
    monkeypatch.setattr(llm_module, "LLM", lambda *a, **k: "llm")
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    engine_args.add_engine_args(parser)
    args = parser.parse_args(["--dtype", dtype])
    assert engine_args.llm_from_args(args) == "llm"
    assert resolved == [(None, quantized)]
