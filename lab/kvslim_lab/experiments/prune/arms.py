"""The arms of `kvslim experiment prune` and how each is built. An arm is one model made from the
source: the dense model itself, one pruning method at one target (a fraction of every row, or
N:M), optionally with 4-bit kept weights, GPTQ 4-bit without pruning (the 4-bit rows' dense
reference), or a pruned arm after recovery uptraining (distilled from the dense model, its
zeros kept: train/pruned_masks.py)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

DENSE = "dense"
DENSE_4BIT = "dense-w4"


@dataclass(frozen=True)
class Arm:
    name: str
    method: str | None = None          # magnitude | wanda | sparsegpt; None: not pruned
    target: str | None = None          # "0.5" (a fraction of each row) or "2:4"
    bits: int | None = None            # 4: the kept weights quantized
    recovered: bool = False            # uptrained after pruning (from the arm without "+rec")
    decode: bool = False               # batch-1 decode timed

    @property
    def label(self) -> str:
        return target_label(self.target) if self.target else "dense"

    @property
    def pruned_from(self) -> str:
        """The arm a recovered arm uptrains."""
        return self.name.removesuffix("+rec")


def target_label(target: str) -> str:
    return target if ":" in target else f"{float(target):.0%}"


def arm_name(method: str, target: str, bits: int | None) -> str:
    t = target.replace(":", "of") if ":" in target else f"s{round(float(target) * 100)}"
    return f"{method}-{t}" + (f"-w{bits}" if bits else "")


def plan(methods: list[str], targets: list[str], quantized_targets: list[str], bits: int,
         recover: list[str], decode_arms: list[str]) -> list[Arm]:
    """Every arm in build order: dense, each target x method, the 4-bit arms, recoveries."""
    arms = [Arm(DENSE)]
    arms += [Arm(arm_name(m, t, None), m, t) for t in targets for m in methods]
    arms.append(Arm(DENSE_4BIT, bits=bits))
    arms += [Arm(arm_name(m, t, bits), m, t, bits) for t in quantized_targets for m in methods]
    by_name = {a.name: a for a in arms}
    arms += [Arm(f"{name}+rec", by_name[name].method, by_name[name].target, None, True)
             for name in recover if name in by_name and by_name[name].bits is None]
    return [Arm(a.name, a.method, a.target, a.bits, a.recovered, a.name in decode_arms)
            for a in arms]


def build(arm: Arm, source: Path, out: Path, cfg, arm_dir) -> Path:
    """Write `arm`'s model to `out` (through a temporary directory: a half-built arm is never
    taken for a built one); `arm_dir(name)` finds another arm's built model."""
    if arm.name == DENSE:
        return source
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if arm.recovered:
        _recover(arm_dir(arm.pruned_from), source, tmp, cfg)
    elif arm.method is None:
        from kvslim.quantization import QuantSpec
        from kvslim.surgery.quantize.model import quantize_model
        quantize_model(source, tmp, "gptq", QuantSpec(arm.bits, cfg.group_size, False, True,
                                                      "gptq"),
                       cfg.calib, cfg.calib_samples, cfg.calib_seq_len, show_progress=False)
    else:
        _prune(arm, source, tmp, cfg)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _prune(arm: Arm, source: Path, out: Path, cfg) -> None:
    from kvslim.quantization import QuantSpec
    from kvslim.surgery.prune.masks import SparsityTarget
    from kvslim.surgery.prune.model import prune_model
    structured = ":" in arm.target
    target = SparsityTarget.parse(None if structured else float(arm.target),
                                  arm.target if structured else None)
    spec = None if arm.bits is None else QuantSpec(arm.bits, cfg.group_size, False, True, "gptq")
    prune_model(source, out, arm.method, target, spec,
                None if arm.method == "magnitude" else cfg.calib, cfg.calib_samples,
                cfg.calib_seq_len, show_progress=False)


def _recover(pruned: Path, teacher: Path, out: Path, cfg) -> None:
    """Uptrain the pruned model for `cfg.recovery_tokens` on the training text, distilled from
    the dense model (as the GQA study's align-kd arms are), its zeros kept."""
    from kvslim.train.train_config import TrainConfig
    from kvslim.train.trainer import train
    steps = max(1, cfg.recovery_tokens // (cfg.recovery_batch_size * cfg.recovery_seq_len))
    train(TrainConfig(data=cfg.calib, out=str(out), init_from=str(pruned),
                      seq_len=cfg.recovery_seq_len, steps=steps,
                      batch_size=cfg.recovery_batch_size, lr=cfg.recovery_lr,
                      warmup_steps=max(1, steps // 10), eval_every=steps, save_every=steps,
                      seed=1, teacher=str(teacher), distill_temperature=2.0,
                      distill_weight=0.5), show_progress=cfg.show_progress)
    (out / "trainer_state.pt").unlink(missing_ok=True)      # optimizer state: not needed
