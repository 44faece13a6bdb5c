"""`TrainConfig` and the named model-shape presets for `kvslim train` / `kvslim uptrain`."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvslim.errors import KvslimError

# Shapes of the project's own models. `ref-mha` is the reference multi-head model the GQA
# surgery experiments start from; `tiny` is for tests.
PRESETS: dict[str, dict] = {
    "ref-mha": dict(num_hidden_layers=6, hidden_size=256, num_attention_heads=8,
                    num_key_value_heads=8, intermediate_size=704, seq_len=256),
    "small": dict(num_hidden_layers=4, hidden_size=128, num_attention_heads=8,
                  num_key_value_heads=8, intermediate_size=352, seq_len=128),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
                 num_key_value_heads=8, intermediate_size=128, seq_len=64),
}


@dataclass
class ModelShape:
    num_hidden_layers: int = 6
    hidden_size: int = 256
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    intermediate_size: int = 704
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True


@dataclass
class TrainConfig:
    data: str
    out: str
    valid: str | None = None
    tokenizer: str | None = None     # directory with tokenizer.json; trained on `data` if None
    vocab_size: int = 8192           # only used when the tokenizer is trained here
    init_from: str | None = None     # start from this model directory (uptraining)
    shape: ModelShape = field(default_factory=ModelShape)
    seq_len: int = 256
    steps: int = 1000
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "float32"           # float32, or bfloat16 autocast
    eval_every: int = 100
    eval_windows: int = 64
    save_every: int = 250
    log_every: int = 10
    seed: int = 0
    threads: int | None = None
    device: str = "auto"             # auto: cuda when available, else cpu
    resume: bool = False
    # torch.compile the loss's forward and backward (benchmarks/train_compile.py measures it)
    compile_step: bool = False
    # Distillation (uptraining a converted model from the unconverted one, see distill.py)
    teacher: str | None = None       # teacher model directory; None: labels only
    distill_temperature: float = 2.0
    distill_weight: float = 0.5      # w in (1 - w) * CE + w * T^2 * KL
    match_attention: bool = False    # add the per-layer attention-output MSE
    attention_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every", "save_every",
                     "log_every"):
            if getattr(self, name) <= 0:
                raise KvslimError(f"--{name.replace('_', '-')} must be positive, "
                                  f"got {getattr(self, name)}")
        if self.warmup_steps < 0 or not (0 < self.lr < 1):
            raise KvslimError("--lr must be in (0, 1) and --warmup-steps >= 0")
        if self.dtype not in ("float32", "bfloat16"):
            raise KvslimError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        self._check_distillation()

    def _check_distillation(self) -> None:
        if not 0 <= self.distill_weight <= 1:
            raise KvslimError(f"--distill-weight must be in [0, 1], got {self.distill_weight}")
        if not self.distill_temperature > 0:
            raise KvslimError(f"--distill-temperature must be positive, "
                              f"got {self.distill_temperature}")
        if not self.attention_weight >= 0:
            raise KvslimError(f"--attention-weight must be >= 0, got {self.attention_weight}")
        if self.match_attention and self.teacher is None:
            raise KvslimError("--match-attention needs --teacher")

    def lr_at(self, step: int) -> float:
        """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    def to_dict(self) -> dict:
        return asdict(self)


def shape_from_preset(name: str) -> tuple[ModelShape, int]:
    if name not in PRESETS:
        raise KvslimError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    seq_len = fields.pop("seq_len")
    return ModelShape(**fields), seq_len
