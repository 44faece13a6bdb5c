"""`kvslim experiment gqa`: the GQA paper's uptraining experiment at small scale, one command.

On the reference MHA model: every target KV-head count x conversion method x uptraining fraction
alpha (of the original training steps), plus the fair control (the MHA model trained for the same
extra steps), scored by test-set perplexity. Then the real pretrained model, SmolLM2-135M
(9 query / 3 KV heads), converted to MQA by mean pooling and by `align`, before and after a short
uptraining. MLA arms (`mla_arms.py`) convert the same models to DeepSeek's latent attention at
the KV bytes of a GQA arm, whose decode speed they are timed against (`decode.py`). Every finished
run is recorded in RESULTS so that an interrupted experiment resumes where it stopped; the report
(docs/gqa-uptraining.md + plots) is written from those records."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvslim.errors import KvslimError
from kvslim_lab.experiments.gqa.decode import ARMS as DECODE_ARMS
from kvslim_lab.experiments.gqa.decode import DecodeResult, decode_name, is_decode, measure_decode
from kvslim_lab.experiments.gqa.mla_arms import CONVERSION_ONLY, convert_mla_arm, is_mla
from kvslim.models.config import ModelConfig
from kvslim.surgery.convert import convert_to_budget, convert_to_gqa
from kvslim.eval.perplexity import file_perplexity
from kvslim.train.train_config import TrainConfig
from kvslim.train.trainer import train

RESULTS = "results.json"
# Arms: a conversion (`kvslim convert --method`; "-nu": per-layer KV heads chosen by measured
# sensitivity within the KV bytes of the uniform count, `convert --kv-budget`), "-kd" for
# uptraining by distillation from the unconverted model; "mla*": latent attention at the same KV
# bytes (mla_arms.py).
METHODS = ("mean", "first", "random", "align", "align-kd", "align-nu", "align-nu-kd", "mla",
           "mla-kd", "mla-mha2mla")
SMOLLM2_KV_HEADS = 3


def conversion_of(method: str) -> str:
    return method.removesuffix("-kd")


def distills(method: str) -> bool:
    return method.endswith("-kd")


def is_nonuniform(method: str) -> bool:
    return conversion_of(method).endswith("-nu")


@dataclass
class ExperimentConfig:
    model: str                           # the reference MHA model directory
    train: str
    valid: str
    test: str
    work_dir: str = "runs/gqa"
    report: str = "docs/gqa-uptraining.md"
    original_steps: int | None = None    # default: the last step in MODEL/train_log.jsonl
    kv_heads: list[int] | None = None    # default: H/2, H/4, 1
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    alphas: list[float] = field(default_factory=lambda: [0.0, 0.05])    # every method
    extra_alphas: list[float] = field(default_factory=lambda: [0.10])   # extra_methods only
    extra_methods: list[str] = field(default_factory=lambda: ["mean", "align", "align-kd"])
    # align-kd: uptrained by distillation from the unconverted model (train/distill.py)
    distill_temperature: float = 2.0
    distill_weight: float = 0.5
    attention_weight: float = 1.0        # per-layer attention-output matching; 0: logits only
    batch_size: int = 16
    seq_len: int = 256
    uptrain_lr: float = 2e-4             # where pretraining ended: a higher peak undoes it
    calib_samples: int = 32
    sensitivity_samples: int = 8         # windows the per-layer loss of "-nu" arms is measured on
    ppl_context: int = 256
    ppl_stride: int = 128
    ppl_max_tokens: int | None = None
    seed: int = 0
    smollm2: bool = True
    smollm2_steps: int = 30
    smollm2_batch_size: int = 4
    smollm2_lr: float = 1e-4
    smollm2_ppl_max_tokens: int | None = 12_000
    smollm2_kd_steps: list[int] = field(default_factory=lambda: [30, 60])
    smollm2_nu_heads: float = 1.5        # the non-uniform arm's budget, in KV heads per layer
    # MLA arms: at the KV bytes of these GQA counts (default: H/4 and 1, GQA-2's and MQA's on
    # the 8-head reference), the shared RoPE key this share of the cached row
    mla_kv_heads: list[int] | None = None
    mla_rope_fraction: float = 0.5       # measured best of 1/8..1/2 before uptraining (report.py)
    smollm2_mla_steps: int = 30          # SmolLM2 at a quarter of its KV bytes, uptrained
    # the MLA arms' latent norm: SmolLM2's tokens of outlying latent RMS need the exact one
    # (711.6 against 37.60 at full rank with calibrated, docs/gqa-uptraining.md)
    mla_latent_norm: str = "calibrated"
    smollm2_mla_latent_norm: str = "exact"
    decode_batches: list[int] = field(default_factory=lambda: [1, 32])   # []: no decode timing
    decode_input_len: int = 128
    decode_output_len: int = 64
    decode_repeats: int = 3
    shard: tuple[int, int] = (0, 1)      # (i, n): this process runs jobs i, i+n, i+2n, ...


@dataclass
class RunResult:
    name: str
    model: str                           # "ref" or "smollm2"
    kv_heads: float                      # per layer: the count, or a budget's mean (-nu arms)
    method: str                          # "mha" for the unconverted model / control
    alpha: float
    uptrain_steps: int
    test_ppl: float
    kv_bytes_per_token_fp32: int
    kv_bytes_per_token_bf16: int
    seconds: float
    kv_heads_per_layer: list[int] | None = None    # -nu arms: what the allocation chose
    mla: dict[str, int] | None = None    # MLA arms: kv_lora_rank, qk_rope_head_dim
    train_tokens_per_s: float | None = None        # uptraining alone, from its train_log.jsonl


class Experiment:
    def __init__(self, cfg: ExperimentConfig, show_progress: bool = True):
        self.cfg = cfg
        self.work = Path(cfg.work_dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.show_progress = show_progress
        self.results: dict[str, RunResult] = {}
        self.decode: dict[str, DecodeResult] = {}
        self.reload()
        self.config = ModelConfig.from_dir(cfg.model)
        if self.config.num_key_value_heads != self.config.num_attention_heads:
            raise KvslimError(f"{cfg.model} is not multi-head (it has "
                              f"{self.config.num_key_value_heads} KV heads)")
        self.original_steps = cfg.original_steps or _last_step(Path(cfg.model))

    def reload(self) -> None:
        """Perplexity runs and decode timings, from the one RESULTS file they share."""
        raw = self._load()
        self.results = {k: RunResult(**v) for k, v in raw.items() if not is_decode(k)}
        self.decode = {k: DecodeResult(**v) for k, v in raw.items() if is_decode(k)}

    def _load(self) -> dict[str, dict]:
        path = self.work / RESULTS
        return json.loads(path.read_text()) if path.is_file() else {}

    def _save(self, result: RunResult | DecodeResult) -> None:
        # Shards of one experiment share RESULTS: merge under a lock, never overwrite.
        with self._locked():
            data = self._load()
            data[result.name] = asdict(result)
            tmp = self.work / f"{RESULTS}.tmp"
            tmp.write_text(json.dumps(data, indent=2) + "\n")
            tmp.replace(self.work / RESULTS)
            self.reload()
        if self.show_progress:
            what = (f"test ppl {result.test_ppl:.3f}" if isinstance(result, RunResult)
                    else f"decode tokens/s {result.tokens_per_s}")
            print(f"[experiment] {result.name}: {what} ({result.seconds:.0f} s)", flush=True)

    # ---- the plan ------------------------------------------------------------------------
    def plan(self) -> list[tuple[int, str, float]]:
        """Reference-model runs, cheapest and most informative first: every conversion at
        alpha = 0, then every alpha in `alphas`, then the extra alphas (K = H/4 first), so that
        a time-boxed run still answers the main questions; at each alpha the distilled arms
        (the dearest) after the others. MLA arms only at the bytes of `mla_kv_heads`."""
        h = self.config.num_attention_heads
        ks = self.cfg.kv_heads or sorted({h // 2, h // 4, 1}, reverse=True)
        runs = [(h, "mha", a) for a in self.all_alphas]
        for k in sorted(set(ks) | set(self.mla_kv_heads), reverse=True):
            for method in self.cfg.methods:
                if k not in (self.mla_kv_heads if is_mla(method) else ks):
                    continue
                extra = self.cfg.extra_alphas if method in self.cfg.extra_methods else []
                # a distilled arm at alpha = 0 is its conversion's arm; at one KV head per
                # layer a budget has one allocation, the uniform one: measured once, at 0
                runs += [(k, method, a) for a in self.cfg.alphas + extra
                         if (a > 0 or not distills(method))
                         and (a == 0 or k > 1 or not is_nonuniform(method))
                         and (a == 0 or method not in CONVERSION_ONLY)]
        extra = self._only_extra_alphas
        return sorted(runs, key=lambda r: (r[2] in extra, r[2], distills(r[1]),
                                           r[0] not in (h, h // 4)))

    @property
    def mla_kv_heads(self) -> list[int]:
        h = self.config.num_attention_heads
        return self.cfg.mla_kv_heads or sorted({h // 4, 1}, reverse=True)

    def smollm2_plan(self) -> list[tuple[str, float, int]]:
        """(method, KV heads per layer, uptraining steps): the original, MQA by mean and align,
        then distilled MQA and the non-uniform budget (cheapest first)."""
        kd = sorted(self.cfg.smollm2_kd_steps)
        nu = self.cfg.smollm2_nu_heads
        quarter = SMOLLM2_KV_HEADS / 4           # MLA at a quarter of the KV bytes
        return ([("mha", 3, 0)] + [(m, 1, s) for s in (0, self.cfg.smollm2_steps)
                                    for m in ("mean", "align")]
                + [("align-kd", 1, s) for s in kd[:1]] + [("align-nu", nu, 0)]
                + [("align-nu-kd", nu, s) for s in kd[:1]] + [("mla", quarter, 0)]
                + [("align-kd", 1, s) for s in kd[1:]]
                + [("mla", quarter, self.cfg.smollm2_mla_steps)])

    def jobs(self) -> list[tuple]:
        """All runs in order: the reference model's conversions, the decode timings (which need
        only those), its uptraining, SmolLM2, and the extra alphas last."""
        ref = [("ref",) + r for r in self.plan()]
        extra = self._only_extra_alphas
        main = [j for j in ref if j[3] not in extra]
        decode = ([("decode", k, b) for k in self.mla_kv_heads for b in self.cfg.decode_batches]
                  if "mla" in self.cfg.methods else [])
        small = [("smollm2",) + r for r in self.smollm2_plan()] if self.cfg.smollm2 else []
        return ([j for j in main if j[3] == 0] + decode + [j for j in main if j[3] != 0]
                + small + [j for j in ref if j[3] in extra])

    def missing(self) -> list[str]:
        """Names of planned runs without a result (for the report)."""
        done = set(self.results) | set(self.decode)
        return [n for n in (self._name(j) for j in self.jobs()) if n not in done]

    @property
    def _only_extra_alphas(self) -> set[float]:
        return set(self.cfg.extra_alphas) - set(self.cfg.alphas)

    @property
    def all_alphas(self) -> list[float]:
        return sorted(set(self.cfg.alphas + self.cfg.extra_alphas))

    @staticmethod
    def _name(job: tuple) -> str:
        if job[0] == "decode":
            return decode_name(*job[1:])
        if job[0] == "ref":
            _, k, method, alpha = job
            return f"ref-k{k}-{method}-a{alpha:g}"
        _, method, k, steps = job
        return f"smollm2-k{k:g}-{method if method != 'mha' else 'orig'}-s{steps}"

    def run(self) -> None:
        """Run this shard's jobs in order. Processes started with the same shard share them as a
        queue: each job is claimed before it runs, so no two run it and none sits idle."""
        i, n = self.cfg.shard
        for job in self.jobs()[i::n]:
            name = self._name(job)
            if not self._claim(name):                # done, or another process runs it
                continue
            try:
                if job[0] == "ref":
                    self._run_ref(name, *job[1:])
                elif job[0] == "decode":
                    self._run_decode(*job[1:])
                else:
                    self._run_smollm2(name, *job[1:])
            finally:
                (self.work / f"{name}.claim").unlink(missing_ok=True)

    def _claim(self, name: str) -> bool:
        """True if this process may run `name`: nobody alive claimed it and it has no result."""
        with self._locked():
            path = self.work / f"{name}.claim"
            if path.is_file() and _alive(int(path.read_text() or 0)):
                return False
            if name in self._load():
                return False
            path.write_text(str(os.getpid()))
            return True

    @contextlib.contextmanager
    def _locked(self, what: str = RESULTS):
        with open(self.work / f"{what}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    # ---- one run -------------------------------------------------------------------------
    def _run_ref(self, name: str, k: int, method: str, alpha: float) -> None:
        start = time.time()
        converted = self._converted(self.cfg.model, "ref", k, conversion_of(method))
        steps = round(alpha * self.original_steps)
        model_dir = converted
        if steps:
            teacher = self.cfg.model if distills(method) else None
            model_dir = self._uptrain(converted, self.work / name, steps, self.cfg.batch_size,
                                      self.cfg.uptrain_lr, teacher)
        ppl = self._ppl(model_dir, self.cfg.ppl_max_tokens)
        self._save(self._result(name, "ref", model_dir, method, alpha, steps, ppl, start, k))

    @staticmethod
    def _train_rate(model_dir: Path, steps: int) -> float | None:
        """Tokens/s of the uptraining alone: the harmonic mean of the logged windows' rates."""
        log = model_dir / "train_log.jsonl"
        if not steps or not log.is_file():
            return None
        rates = [json.loads(line).get("tokens_per_s") for line in log.read_text().splitlines()
                 if line.strip()]
        rates = [r for r in rates if r]
        return round(statistics.harmonic_mean(rates), 1) if rates else None

    def _converted(self, src: str, tag: str, k: float, method: str) -> Path:
        """`method` is a conversion (no -kd); k KV heads per layer, or their mean for -nu."""
        if method == "mha":
            return Path(src)
        out = self.work / f"{tag}-k{k:g}-{method}"
        c = self.cfg
        with self._locked(out.name):             # another process may be converting it
            if (out / "config.json").is_file():
                return out
            if is_mla(method):
                norm = c.smollm2_mla_latent_norm if tag == "smollm2" else c.mla_latent_norm
                convert_mla_arm(src, out, k, method, c.train, c.calib_samples, c.seq_len,
                                c.mla_rope_fraction, norm, self.show_progress)
            elif is_nonuniform(method):
                fraction = k / ModelConfig.from_dir(src).num_key_value_heads
                convert_to_budget(src, out, "sensitivity", fraction,
                                  method=method.removesuffix("-nu"), calib=c.train,
                                  calib_samples=c.calib_samples, calib_seq_len=c.seq_len,
                                  sensitivity_samples=c.sensitivity_samples, seed=c.seed,
                                  show_progress=self.show_progress)
            else:
                convert_to_gqa(src, out, int(k), method, calib=c.train,
                               calib_samples=c.calib_samples, calib_seq_len=c.seq_len,
                               seed=c.seed, show_progress=self.show_progress)
        return out

    def _run_decode(self, k: float, batch: int) -> None:
        """The MLA arm's conversion against GQA's (align) at the same KV bytes."""
        c = self.cfg
        dirs = {arm: self._converted(c.model, "ref", k, conversion)
                for arm, (conversion, _) in DECODE_ARMS.items()}
        self._save(measure_decode(k, batch, dirs, c.decode_input_len, c.decode_output_len,
                                  c.decode_repeats))

    def _uptrain(self, src: Path, out: Path, steps: int, batch: int, lr: float,
                 teacher: str | None = None) -> Path:
        if out.exists():
            shutil.rmtree(out)                  # a half-finished run restarts cleanly
        c = self.cfg
        distill = {} if teacher is None else dict(
            teacher=teacher, distill_temperature=c.distill_temperature,
            distill_weight=c.distill_weight, match_attention=c.attention_weight > 0,
            attention_weight=c.attention_weight)
        cfg = TrainConfig(data=c.train, valid=c.valid, out=str(out),
                          init_from=str(src), seq_len=c.seq_len, steps=steps,
                          batch_size=batch, lr=lr, warmup_steps=max(1, steps // 10),
                          eval_every=steps, save_every=steps, seed=c.seed + 1, **distill)
        train(cfg, show_progress=self.show_progress)
        (out / "trainer_state.pt").unlink(missing_ok=True)   # optimizer state: not needed
        return out

    def _ppl(self, model_dir: Path, max_tokens: int | None) -> float:
        return file_perplexity(model_dir, self.cfg.test, self.cfg.ppl_context,
                               self.cfg.ppl_stride, max_tokens,
                               show_progress=self.show_progress).perplexity

    def _result(self, name, tag, model_dir, method, alpha, steps, ppl, start, k) -> RunResult:
        mc = ModelConfig.from_dir(model_dir)
        return RunResult(name, tag, k, method, alpha, steps, ppl,
                         mc.kv_bytes_per_token("float32"), mc.kv_bytes_per_token("bfloat16"),
                         round(time.time() - start, 1),
                         list(mc.layer_kv_heads) if mc.layer_kv_heads else None,
                         {"kv_lora_rank": mc.mla.kv_lora_rank,
                          "qk_rope_head_dim": mc.mla.qk_rope_head_dim} if mc.mla else None,
                         self._train_rate(Path(model_dir), steps))

    # ---- SmolLM2 -------------------------------------------------------------------------
    def _run_smollm2(self, name: str, method: str, k: float, steps: int) -> None:
        from kvslim.formats.registry import default_model_dir
        src = str(default_model_dir(self.show_progress))
        start = time.time()
        model_dir = self._converted(src, "smollm2", k, conversion_of(method))
        if steps:
            model_dir = self._uptrain(model_dir, self.work / name, steps,
                                      self.cfg.smollm2_batch_size, self.cfg.smollm2_lr,
                                      src if distills(method) else None)
        ppl = self._ppl(model_dir, self.cfg.smollm2_ppl_max_tokens)
        self._save(self._result(name, "smollm2", model_dir,
                                method if method != "mha" else "original", 0.0, steps, ppl, start,
                                k))


def _last_step(model_dir: Path) -> int:
    log = model_dir / "train_log.jsonl"
    if not log.is_file():
        raise KvslimError(f"no train_log.jsonl in {model_dir}; pass --original-steps")
    lines = [json.loads(l) for l in log.read_text().splitlines() if l.strip()]
    return max(l["step"] for l in lines)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
