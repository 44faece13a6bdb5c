"""The arms of `kvslim experiment quant`, as a table: each names how its model is built (a function,
or `kvslim` CLI arguments for a method that may not exist in this build) and what is measured on
it. An arm that cannot be built says why — "not possible" (this model cannot take it, e.g. a group
size that does not divide its features) or "not run" (a method or tool missing here) — and the
report prints the reason; adding a mode is one more row."""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvslim.errors import KvslimError
from kvslim.quantization import QuantSpec
from kvslim.models.config import ModelConfig

# What an arm measures (measure.py does each).
PPL, BYTES, DECODE, THROUGHPUT = "ppl", "bytes", "decode", "throughput"
KV_PPL, CAPACITY = "kv_ppl", "capacity"
LLAMA, HF = "llamacpp", "hf"
KVSLIM_MEASURES = (PPL, BYTES, DECODE, THROUGHPUT)


class NotPossible(Exception):
    """The model cannot take this arm (the reason is the message)."""


class NotAvailable(Exception):
    """This build or machine lacks what the arm needs (the reason is the message)."""


@dataclass
class ModelSource:
    """One model of the experiment: its float32 directory and, for a model shipped as GGUF, that
    file (its arm keeps the file's blocks)."""
    key: str
    float_dir: Path
    shipped_gguf: Path | None = None


@dataclass
class Ctx:
    """What a build needs: the model, where to write, the settings and llama.cpp's tools."""
    model: ModelSource
    out: Path
    cfg: object                    # QuantExperimentConfig
    peer_gguf: Callable[[str], Path]   # llama.cpp's file of a type: "f32", "q8_0", "q4_1", ...


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    kind: str                      # float | int8 | 4bit | w8a8 | kv | peer
    engine: str                    # kvslim | llama.cpp | hf
    build: Callable[[Ctx], Path] | tuple[str, ...]
    measures: tuple[str, ...] = KVSLIM_MEASURES
    kv_cache_dtype: str = "auto"
    group_size: int | None = None
    method: str | None = None
    extra: dict = field(default_factory=dict, hash=False, compare=False)


def float_model(ctx: Ctx) -> Path:
    return ctx.model.float_dir


def quantized(method: str, bits: int, group_size: int, act_order: bool = False):
    """A build that runs `quantize_model` (RTN, GPTQ, AWQ) with the experiment's calibration."""
    def build(ctx: Ctx) -> Path:
        from kvslim.surgery.quantize.model import check_options, quantize_model
        cfg = ctx.cfg
        spec = QuantSpec(bits, group_size, act_order, cfg.sym, "gptq" if cfg.sym else "gptq_v2")
        calib = cfg.calib if method in ("gptq", "awq") else None
        try:
            check_options(ModelConfig.from_dir(ctx.model.float_dir), method, spec, calib)
        except KvslimError as e:
            raise NotPossible(str(e)) from None
        tmp = _fresh(ctx.out)
        quantize_model(ctx.model.float_dir, tmp, method, spec, calib, cfg.calib_samples,
                       cfg.calib_seq_len, show_progress=cfg.show_progress)
        return tmp.rename(ctx.out)
    return build


def gguf_kept(kind: str):
    """`kvslim import-gguf` keeping the file's blocks: the shipped file for a model shipped as
    GGUF and kind "shipped", else llama.cpp's `kind` file of the float model."""
    def build(ctx: Ctx) -> Path:
        from kvslim.formats.gguf.importer import import_gguf
        source = ctx.model.shipped_gguf if kind == "shipped" else ctx.peer_gguf(kind)
        if source is None:
            raise NotPossible("the model is not shipped as a GGUF file")
        tmp = _fresh(ctx.out)
        import_gguf(source, tmp, show_progress=False, keep_quantized=True)
        if ModelConfig.from_dir(tmp).quantization is None:
            shutil.rmtree(tmp)
            raise NotAvailable(f"kvslim import-gguf does not keep {source.name}'s linear layers "
                               "quantized in this build (it imports them as float32)")
        return tmp.rename(ctx.out)
    return build


def cli_build(ctx: Ctx, argv: tuple[str, ...]) -> Path:
    """Run `kvslim ARGV` (placeholders {src} {dst} {calib} {calib_samples} {seq_len}); a
    refusal (exit 2: unknown method, bad option) means the arm is not available here."""
    cfg = ctx.cfg
    tmp = _fresh(ctx.out)
    args = [a.format(src=ctx.model.float_dir, dst=tmp, calib=cfg.calib,
                     calib_samples=cfg.calib_samples, seq_len=cfg.calib_seq_len) for a in argv]
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", *args], capture_output=True,
                       text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        shutil.rmtree(tmp, ignore_errors=True)
        if r.returncode == 2:
            raise NotAvailable(last)
        raise KvslimError(f"kvslim {argv[0]} failed: {last}")
    return tmp.rename(ctx.out)


def peer_file(kind: str):
    def build(ctx: Ctx) -> Path:
        if kind == "shipped":
            if ctx.model.shipped_gguf is None:
                raise NotPossible("the model is not shipped as a GGUF file")
            return ctx.model.shipped_gguf
        return ctx.peer_gguf(kind)
    return build


def _fresh(out: Path) -> Path:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def plan(group_sizes: list[int]) -> list[Arm]:
    """Every arm, in the order they run (each kvslim arm's model is built once, then cached)."""
    arms = [Arm("float32", "float32", "float", "kvslim", float_model),
            Arm("kv-int8", "float32, int8 KV cache", "kv", "kvslim", float_model,
                (KV_PPL, BYTES, DECODE, THROUGHPUT, CAPACITY), kv_cache_dtype="int8"),
            Arm("int8", "int8 weights (per channel)", "int8", "kvslim",
                quantized("rtn", 8, -1), method="rtn")]
    for g in group_sizes:
        arms += [Arm(f"rtn-4-g{g}", f"RTN-4 g{g}", "4bit", "kvslim", quantized("rtn", 4, g),
                     group_size=g, method="rtn"),
                 Arm(f"gptq-4-g{g}", f"GPTQ-4 g{g}", "4bit", "kvslim", quantized("gptq", 4, g),
                     group_size=g, method="gptq"),
                 Arm(f"awq-4-g{g}", f"AWQ-4 g{g}", "4bit", "kvslim", quantized("awq", 4, g),
                     group_size=g, method="awq"),
                 Arm(f"gptq-4-g{g}-act", f"GPTQ-4 g{g} act-order", "4bit", "kvslim",
                     quantized("gptq", 4, g, act_order=True), group_size=g, method="gptq")]
    arms += [
        Arm("w8a8", "W8A8 (int8 weights and activations)", "w8a8", "kvslim",
            ("quantize", "{src}", "{dst}", "--method", "w8a8", "--quiet")),
        Arm("w8a8-sq", "W8A8, SmoothQuant alpha 0.5", "w8a8", "kvslim",
            ("quantize", "{src}", "{dst}", "--method", "w8a8", "--smooth-alpha", "0.5",
             "--calib", "{calib}", "--calib-samples", "{calib_samples}", "--seq-len",
             "{seq_len}", "--quiet")),
        Arm("gguf-shipped", "GGUF file kept quantized (shipped file)", "4bit", "kvslim",
            gguf_kept("shipped")),
        Arm("gguf-q4_1", "GGUF Q4_1 kept quantized (llama-quantize)", "4bit", "kvslim",
            gguf_kept("q4_1")),
        Arm("gguf-q8_0", "GGUF Q8_0 kept quantized (llama-quantize)", "int8", "kvslim",
            gguf_kept("q8_0")),
    ]
    arms += [Arm(f"llamacpp-{k}", f"llama.cpp {k}", "peer", "llama.cpp", peer_file(k), (LLAMA,))
             for k in ("f32", "q8_0", "q4_0", "q4_1", "shipped")]
    arms.append(Arm("hf", "HF transformers, float32", "peer", "hf", float_model, (HF,)))
    return arms
