"""The engine's two paged-attention backends: greedy tokens with attention_backend="flex" are
those of "gather" (the reference) on random checkpoints, over steps that mix decodes with
prefill chunks and hit the prefix cache, with GQA, MQA, MHA and sliding windows (KV-cache
groups, and the mask-only path), eagerly and on the padded decode-graph path; how a backend is
chosen; and that a step's forward never reads a tensor back to the host."""
from __future__ import annotations

import sys

import pytest
import torch

import kvslim.engine.model_runner as model_runner
from engine_helpers import GREEDY, NO_KERNELS, engine, needs_kernels, prompts_of, run, tokens
from kvslim.attention import resolve_attention_backend
from kvslim.attention import backends
from kvslim.attention.backends import CPU_DEFAULT, CUDA_DEFAULT
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.model_runner import ModelRunner
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError

KERNEL = pytest.param("kernel", marks=needs_kernels)

NEW = 8
PARAMS = SamplingParams(max_tokens=NEW, **GREEDY)
# Small budgets keep the pool small: the CPU's eager FlexAttention scores every pool slot.
SMALL = dict(kv_cache_memory="96KiB", block_size=8, max_num_batched_tokens=24)


def workload() -> list[list[int]]:
    """Prompts longer than a step's token budget (chunked, beside running decodes), three of
    them after one shared 40-token prefix (prefix-cache hits once the first is cached)."""
    shared = prompts_of([40], seed=7)[0]
    return prompts_of([3, 30, 11, 1], seed=1) + prompts_of([5, 9, 2], seed=2, prefix=shared)


def record_steps(monkeypatch) -> list[tuple[int, int, bool]]:
    """Per eager step of the engine: decodes, prefill chunks, whether a chunk had a cached
    prefix."""
    seen = []
    build = model_runner.build_paged_attention

    def recording(backend, kv_caches, layouts, *args, **kwargs):
        layout = layouts[0]
        seen.append((layout.num_decode_tokens, len(layout.prefills),
                     any(c.context_len > c.query_len for c in layout.prefills)))
        return build(backend, kv_caches, layouts, *args, **kwargs)
    monkeypatch.setattr(model_runner, "build_paged_attention", recording)
    return seen


def greedy(path, backend: str, **config) -> list[list[int]]:
    eng = engine(path, attention_backend=backend, **{**SMALL, **config})
    assert eng.runner.attention_backend == backend
    prompts = workload()
    first = tokens(run(eng, prompts[:5], PARAMS))       # the shared prefix gets cached
    return first + tokens(run(eng, prompts[5:], PARAMS))


@pytest.mark.parametrize("variant,config", [
    ("gqa", {}), ("mqa", {}), ("mha", {}), ("head_dim", {}),   # head_dim 24
    ("gemma3", {}),                                   # windows: three one-layer cache groups
    ("gemma3", {"keep_out_of_window_blocks": True}),  # windows as masks over one group
    ("mixtral", {"block_size": 4}),                   # every layer windowed: one window group
])
@pytest.mark.parametrize("backend", ["flex", KERNEL])
def test_each_backend_greedy_equals_gather(hf_checkpoints, monkeypatch, variant, config, backend):
    path = hf_checkpoints[variant]
    want = greedy(path, "gather", **config)
    steps = record_steps(monkeypatch)
    assert greedy(path, backend, **config) == want
    assert any(d and p for d, p, _ in steps)           # decodes and chunks in one step
    assert any(cached for _, _, cached in steps)       # chunks after a cached prefix


def test_padded_decode_path_prepares_every_shape_at_start(hf_checkpoints, monkeypatch):
    """The decode-graph path (run eagerly here) has every padded shape ready before the first
    step; serving only replays those shapes, and flex gives gather's tokens on it."""
    path = hf_checkpoints["gqa"]
    want = greedy(path, "gather")
    shapes = []
    eng = engine(path, attention_backend="flex", max_num_seqs=6, **SMALL)
    eng.runner.enable_padded_decode()
    graphs = eng.runner.decode_graphs
    max_blocks = eng.runner.block_tables.max_blocks
    assert graphs.widths == [max_blocks]               # flex: one width, the largest
    assert set(graphs.graphs) == {(b, max_blocks) for b in (1, 2, 4, 6)}
    prepared = dict(graphs.graphs)
    forward = type(graphs)._forward
    monkeypatch.setattr(type(graphs), "_forward",
                        lambda self, b, w: shapes.append((b, w)) or forward(self, b, w))
    prompts = workload()
    got = tokens(run(eng, prompts[:5], PARAMS)) + tokens(run(eng, prompts[5:], PARAMS))
    assert got == want
    assert shapes and set(shapes) <= set(prepared)     # padded decodes ran, none new
    assert graphs.graphs == prepared


def test_gather_decode_widths_are_few_and_cover_every_table():
    from kvslim.engine.decode_graphs import capture_widths
    assert capture_widths(512, "gather") == [4, 16, 64, 256, 512]
    assert capture_widths(64, "gather") == [4, 16, 64]
    assert capture_widths(3, "gather") == [3]
    assert capture_widths(512, "flex") == capture_widths(512, "kernel") == [512]


class NoHostReads:
    """Fails a test when kvslim's code (not torch's) reads a tensor's value on the host."""
    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.monkeypatch, self.active = monkeypatch, False
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._guard(name, original))

    def _guard(self, name, original):
        def guarded(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self.active and "/kvslim/" in caller:
                raise AssertionError(f"Tensor.{name} in {caller}:{sys._getframe(1).f_lineno}")
            return original(tensor, *args, **kwargs)
        return guarded

    def around(self, method):
        def wrapped(*args, **kwargs):
            self.active = True
            try:
                return method(*args, **kwargs)
            finally:
                self.active = False
        return wrapped


@pytest.mark.parametrize("backend", ["gather", "flex", KERNEL])
@pytest.mark.parametrize("padded", [False, True])
def test_a_step_forward_never_reads_tensors_back(hf_checkpoints, monkeypatch, backend, padded):
    """Inputs, block tables, metadata, attention and the model: host values come from Python
    lists, never from tensors (on CUDA each read would wait for the device)."""
    path = hf_checkpoints["gemma3"]
    eng = engine(path, attention_backend=backend, **SMALL)
    if padded:
        eng.runner.enable_padded_decode()
    guard = NoHostReads(monkeypatch)
    monkeypatch.setattr(ModelRunner, "forward", guard.around(ModelRunner.forward))
    run(eng, workload()[:5], PARAMS)


def test_choosing_a_backend(hf_checkpoints, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert CPU_DEFAULT == "kernel"      # the fastest, and batch-invariant (backends.py)
    assert resolve_attention_backend("auto", cpu, False, 16, kernel_usable=True) == "kernel"
    assert resolve_attention_backend("auto", cpu, True, 16, kernel_usable=True) == "kernel"
    assert resolve_attention_backend("auto", cpu, False, 16) == "gather"   # where it cannot run
    assert engine(hf_checkpoints["gqa"]).runner.attention_backend == (
        "gather" if NO_KERNELS else "kernel")
    bf16 = LLMEngine(hf_checkpoints["gqa"], EngineConfig(dtype="bfloat16", device="cpu",
                                                         kv_cache_memory="8MiB"))
    assert bf16.runner.attention_backend == "gather"
    assert CUDA_DEFAULT == "gather"     # faster on the H200 measured (backends.py)
    assert resolve_attention_backend("auto", cuda, False, 16) == "gather"
    monkeypatch.setattr(backends, "CUDA_DEFAULT", "flex")
    assert resolve_attention_backend("auto", cuda, False, 16) == "flex"
    assert resolve_attention_backend("auto", cuda, False, 8) == "gather"   # kernel tile: 16
    assert resolve_attention_backend("flex", cpu, False, 8) == "flex"
    assert resolve_attention_backend("flex", cuda, True, 16) == "gather"   # quantized cache
    with pytest.raises(KvslimError, match="multiple of 16"):
        resolve_attention_backend("flex", cuda, False, 8)
    with pytest.raises(KvslimError, match="attention_backend must be one of auto, gather, flex, "
                                          "kernel"):
        EngineConfig(attention_backend="paged")
    eng = engine(hf_checkpoints["gqa"], attention_backend="flex", kv_cache_dtype="int8")
    assert eng.runner.attention_backend == "gather"
    assert resolve_attention_backend("kernel", cpu, True, 16, kernel_usable=True) == "kernel"
    assert resolve_attention_backend("auto", cuda, False, 16, kernel_usable=True) == "flex"
    with pytest.raises(KvslimError, match="attention_backend=kernel needs the CPU, a float32"):
        resolve_attention_backend("kernel", cpu, False, 16, kernel_usable=False)
    with pytest.raises(KvslimError, match="attention_backend=kernel needs"):
        engine(hf_checkpoints["gqa"], attention_backend="kernel", kv_cache_dtype="fp8_e4m3")
    if NO_KERNELS:
        with pytest.raises(KvslimError, match="kvslim's C.. kernels"):
            engine(hf_checkpoints["gqa"], attention_backend="kernel", kv_cache_dtype="int8")
    else:
        eng = engine(hf_checkpoints["gqa"], attention_backend="kernel", kv_cache_dtype="int8")
        assert eng.runner.attention_backend == "kernel"


def test_cli_flag_reaches_the_engine_config():
    from kvslim.cli.engine_args import engine_config_from_args
    from kvslim.cli.main import build_parser
    args = build_parser().parse_args(["generate", "--prompt", "hi",
                                      "--attention-backend", "flex"])
    assert engine_config_from_args(args).attention_backend == "flex"
    args = build_parser().parse_args(["serve", "model"])
    assert engine_config_from_args(args).attention_backend == "auto"
