"""`kvslim experiment prune`: for each model (the reference MHA model, SmolLM2-135M), every arm
of `arms.plan` built once under WORK_DIR and measured: test perplexity, bytes on disk (all and
the decoder's linears), the zeros actually stored, the build's wall time; and batch-1 decode
of the arms that name it, measured together. Each finished arm is recorded in RESULTS, so a rerun skips it; the report
(docs/pruning.md, .json, a plot) is written from those records by `report.py`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvslim.errors import KvslimError
from kvslim_lab.experiments.prune.arms import DENSE, Arm, arm_name, build, plan
from kvslim_lab.experiments.records_file import load_records, save_records
from kvslim_lab.experiments.sources import float_model_source, model_key

RESULTS = "results.json"


@dataclass
class PruneExperimentConfig:
    models: list[str] = field(default_factory=lambda: ["models/ref-mha", "smollm2"])
    methods: list[str] = field(default_factory=lambda: ["magnitude", "wanda", "sparsegpt"])
    targets: list[str] = field(default_factory=lambda: ["0.1", "0.3", "0.5", "0.7", "2:4",
                                                        "4:8"])
    quantized_targets: list[str] = field(default_factory=lambda: ["0.5", "2:4"])
    bits: int = 4
    group_size: int = 64                   # divides both models' inputs (704, 576, 1536)
    calib: str = "../shared/corpus/train.txt"
    test: str = "../shared/corpus/test.txt"
    work_dir: str = "runs/prune-study"
    report: str = "docs/pruning.md"
    calib_samples: int = 32
    calib_seq_len: int = 256
    ppl_context: int = 256
    ppl_stride: int = 256
    ppl_max_tokens: int | None = 16384
    recover: list[str] = field(default_factory=lambda: ["sparsegpt-s50",
                                                        "sparsegpt-2of4"])
    recover_models: list[str] = field(default_factory=lambda: ["ref-mha"])
    recovery_tokens: int = 500_000
    recovery_batch_size: int = 16
    recovery_seq_len: int = 256
    recovery_lr: float = 2e-4             # the GQA study's uptraining peak
    decode_input_len: int = 128
    decode_output_len: int = 64
    decode_repeats: int = 7
    show_progress: bool = True

    def decode_arms(self) -> list[str]:
        return ["dense", "dense-w4", arm_name("sparsegpt", "0.5", None),
                arm_name("sparsegpt", "2:4", None), arm_name("sparsegpt", "2:4", self.bits)]


@dataclass
class ArmResult:
    model: str
    arm: str
    status: str                 # done | failed
    reason: str = ""
    seconds: float = 0.0
    numbers: dict = field(default_factory=dict)


class PruneExperiment:
    def __init__(self, cfg: PruneExperimentConfig):
        check_config(cfg)
        self.cfg = cfg
        self.work = Path(cfg.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, ArmResult] = self._load()

    def arms(self, model: str) -> list[Arm]:
        c = self.cfg
        recover = c.recover if model in c.recover_models else []
        return plan(c.methods, c.targets, c.quantized_targets, c.bits, recover, c.decode_arms())

    def model_keys(self) -> list[str]:
        return [model_key(m) for m in self.cfg.models]

    def _load(self) -> dict[str, ArmResult]:
        return load_records(self.work / RESULTS, ArmResult)

    def _save(self, result: ArmResult) -> None:
        self.results[f"{result.model}/{result.arm}"] = result
        save_records(self.work / RESULTS, self.results)

    def run(self) -> None:
        for model in self.cfg.models:
            key = model_key(model)
            todo = [a for a in self.arms(key)
                    if getattr(self.results.get(f"{key}/{a.name}"), "status", "") != "done"]
            if todo:
                source, _ = float_model_source(model, self.work, self.cfg.show_progress)
            bar = tqdm(todo, desc=key, unit="arm", disable=not self.cfg.show_progress)
            for arm in bar:
                bar.set_postfix_str(arm.name)
                result = self._run_arm(key, arm, source)
                self._save(result)
                if self.cfg.show_progress:
                    tqdm.write(f"[prune] {key}/{arm.name}: "
                               f"{result.numbers.get('ppl', result.reason)} "
                               f"({result.seconds:.0f} s)")
            self._backfill(key)
            self._measure_decode(key)

    def _done(self, key: str) -> list[tuple[Arm, ArmResult]]:
        return [(a, r) for a in self.arms(key)
                if (r := self.results.get(f"{key}/{a.name}")) is not None and r.status == "done"]

    def _model_dir(self, key: str, arm: Arm) -> Path:
        model_dir = self.work / key / arm.name
        if (model_dir / "config.json").is_file():
            return model_dir
        return float_model_source(self.cfg.models[self.model_keys().index(key)],
                                  self.work, False)[0]

    def _backfill(self, key: str) -> None:
        """A number added to the study after some arms were recorded, measured on those arms:
        a float pruned arm's bytes as a compressed-tensors checkpoint."""
        for arm, r in self._done(key):
            sparse_float = arm.method is not None and arm.bits is None
            if sparse_float and "sparse_linear_bytes" not in r.numbers:
                r.numbers.update(compressed_tensors_bytes(self._model_dir(key, arm), arm))
                self._save(r)

    def _measure_decode(self, key: str) -> None:
        """Batch-1 decode of the model's decode arms, all in one run taking turns (their ratios
        are the point), whenever one of them lacks it: a rerun after deleting one arm's
        `decode_tokens_per_s` re-measures them all."""
        arms = [(a, r) for a, r in self._done(key) if a.decode]
        if not arms or all("decode_tokens_per_s" in r.numbers for _, r in arms):
            return
        from kvslim_lab.bench.latency import models_decode_speed
        c = self.cfg
        speeds = models_decode_speed({a.name: self._model_dir(key, a) for a, _ in arms},
                                     c.decode_input_len, c.decode_output_len, c.decode_repeats)
        for arm, r in arms:
            r.numbers["decode_tokens_per_s"] = speeds[arm.name]
            self._save(r)

    def _run_arm(self, key: str, arm: Arm, source: Path) -> ArmResult:
        start = time.time()
        result = ArmResult(key, arm.name, "done")
        try:
            out = self.work / key / arm.name
            model_dir = (out if (out / "config.json").is_file()
                         else build(arm, source, out, self.cfg,
                                    lambda name: self.work / key / name))
            built = time.time() - start
            result.numbers = {"build_seconds": round(built, 1),
                              **measure(arm, model_dir, self.cfg)}
            if arm.method is not None and arm.bits is None:
                result.numbers.update(compressed_tensors_bytes(model_dir, arm))
        except Exception as e:                       # one arm's failure must not stop the rest
            result.status, result.reason = "failed", f"{type(e).__name__}: {e}"
        result.seconds = round(time.time() - start, 1)
        return result


def check_config(cfg: PruneExperimentConfig) -> None:
    """Bad settings refused in one line before anything is built."""
    from kvslim.surgery.prune.masks import SparsityTarget
    from kvslim.surgery.prune.model import METHODS
    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown or not cfg.methods:
        raise KvslimError(f"unknown --methods {', '.join(unknown) or '(none)'}; choose from "
                          f"{', '.join(METHODS)}")
    for t in cfg.targets + cfg.quantized_targets:
        try:
            SparsityTarget.parse(None if ":" in t else float(t), t if ":" in t else None)
        except ValueError:
            raise KvslimError(f"a target is a fraction in (0, 1) or N:M, got {t!r}") from None
    names = {a.name for a in plan(cfg.methods, cfg.targets, cfg.quantized_targets, cfg.bits,
                                  [], [])}
    missing = [r for r in cfg.recover if r not in names or "-w" in r]
    if missing:
        raise KvslimError(f"--recover names arms not pruned in float here: {', '.join(missing)} "
                          f"(e.g. {arm_name(cfg.methods[-1], cfg.targets[0], None)})")


def measure(arm: Arm, model_dir: Path, cfg: PruneExperimentConfig) -> dict:
    """Perplexity (`kvslim ppl`'s), bytes on disk, the linears' stored zeros."""
    from kvslim.eval.perplexity import file_perplexity
    from kvslim.formats.weight_bytes import stored_weight_bytes
    r = file_perplexity(model_dir, cfg.test, cfg.ppl_context, cfg.ppl_stride, cfg.ppl_max_tokens,
                        show_progress=False)
    wb = stored_weight_bytes(model_dir)
    out = {"ppl": round(r.perplexity, 4), "ppl_tokens": r.num_tokens, "weight_bytes": wb.total,
           "linear_bytes": wb.linear}
    if arm.bits is None:
        out["linear_zeros"] = round(linear_zero_fraction(model_dir), 4)
    if arm.name == DENSE:
        from kvslim.models.config import ModelConfig
        from kvslim.dtypes import parse_dtype
        size = parse_dtype(ModelConfig.from_dir(model_dir).torch_dtype).itemsize
        out["linear_bf16_bytes"] = wb.linear // size * 2
    return out


def linear_zero_fraction(model_dir: Path) -> float:
    """The fraction of the decoder linears' stored weights that are exactly zero."""
    from safetensors import safe_open

    from kvslim.formats.loader import weight_files
    from kvslim.formats.weight_bytes import is_linear_tensor
    zeros = total = 0
    for path in weight_files(model_dir):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if is_linear_tensor(name) and name.endswith(".weight"):
                    w = f.get_tensor(name)
                    zeros, total = zeros + int((w == 0).sum()), total + w.numel()
    return zeros / max(1, total)


def compressed_tensors_bytes(model_dir: Path, arm: Arm) -> dict:
    """The arm's weights written as `kvslim prune --format compressed-tensors` writes them
    (sparse-24-bitmask for 2:4, sparse-bitmask otherwise; values in the stored dtype), measured
    on disk and removed."""
    import shutil
    import tempfile

    import torch

    from kvslim.formats.compressed_tensors_sparse import sparse_checkpoint
    from kvslim.formats.loader import load_model
    from kvslim.formats.weight_bytes import stored_weight_bytes
    from kvslim.formats.writer import save_model
    from kvslim.models.config import ModelConfig
    from kvslim.dtypes import parse_dtype
    config = ModelConfig.from_dir(model_dir)
    dtype = parse_dtype(config.torch_dtype)
    model = load_model(model_dir, dtype=torch.float32)
    state = {k: v.detach().to(dtype) for k, v in model.hf_state_dict().items()}
    state, qcfg = sparse_checkpoint(state, None, arm.target if ":" in arm.target
                                    else "unstructured", config.pruning["sparsity"])
    tmp = Path(tempfile.mkdtemp(prefix="kvslim-sparse-"))
    try:
        save_model(state, config.replace(raw={**config.raw, "quantization_config": qcfg}), tmp)
        wb = stored_weight_bytes(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"sparse_weight_bytes": wb.total, "sparse_linear_bytes": wb.linear}
