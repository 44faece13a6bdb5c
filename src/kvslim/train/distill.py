"""Distillation for `kvslim uptrain --teacher`: a converted (GQA/MQA) student learns from the
unconverted model's output distribution, and optionally from each layer's attention output.

Loss = (1 - w) * CE(student, labels) + w * T^2 * KL(p_teacher,T || p_student,T)
       [+ a * mean over layers of MSE(student attention output, teacher attention output)]

The KL is the forward direction of Hinton et al. (2015): the teacher's tempered distribution is
the target and the student is pushed to cover all of its mass, which is what a student that was
the teacher before its KV heads were merged should recover; the reverse (mode-seeking) KL would
let it drop the teacher's less likely continuations. T^2 keeps the soft term's gradient on the
same scale as the cross-entropy's whatever T is. The teacher runs forward only, without autograd
and in eval mode, on the same micro-batch as the student: its logits exist for one micro-batch
at a time and are never stored for the corpus."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvslim.errors import KvslimError
from kvslim.formats.loader import load_model
from kvslim.models.causal_lm import CausalLM
from kvslim.tokenizer.tokenizer import Tokenizer


@dataclass
class DistillParts:
    """The terms of one micro-batch's loss, before weighting (for logs and tests)."""
    ce: torch.Tensor
    kl: torch.Tensor
    attention: torch.Tensor | None = None


def soft_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
            temperature: float) -> torch.Tensor:
    """KL(softmax(teacher/T) || softmax(student/T)), summed over the vocabulary and averaged over
    positions; logits are [..., vocab]."""
    vocab = student_logits.shape[-1]
    log_q = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)
    return F.kl_div(log_q, log_p, reduction="batchmean", log_target=True)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                 labels: torch.Tensor, temperature: float, weight: float
                 ) -> tuple[torch.Tensor, DistillParts]:
    """(1 - w) * cross-entropy on `labels` + w * T^2 * soft_kl; also returns the unweighted
    terms."""
    vocab = student_logits.shape[-1]
    ce = F.cross_entropy(student_logits.float().reshape(-1, vocab), labels.reshape(-1))
    kl = soft_kl(student_logits, teacher_logits, temperature)
    return (1 - weight) * ce + weight * temperature ** 2 * kl, DistillParts(ce, kl)


def attention_match_loss(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layers of the MSE between the student's and the teacher's attention outputs."""
    if len(student) != len(teacher) or not student:
        raise KvslimError(f"--match-attention: the student has {len(student)} attention layers, "
                          f"the teacher {len(teacher)}")
    return torch.stack([F.mse_loss(s.float(), t.float()) for s, t in zip(student, teacher)]).mean()


@contextlib.contextmanager
def capture_attention(model: CausalLM):
    """Collects each layer's attention-block output (o_proj's output, before the residual add)
    into the yielded list, in layer order, for the forward passes run inside the block."""
    outputs: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_hook(lambda _m, _i, out: outputs.append(out))
             for layer in model.model.layers]
    try:
        yield outputs
    finally:
        for hook in hooks:
            hook.remove()


class Distiller:
    """The training loss with a teacher: call it like `lm_loss` (model, [B, T+1] windows)."""

    def __init__(self, teacher: CausalLM, temperature: float, weight: float,
                 attention_weight: float | None = None):
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.temperature, self.weight = temperature, weight
        self.attention_weight = attention_weight      # None: no attention matching
        self.last_parts: DistillParts | None = None

    def __call__(self, model: CausalLM, batch: torch.Tensor) -> torch.Tensor:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        match = self.attention_weight is not None
        # no_grad rather than inference_mode: inference tensors may not be saved for the
        # student's backward pass, and the KL keeps the teacher's log-probabilities for it.
        with torch.no_grad(), _maybe(capture_attention(self.teacher), match) as t_attn:
            teacher_logits = self.teacher.logits(inputs)
        with _maybe(capture_attention(model), match) as s_attn:
            student_logits = model.logits(inputs)
        loss, parts = distill_loss(student_logits, teacher_logits, labels, self.temperature,
                                   self.weight)
        if match:
            parts.attention = attention_match_loss(s_attn, t_attn)
            loss = loss + self.attention_weight * parts.attention
        self.last_parts = parts
        return loss


def _maybe(context, enabled: bool):
    return context if enabled else contextlib.nullcontext([])


def load_teacher(teacher_dir: str | Path, student: CausalLM, student_tokenizer: Tokenizer,
                 device: torch.device) -> CausalLM:
    """The teacher model on `device`, after checking it speaks the student's vocabulary."""
    teacher_dir = Path(teacher_dir)
    if not (teacher_dir / "config.json").is_file():
        raise KvslimError(f"--teacher: no config.json in {teacher_dir}")
    check_same_vocabulary(teacher_dir, student, student_tokenizer)
    return load_model(teacher_dir, dtype=torch.float32).to(device).eval()


def check_same_vocabulary(teacher_dir: Path, student: CausalLM,
                          student_tokenizer: Tokenizer) -> None:
    """Logits are compared id by id, so both the model vocab size and the tokenizer's
    token -> id map must be the same."""
    from kvslim.models.config import ModelConfig
    teacher_vocab = ModelConfig.from_dir(teacher_dir).vocab_size
    if teacher_vocab != student.config.vocab_size:
        raise KvslimError(f"--teacher {teacher_dir} has vocab_size {teacher_vocab}, the student "
                          f"{student.config.vocab_size}: distillation needs the same vocabulary")
    theirs = Tokenizer.from_dir(teacher_dir).tok.get_vocab(with_added_tokens=True)
    ours = student_tokenizer.tok.get_vocab(with_added_tokens=True)
    if theirs != ours:
        differ = sum(theirs.get(t) != ours.get(t) for t in theirs.keys() | ours.keys())
        raise KvslimError(f"--teacher {teacher_dir} has a different tokenizer vocabulary from the "
                          f"student's ({len(theirs)} vs {len(ours)} tokens, {differ} of them "
                          f"with another id or missing): distillation needs the same tokenizer")
