"""`kvslim experiment quant`: every quantization mode beside its peers, one command.

For each model (the reference MHA model, SmolLM2-135M), every arm of `arms.plan` — float32,
int8 weights, RTN / GPTQ / AWQ 4-bit at each group size, GPTQ act-order, W8A8, the int8 KV cache,
GGUF files kept quantized — is built once under WORK_DIR and measured: test perplexity, weight
bytes, KV bytes per token, batch-1 decode and offline throughput; beside llama.cpp's own q8_0 /
q4_0 / q4_1 files (its tools: batch-1 decode, parallel decoding, perplexity) and HF transformers
at its best batch size. Each finished arm is recorded in RESULTS, so a rerun skips it; the report
(docs/quantization.md, .json, a plot) is written from those records by `report.py`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvslim_lab.bench.workload import Workload
from kvslim.errors import KvslimError
from kvslim_lab.experiments.quant.arms import (Arm, Ctx, ModelSource, NotAvailable, NotPossible,
                                           cli_build, plan)
from kvslim_lab.bench.llamacpp_tools import DEFAULT_BIN, LlamaCppTools
from kvslim_lab.experiments.quant.measure import measure
from kvslim_lab.experiments.records_file import load_records, save_records
from kvslim_lab.experiments.sources import float_model_source
from kvslim_lab.experiments.sources import model_key as _model_key

RESULTS = "results.json"


@dataclass
class QuantExperimentConfig:
    models: list[str] = field(default_factory=lambda: ["models/ref-mha", "smollm2"])
    calib: str = "../shared/corpus/train.txt"
    test: str = "../shared/corpus/test.txt"
    work_dir: str = "runs/quant"
    report: str = "docs/quantization.md"
    arms: list[str] | None = None          # a subset of the plan's names; None: all
    group_sizes: list[int] = field(default_factory=lambda: [32, 128])
    sym: bool = True
    calib_samples: int = 32
    calib_seq_len: int = 256
    ppl_context: int = 256
    ppl_stride: int = 256
    ppl_max_tokens: int | None = 8192
    num_prompts: int = 64                  # offline throughput: prompts x input / output tokens
    input_len: int = 128
    output_len: int = 128
    decode_input_len: int = 128            # batch-1 decode: prompt, generated tokens, repeats
    decode_output_len: int = 64
    decode_repeats: int = 3
    hf_batch_sizes: list[int] = field(default_factory=lambda: [8, 32])
    llamacpp_bin: str | None = DEFAULT_BIN  # None: the llama.cpp arms are not run
    llamacpp_parallel: list[int] = field(default_factory=lambda: [4, 16, 64])
    capacity_kv_memory: str = "64MiB"
    capacity_context: int = 256
    show_progress: bool = True

    def workload(self) -> Workload:
        return Workload(self.num_prompts, self.input_len, self.output_len, seed=0)


@dataclass
class ArmResult:
    model: str
    arm: str
    label: str
    kind: str
    engine: str
    status: str                 # done | not possible | not run | failed
    reason: str = ""
    group_size: int | None = None
    method: str | None = None
    seconds: float = 0.0
    numbers: dict = field(default_factory=dict)


class QuantExperiment:
    def __init__(self, cfg: QuantExperimentConfig):
        self.cfg = cfg
        self.work = Path(cfg.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.arms = [a for a in plan(cfg.group_sizes) if cfg.arms is None or a.name in cfg.arms]
        unknown = set(cfg.arms or []) - {a.name for a in plan(cfg.group_sizes)}
        if unknown:
            raise KvslimError(f"unknown arm(s) {', '.join(sorted(unknown))}; choose from "
                              f"{', '.join(a.name for a in plan(cfg.group_sizes))}")
        self.tools = LlamaCppTools(Path(cfg.llamacpp_bin), torch.get_num_threads()) \
            if cfg.llamacpp_bin else None
        self.results: dict[str, ArmResult] = self._load()
        self.current: ModelSource | None = None
        self._same_windows: dict[str, float] = {}
        self._bandwidth = None

    def _load(self) -> dict[str, ArmResult]:
        return load_records(self.work / RESULTS, ArmResult)

    def _save(self, result: ArmResult) -> None:
        self.results[f"{result.model}/{result.arm}"] = result
        save_records(self.work / RESULTS, self.results)

    def model_keys(self) -> list[str]:
        return [_model_key(m) for m in self.cfg.models]

    # ---- running -------------------------------------------------------------------------
    def run(self) -> None:
        for model in self.cfg.models:
            todo = [a for a in self.arms if not self._finished(_model_key(model), a)]
            if not todo:
                continue
            self.current = self._source(model)
            bar = tqdm(todo, desc=self.current.key, unit="arm", disable=not self.cfg.show_progress)
            for arm in bar:
                bar.set_postfix_str(arm.name)
                result = self._run_arm(arm)
                self._save(result)
                if self.cfg.show_progress:
                    tqdm.write(f"[quant] {result.model}/{arm.name}: {_summary(result)} "
                               f"({result.seconds:.0f} s)")

    def _finished(self, model_key: str, arm: Arm) -> bool:
        r = self.results.get(f"{model_key}/{arm.name}")
        return r is not None and r.status in ("done", "not possible")

    def _run_arm(self, arm: Arm) -> ArmResult:
        model = self.current
        result = ArmResult(model.key, arm.name, arm.label, arm.kind, arm.engine, "done",
                           group_size=arm.group_size, method=arm.method)
        start = time.time()
        out = self.work / model.key / arm.name
        ctx = Ctx(model, out, self.cfg, self.peer_gguf)
        try:
            if (out / "config.json").is_file():
                model_dir = out                          # built by an earlier run
            elif callable(arm.build):
                model_dir = arm.build(ctx)
            else:
                model_dir = cli_build(ctx, arm.build)
            result.numbers = measure(arm, Path(model_dir), self)
        except NotPossible as e:
            result.status, result.reason = "not possible", str(e)
        except NotAvailable as e:
            result.status, result.reason = "not run", str(e)
        except Exception as e:                       # one arm's failure must not stop the rest
            result.status, result.reason = "failed", f"{type(e).__name__}: {e}"
        result.seconds = round(time.time() - start, 1)
        return result

    def _source(self, model: str) -> ModelSource:
        """A directory is taken as it is; "smollm2" is the embedded model's GGUF and a .gguf
        path a file: both imported to float32 once (their arm "gguf-shipped" keeps the file)."""
        float_dir, gguf = float_model_source(model, self.work, self.cfg.show_progress)
        return ModelSource(_model_key(model), float_dir, gguf)

    # ---- llama.cpp -----------------------------------------------------------------------
    def peer_gguf(self, kind: str) -> Path:
        """llama.cpp's file of the current model: `kvslim export-gguf` (f32), then
        `llama-quantize` for every other type."""
        if self.tools is None:
            raise NotAvailable("llama.cpp peers disabled (--llamacpp-bin '')")
        if self.tools.missing():
            raise NotAvailable(self.tools.missing())
        base = self.work / self.current.key
        f32 = base / "llamacpp-f32.gguf"
        if not f32.is_file():
            from kvslim.formats.gguf.exporter import export_gguf
            export_gguf(self.current.float_dir, base / "llamacpp-f32.tmp.gguf", "f32",
                        show_progress=False).replace(f32)
        return f32 if kind == "f32" else self.tools.quantize(f32, base / f"llamacpp-{kind}.gguf",
                                                             kind)

    def llamacpp_ppl(self, gguf: Path) -> dict:
        """llama-perplexity on windows kvslim can reproduce exactly: `ppl_context` tokens every
        `ppl_context - 1` (its strided mode cannot step a whole window), and kvslim's float32 on
        the same windows, so that llama.cpp's numbers compare with its own f32 and with
        kvslim's."""
        cfg, ctx = self.cfg, self.cfg.ppl_context
        stride = ctx - 1
        windows = max(1, ((cfg.ppl_max_tokens or 10**9) - ctx) // stride + 1)
        ppl, file_tokens = self.tools.perplexity(gguf, Path(cfg.test), ctx, stride, windows)
        key = self.current.key
        if key not in self._same_windows:
            from kvslim.eval.perplexity import file_perplexity
            r = file_perplexity(self.current.float_dir, cfg.test, ctx, stride,
                                ctx + (windows - 1) * stride, show_progress=False)
            self._same_windows[key] = round(r.perplexity, 4)
        return {"ppl": round(ppl, 4), "ppl_tokens": windows * stride,
                "ppl_windows": f"{windows} x {ctx} tokens, stride {stride}",
                "file_tokens_llamacpp": file_tokens,
                "file_tokens_kvslim": len(self.test_tokens(self.current.float_dir)),
                "kvslim_float_ppl_same_windows": self._same_windows[key]}

    def bandwidth(self):
        """The machine's memory bandwidth, measured once (`bench latency` reports against it)."""
        if self._bandwidth is None:
            from kvslim_lab.bench.machine import memory_bandwidth
            self._bandwidth = memory_bandwidth()
        return self._bandwidth

    def test_tokens(self, model_dir: Path):
        from kvslim.tokenizer.tokenizer import Tokenizer
        from kvslim.train.data import tokenize_file
        return tokenize_file(self.cfg.test, Tokenizer.from_dir(model_dir), show_progress=False)


def _summary(r: ArmResult) -> str:
    if r.status != "done":
        return f"{r.status}: {r.reason}"
    n = r.numbers
    parts = [f"ppl {n['ppl']:.3f}" if "ppl" in n else "",
             f"{n['decode_tokens_per_s']:.1f} tok/s batch 1" if "decode_tokens_per_s" in n else "",
             f"{n['throughput_tokens_per_s']:.1f} tok/s offline"
             if "throughput_tokens_per_s" in n else ""]
    return ", ".join(p for p in parts if p)
