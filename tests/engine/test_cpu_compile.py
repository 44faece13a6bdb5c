"""The compiled CPU decode step (engine/cpu_compile.py): greedy tokens identical to the eager
path for every layer type and both KV-cache dtypes, batched and alone, under preemption and with
prefix-cache hits; every program built at start-up and none while serving; and the ways it falls
back to the eager path (no C++ compiler, a failing build, a cache folder it cannot write).

The layer-type matrix traces with the "aot_eager" backend (the same graph, guards and custom
ops as Inductor's, run by eager kernels: seconds instead of minutes of C++ builds); the shipped
path's kernels (GGUF blocks) also run through Inductor itself."""
import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from checkpoints import VOCAB
from engine_helpers import GREEDY, NO_KERNELS, engine, prompts_of, run, tokens
from kvslim.engine import cpu_compile
from kvslim.engine.sampling_params import SamplingParams
from kvslim.quantization import QuantSpec
from kvslim.quantization.w8a8 import W8A8_SPEC
from kvslim.surgery.quantize.model import quantize_model

PARAMS = [SamplingParams(max_tokens=n, logprobs=0, **GREEDY) for n in (20, 14, 12, 16, 9, 18)]


def logprobs(outputs) -> list[list[float]]:
    """Every chosen token's logprob, as a float: equal only if every step's logits are."""
    return [[lp.logprob for lp in o.outputs[0].logprobs] for o in outputs]


def workload(vocab: int) -> list[list[int]]:
    """Lengths that cross blocks, one token, and three prompts that share a 24-token prefix
    (token ids 3..vocab)."""
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(3, vocab, (24,), generator=g).tolist()
    return ([torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 1, 30)]
            + [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 9, 1)])


def check_compiled_matches_eager(path, vocab: int = VOCAB, blocks: int = 8,
                                 prefix_hits: bool = True, bitwise: bool = True,
                                 max_num_seqs: int = 8, **options) -> dict:
    """One compiled engine, its cache tight (`blocks` blocks of 8): the batch preempts, the
    prompts sharing a prefix run alone afterwards hit the prefix cache, batch-1 decodes; tokens
    are the eager engine's, alone, and (`bitwise`) logprobs those of the same padded steps run
    eagerly. Returns the engine options of the compiled engine."""
    prompts = workload(vocab)
    eager = engine(path, **options)
    alone = [tokens(run(eager, [p], [sp]))[0] for p, sp in zip(prompts, PARAMS)]
    per_block = eager.runner.bytes_per_block // 2                 # a block of 8 tokens
    tight = dict(kv_cache_memory=blocks * per_block, block_size=8, max_num_seqs=max_num_seqs,
                 **options)
    compiled = engine(path, compile_decode=True, **tight)
    graphs = compiled.runner.decode_graphs
    built = graphs.compilations
    assert graphs.compiled is not None and built > 0          # it did compile, at start-up
    batched = run(compiled, prompts, PARAMS)
    assert tokens(batched) == alone
    assert compiled.kv_cache_stats().num_preemptions > 0
    # the same padded steps run eagerly give the same numbers to the last bit
    # (compile_numerics.py; the unpadded eager path attends over other key counts)
    if bitwise:
        padded = engine(path, **tight)
        padded.runner.enable_padded_decode()
        assert logprobs(batched) == logprobs(run(padded, prompts, PARAMS))
    one_by_one = [run(compiled, [p], [sp])[0] for p, sp in zip(prompts[3:], PARAMS[3:])]
    assert tokens(one_by_one) == alone[3:]
    assert all(o.metrics.num_cached_tokens >= 16 for o in one_by_one) == prefix_hits
    assert graphs.compilations == built                       # nothing compiled while serving
    assert len({tuple(t) for t in alone}) > 1
    return tight


@pytest.fixture
def traced_only(monkeypatch):
    monkeypatch.setattr(cpu_compile, "BACKEND", "aot_eager")


@pytest.fixture(scope="module")
def quantized(hf_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled-q")
    specs = {"gptq-4bit": ("rtn", QuantSpec(4, 32, sym=False, checkpoint_format="gptq_v2")),
             "int8": ("rtn", QuantSpec(8, -1, sym=True)), "w8a8": ("w8a8", W8A8_SPEC)}
    return {name: quantize_model(hf_checkpoints["gqa"], root / name, method, spec,
                                 show_progress=False)
            for name, (method, spec) in specs.items()}


@pytest.fixture(scope="module")
def gguf_blocks(tmp_path_factory):
    """A tiny GGUF kept in blocks: Q4_1 and Q8_0 linears, a Q8_0 tied table."""
    from gguf_files import write_tiny_gguf
    from kvslim.formats.gguf.importer import import_gguf
    root = tmp_path_factory.mktemp("compiled-gguf")
    types = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1,
             "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0}
    write_tiny_gguf(root / "m.gguf", types=types, hidden=256, ffn=256, tied=True)
    return str(import_gguf(root / "m.gguf", root / "kept", show_progress=False,
                           keep_quantized=True))


@pytest.mark.parametrize("variant", ["gqa", "mixtral", "gemma3", "deepseek_v3"])
def test_traced_float_moe_and_window_layers_match_eager(hf_checkpoints, variant, traced_only):
    # DeepSeek-V3: latent attention over its latent cache (absorbed), YaRN, noaux_tc MoE.
    # Gemma 3's global layers keep every block: its tight cache is larger. Window layers
    # (Mixtral's, Gemma 3's local ones) release theirs: a finished prompt leaves no prefix
    # MoE: the compiled step runs every expert on every row, eager only the rows routed to
    # each, and a float linear of one row takes another kernel than of several
    # (layers/cpu_linear.py): same tokens, not the same bits. DeepSeek's absorbed heads are
    # bitwise through kvslim's head_mm kernel only; torch's batched GEMM (no extension) picks
    # other blockings for other row counts.
    check_compiled_matches_eager(hf_checkpoints[variant], blocks=20 if variant == "gemma3" else 8,
                                 prefix_hits=variant in ("gqa", "deepseek_v3"),
                                 bitwise=variant != "mixtral"
                                 and not (variant == "deepseek_v3" and NO_KERNELS))


@pytest.mark.parametrize("kind", ["gptq-4bit", "int8", "w8a8"])
def test_traced_quantized_linears_match_eager(quantized, kind, traced_only):
    # the W8A8 model with the int8 KV cache: the other KV-cache dtype's gather and scales
    check_compiled_matches_eager(quantized[kind],
                                 **({"kv_cache_dtype": "int8"} if kind == "w8a8" else {}))


def test_the_shapes_run_at_start_up_leave_no_shape_to_compile(hf_checkpoints, traced_only):
    """Start-up runs every batch at the narrowest width and every width at the smallest
    batches only; unfrozen, every other padded shape runs without a new program."""
    # gather: its padded table widths are the shapes (the decode kernel reads one width)
    eng = engine(hf_checkpoints["gqa"], compile_decode=True, max_num_seqs=32, block_size=8,
                 attention_backend="gather")
    graphs = eng.runner.decode_graphs
    built = graphs.compilations
    assert len(graphs.widths) > 2 and len(graphs.batch_sizes) > 3
    graphs.compiled.frozen = False
    with torch.inference_mode():
        for batch, width in graphs.graphs:
            graphs._pad(0, batch)
            graphs._forward(batch, width)
    assert graphs.compilations == built


def test_traced_gguf_blocks_match_eager(gguf_blocks, traced_only):
    check_compiled_matches_eager(gguf_blocks, vocab=260, blocks=6)


def test_inductor_programs_match_eager_and_are_loaded_from_disk_next_time(gguf_blocks, tmp_path,
                                                                           monkeypatch):
    """Inductor itself, on the shipped path's kernels: torch's int4 op (Q4_1 blocks) and
    oneDNN's packed float kernel (Q8_0 rows), a custom op in the program; what it built lies
    in kvslim's compile folder, and the next engine of the model loads its programs from the
    caches there instead of building them."""
    from torch._dynamo.utils import counters
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("KVSLIM_HOME", str(tmp_path))
    # Two batch sizes, so two C++ programs: the build is the slow part, not what is checked.
    tight = check_compiled_matches_eager(gguf_blocks, vocab=260, blocks=6, max_num_seqs=2)
    folder = tmp_path / "compile" / cpu_compile.cache_folder_name()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    assert any(p.suffix == ".so" for p in folder.rglob("*"))      # the C++ builds
    again = engine(gguf_blocks, compile_decode=True, **tight)
    built = again.runner.decode_graphs.compilations
    assert built > 0 and counters["aot_autograd"]["autograd_cache_hit"] - hits == built


def test_no_compiler_runs_eagerly_with_a_note(hf_checkpoints, monkeypatch, capsys):
    monkeypatch.setattr(cpu_compile, "missing_compiler",
                        lambda device: "no C++ compiler found (g++, c++)")
    eng = engine(hf_checkpoints["gqa"], compile_decode=True)
    assert eng.runner.decode_graphs.compiled is None
    assert "no C++ compiler found (g++, c++): decode steps run eagerly" in capsys.readouterr().err
    want = tokens(run(engine(hf_checkpoints["gqa"]), workload(VOCAB), PARAMS))
    assert tokens(run(eng, workload(VOCAB), PARAMS)) == want


def test_what_builds_the_step_is_asked_of_the_device(monkeypatch):
    import torch.utils._triton as triton_probe
    from kvslim.kernels import extension
    monkeypatch.setattr(extension, "missing_compiler", lambda: "no C++ compiler found (g++)")
    assert cpu_compile.missing_compiler(torch.device("cpu")) == "no C++ compiler found (g++)"
    monkeypatch.setattr(triton_probe, "has_triton", lambda: False)
    assert cpu_compile.missing_compiler(torch.device("cuda")) == "no Triton for this GPU"
    monkeypatch.setattr(triton_probe, "has_triton", lambda: True)
    assert cpu_compile.missing_compiler(torch.device("cuda")) is None


def test_a_failing_build_runs_eagerly_with_a_note(hf_checkpoints, monkeypatch, capsys):
    def broken(gm, example_inputs):
        raise RuntimeError("g++: fatal error: killed")
    monkeypatch.setattr(cpu_compile, "BACKEND", broken)
    eng = engine(hf_checkpoints["gqa"], compile_decode=True)
    assert eng.runner.decode_graphs.compiled is None
    err = capsys.readouterr().err
    assert "decode step not compiled" in err and "g++: fatal error: killed" in err
    want = tokens(run(engine(hf_checkpoints["gqa"]), workload(VOCAB), PARAMS))
    assert tokens(run(eng, workload(VOCAB), PARAMS)) == want


def test_enforce_eager_never_compiles(hf_checkpoints):
    assert engine(hf_checkpoints["gqa"], compile_decode=True,
                  enforce_eager=True).runner.decode_graphs is None


def test_unwritable_cache_folder_compiles_into_a_fresh_one(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    blocker = tmp_path / "home"
    blocker.write_text("a file where the folder should be")
    monkeypatch.setenv("KVSLIM_HOME", str(blocker))
    folder = cpu_compile.use_compile_cache()
    assert folder.is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    err = capsys.readouterr().err
    assert f"compile cache {blocker / 'compile'} is not writable" in err and str(folder) in err


def test_cache_of_another_version_is_not_used(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("KVSLIM_HOME", str(tmp_path))
    (tmp_path / "compile" / "torch-2.0.0-kvslim-0.0.1").mkdir(parents=True)
    folder = cpu_compile.use_compile_cache()
    assert folder == tmp_path / "compile" / cpu_compile.cache_folder_name()
    assert ("compile cache of another torch/kvslim version (torch-2.0.0-kvslim-0.0.1) not "
            "used: compiling afresh") in capsys.readouterr().err
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    (folder / "entry").write_text("")
    cpu_compile.use_compile_cache()                 # its own cache now: nothing to say
    assert capsys.readouterr().err == ""


def test_a_user_chosen_cache_folder_stands(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert cpu_compile.use_compile_cache() is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
