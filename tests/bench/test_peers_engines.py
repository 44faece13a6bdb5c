"""The peer engines of `kvslim bench peers` against fakes: llama.cpp's tools and vLLM's venv absent
(skipped with the reason, nothing built), and fake tools / a fake `vllm` package behind the
real subprocess plumbing (arguments, parsing, the worker's pipe protocol)."""
import stat
import sys
import textwrap

import pytest

from kvslim_lab.bench.llamacpp_tools import LlamaCppTools
from kvslim_lab.bench.peers.llamacpp import LlamaCppEngine
from kvslim_lab.bench.peers.suite import PeersPlan, Unavailable, run_peers
from kvslim_lab.bench.peers.vllm_peer import VllmEngine
from kvslim_lab.bench.workload import Workload


def _never():
    raise AssertionError("no file is made for an engine that cannot run")


def _script(path, body: str):
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_absent_llamacpp_is_skipped_with_how_to_build_it(tmp_path):
    engine = LlamaCppEngine("q4_0", "llama.cpp Q4_0", LlamaCppTools(tmp_path / "none", 1),
                            _never, tmp_path)
    r = run_peers([engine], {"decode": [[1]], "offline": [[1]]}, PeersPlan(rounds=1), {}, {}, 1,
                  show_progress=False).to_dict()
    (e,) = r["engines"]
    assert e["status"] == "skipped" and "benchmarks/build_llamacpp.sh" in e["reason"]
    assert r["ratios"] == {"decode": {}, "offline": {}}


def test_llamacpp_engine_runs_its_tools_and_keeps_every_parallel_setting(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "llama-quantize", """
        import shutil, sys
        shutil.copy(sys.argv[1], sys.argv[2])
    """)
    _script(bin_dir / "llama-perplexity", "")
    _script(bin_dir / "llama-bench", """
        import json, sys
        a = sys.argv
        assert a[a.index("-d") + 1] == "5" and a[a.index("-r") + 1] == "1"
        print(json.dumps([{"n_gen": int(a[a.index("-n") + 1]), "avg_ts": 250.0}]))
    """)
    _script(bin_dir / "llama-batched-bench", """
        import json, sys
        a = sys.argv
        for pl in a[a.index("-npl") + 1].split(","):
            print(json.dumps({"n_kv_max": 1, "pl": int(pl), "tg": 6, "t": 0.1 * int(pl)}))
    """)
    f32 = tmp_path / "m-f32.gguf"
    f32.write_bytes(b"GGUF")
    engine = LlamaCppEngine("q8_0", "llama.cpp Q8_0", LlamaCppTools(bin_dir, 1), lambda: f32,
                            tmp_path / "work", parallel=(4, 16, 64))
    engine.start()
    assert engine.gguf == tmp_path / "work" / "m-f32-q8_0.gguf" and engine.gguf.is_file()
    assert engine.decode([7] * 5, 3) == pytest.approx(1 / 250)
    assert engine.offline([[7] * 5] * 20, 6) == {"-npl 4": 60.0, "-npl 16": 60.0}
    assert engine.offline([[7] * 5] * 2, 6) == {"-npl 2": 60.0}        # fewer prompts than 4


def test_absent_vllm_is_skipped_with_the_reason(tmp_path):
    plan = PeersPlan(Workload(1, 4, 2), Workload(2, 4, 2), rounds=1)
    engines = [VllmEngine("vllm-bf16", "vLLM", None, _never, 1, tmp_path),
               VllmEngine("vllm-w8a8", "vLLM", tmp_path / "no-venv/bin/python", _never, 1,
                          tmp_path)]
    r = run_peers(engines, {"decode": [[1]], "offline": [[1]]}, plan, {}, {}, 1,
                  show_progress=False).to_dict()
    assert [e["reason"] for e in r["engines"]] == [
        "no vLLM venv given (--vllm-python PATH, its bin/python)",
        f"--vllm-python {tmp_path / 'no-venv/bin/python'}: no such file"]


FAKE_VLLM = '''
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, max_tokens, **kw):
        self.max_tokens = max_tokens


class _Out:
    def __init__(self, n):
        self.outputs = [type("C", (), {"token_ids": list(range(n))})()]


class LLM:
    def __init__(self, model, **kw):
        if model.endswith("bad"):
            raise ValueError("cannot load " + model)
        print("INFO fake vLLM log line on stdout")

    def generate(self, prompts, params, use_tqdm=True):
        return [_Out(params.max_tokens) for p in prompts]
'''


@pytest.fixture
def fake_vllm_python(tmp_path):
    """A 'venv python': this interpreter with a fake `vllm` package on its path."""
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def test_vllm_worker_answers_over_its_pipe(tmp_path, fake_vllm_python):
    engine = VllmEngine("vllm-bf16", "vLLM CPU bf16", fake_vllm_python, lambda: tmp_path / "m",
                        1, tmp_path / "logs")
    engine.start()
    try:
        assert engine.label == "vLLM CPU bf16 (vLLM 0.0-fake)"
        assert isinstance(engine.decode([1, 2, 3], 4), float)        # no timing asserted
        (setting, speed), = engine.offline([[1, 2]] * 3, 5).items()
        assert setting == "max_num_seqs 64" and speed > 0
    finally:
        engine.close()
    assert engine.proc is None


def test_vllm_that_cannot_load_the_model_says_why(tmp_path, fake_vllm_python):
    engine = VllmEngine("vllm-w8a8", "vLLM", fake_vllm_python, lambda: tmp_path / "bad", 1,
                        tmp_path / "logs")
    with pytest.raises(Unavailable, match=r"vLLM: ValueError: cannot load .*bad \(log: "):
        engine.start()
