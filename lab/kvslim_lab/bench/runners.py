"""Building each engine of a comparison the same way: kvslim's LLM, HF, llama.cpp."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvslim.engine.config import EngineConfig
from kvslim.engine.llm import LLM
from kvslim.errors import KvslimError
from kvslim.paths import kvslim_home

ENGINES = ("kvslim", "hf", "llamacpp")


def parse_compare(value: str | None) -> list[str]:
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    bad = [n for n in names if n not in ENGINES[1:]]
    if bad:
        raise KvslimError(f"--compare: unknown engine {bad[0]!r}; choose from hf, llamacpp")
    return names


def kvslim_llm(model_dir, kv_cache_memory="1GiB", max_num_seqs: int = 256,
               max_num_batched_tokens: int = 2048, dtype: str = "float32",
               kv_cache_dtype: str = "auto", speculative: dict | None = None,
               linear_activations: str | None = None, **parallel) -> LLM:
    """`parallel`: LLM's tensor-parallel options (tensor_parallel_size, ...), and
    compile_decode. `linear_activations` None: the engine's default."""
    return LLM(str(model_dir), dtype=dtype, device="cpu", kv_cache_memory=kv_cache_memory,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
               enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype,
               speculative=speculative,
               linear_activations=linear_activations or EngineConfig.linear_activations,
               **parallel)


def exported_gguf(model_dir: Path, dtype: str = "f32") -> Path:
    """The model exported by `kvslim export-gguf`, cached by weights' identity."""
    from kvslim.formats.gguf.exporter import export_gguf
    weights = sorted(Path(model_dir).glob("*.safetensors"))
    key = hashlib.sha256("|".join(f"{w.resolve()}:{w.stat().st_size}:{w.stat().st_mtime_ns}"
                                  for w in weights).encode()).hexdigest()[:16]
    out = kvslim_home() / "gguf-export" / f"{Path(model_dir).name}-{key}-{dtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        export_gguf(model_dir, out, dtype=dtype)
    return out


def peers(names: list[str], model_dir: Path, skipped: list[str], show_progress: bool):
    """(name, runner) for each peer that can run here; the others are noted in `skipped`."""
    for name in names:
        runner = peer(name, model_dir, torch.get_num_threads())
        if runner is None:
            skipped.append(f"{name}: llama-cpp-python is not installed")
            continue
        if show_progress:
            print(f"[bench] {runner.label} ...", flush=True)
        yield name, runner


def peer(name: str, model_dir: Path, threads: int):
    if name == "hf":
        from kvslim_lab.bench.peer_hf import HFPeer
        return HFPeer(model_dir, torch.float32)
    from kvslim_lab.bench.peer_llamacpp import LlamaCppPeer, available
    if not available():
        return None
    return LlamaCppPeer(exported_gguf(model_dir, "f32"), threads)
