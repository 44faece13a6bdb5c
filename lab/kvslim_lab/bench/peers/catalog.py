"""The engines `kvslim bench peers` can run, by name, and how each is built on the embedded
default model: its files (the float32 import, the shipped Q4_1 blocks, kvslim's W8A8 checkpoint
of the float32 import, llama.cpp's GGUF of each type, which kvslim-q4_0 runs too) are made when the engine starts, once, and
cached under $KVSLIM_HOME/peers."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvslim.errors import KvslimError
from kvslim.paths import kvslim_home

# name -> label; the families are the part before the dash.
ENGINES = {
    "kvslim-q4_1": "kvslim, shipped Q4_1 blocks, int8 activations (what LLM() runs)",
    "kvslim-q4_0": "kvslim on llama.cpp's Q4_0 file (the one llamacpp-q4_0 runs)",
    "kvslim-q4_1+compile": "kvslim, shipped Q4_1 blocks, compiled decode step (--compile)",
    "kvslim-q4_1+f32act": "kvslim, shipped Q4_1 blocks, float32 activations (the exact reference)",
    "kvslim-w8a8": "kvslim W8A8 (compressed-tensors)",
    "kvslim-f32": "kvslim float32",
    "llamacpp-q4_0": "llama.cpp Q4_0",
    "llamacpp-q4_1": "llama.cpp Q4_1",
    "llamacpp-q8_0": "llama.cpp Q8_0",
    "llamacpp-f32": "llama.cpp F32",
    "vllm-bf16": "vLLM CPU bf16",
    "vllm-w8a8": "vLLM CPU on kvslim's W8A8 checkpoint",
    "hf-f32": "HF transformers float32",
}


@dataclass
class PeerOptions:
    threads: int
    llamacpp_bin: Path
    vllm_python: Path | None = None
    vllm_eager: bool = False
    max_num_seqs: int = 64
    max_model_len: int = 512
    work_dir: Path | None = None             # default $KVSLIM_HOME/peers


def parse_engines(value: str | None) -> list[str]:
    """A comma list of engine names or families (kvslim, llamacpp, vllm, hf); empty: all."""
    out = []
    for part in [p.strip() for p in (value or "").split(",") if p.strip()]:
        names = [n for n in ENGINES if n == part or n.split("-")[0] == part]
        if not names:
            raise KvslimError(f"--engines: unknown engine {part!r}; choose from "
                              f"{', '.join(ENGINES)} or a family (kvslim, llamacpp, vllm, hf)")
        out += [n for n in names if n not in out]
    return out or list(ENGINES)


@cache
def float_dir() -> Path:
    from kvslim.formats.registry import default_model_dir
    return default_model_dir(show_progress=False, quantized=False)


@cache
def shipped_dir() -> Path:
    from kvslim.formats.registry import default_model_dir
    return default_model_dir(show_progress=False, quantized=True)


def w8a8_dir(work_dir: Path) -> Path:
    """`kvslim quantize --method w8a8` of the float32 import (no calibration), made once."""
    out = work_dir / f"{float_dir().name}-w8a8"
    if not out.is_dir():                             # written beside, renamed when whole
        import shutil

        from kvslim.quantization.w8a8 import W8A8_SPEC
        from kvslim.surgery.quantize.model import quantize_model
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        quantize_model(float_dir(), tmp, "w8a8", W8A8_SPEC, show_progress=False).rename(out)
    return out


def f32_gguf() -> Path:
    from kvslim_lab.bench.runners import exported_gguf
    return exported_gguf(float_dir(), "f32")


def llamacpp_file(tools, kind: str, work: Path) -> Path:
    """The quantized import of llama.cpp's own file of `kind` (its blocks, not the float import
    an explicit dtype would pick): kvslim runs the very blocks llama.cpp runs."""
    from kvslim_lab.bench.peers.llamacpp import gguf_file
    from kvslim_lab.bench.peers.suite import Unavailable
    from kvslim.formats.registry import resolve_model
    missing = tools.missing()
    if missing:
        raise Unavailable(missing)
    return resolve_model(gguf_file(tools, kind, f32_gguf(), work / "gguf"), show_progress=False,
                         quantized=True)


def work_dir(opts: PeerOptions) -> Path:
    return Path(opts.work_dir or kvslim_home() / "peers")


def build(names: list[str], opts: PeerOptions) -> list:
    """The engines named, not started (starting loads models and makes files)."""
    from kvslim_lab.bench.llamacpp_tools import LlamaCppTools
    from kvslim_lab.bench.peers.llamacpp import LlamaCppEngine
    from kvslim_lab.bench.peers.local import HFEngine, KvslimEngine
    from kvslim_lab.bench.peers.vllm_peer import VllmEngine
    work = work_dir(opts)
    tools = LlamaCppTools(Path(opts.llamacpp_bin), opts.threads)
    dirs = {"q4_1": shipped_dir, "f32": float_dir, "bf16": float_dir,
            "w8a8": lambda: w8a8_dir(work),
            "q4_0": lambda: llamacpp_file(tools, "q4_0", work)}
    engines = []
    for name in names:
        family, kind = name.split("-", 1)
        if family == "kvslim":
            kind, _, variant = kind.partition("+")
            engines.append(KvslimEngine(name, ENGINES[name], dirs[kind],
                                        max_num_seqs=opts.max_num_seqs,
                                        compile_decode=variant == "compile",
                                        linear_activations="float32" if variant == "f32act"
                                        else None))
        elif family == "llamacpp":
            engines.append(LlamaCppEngine(kind, ENGINES[name], tools, f32_gguf,
                                          work / "gguf"))
        elif family == "vllm":
            engines.append(VllmEngine(name, ENGINES[name], opts.vllm_python, dirs[kind],
                                      opts.threads, work / "logs", max_num_seqs=opts.max_num_seqs,
                                      max_model_len=opts.max_model_len,
                                      enforce_eager=opts.vllm_eager))
        else:
            engines.append(HFEngine(ENGINES[name], float_dir))
    return engines


def prompts(plan, model_dir: Path | None = None) -> dict[str, list[list[int]]]:
    """The token ids every engine gets: random ids of the vocabulary of `model_dir` (default:
    the default model), special tokens left out (bench/workload.py)."""
    from kvslim_lab.bench.workload import special_ids
    from kvslim.models.config import ModelConfig
    from kvslim.tokenizer.tokenizer import Tokenizer
    model_dir = model_dir or float_dir()
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    avoid = special_ids(Tokenizer.from_dir(model_dir))
    out = {"decode": plan.decode.prompts(vocab, avoid)}
    if plan.offline is not None:
        out["offline"] = plan.offline.prompts(vocab, avoid)
    return out
