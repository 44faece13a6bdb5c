"""The training loop behind `kvslim train` and `kvslim uptrain`: AdamW, warmup + cosine,
gradient clipping and accumulation, periodic validation, checkpoints and exact `--resume`."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig
from kvslim.models.families import TRAINED_FAMILY
from kvslim.device import resolve_device
from kvslim.models.causal_lm import CausalLM
from kvslim.formats.loader import init_model, load_model
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.formats.writer import copy_tokenizer_files, save_model
from kvslim.train.distill import Distiller, load_teacher
from kvslim.train.data import eval_windows, random_windows, tokenize_file
from kvslim.train.legacy_state import fuse_optimizer_state, is_unfused_state
from kvslim.train.latent_rows import ExactLatentRows
from kvslim.train.pruned_masks import PrunedMasks
from kvslim.train.tokenizer_train import train_tokenizer
from kvslim.train.train_config import TrainConfig

STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"


def lm_loss(model: CausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of [B, T+1] windows."""
    logits = model.logits(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: CausalLM, windows: torch.Tensor, batch_size: int = 16) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        total += lm_loss(model, chunk).item() * len(chunk)
    model.train(was_training)
    return total / len(windows)


def build_model(cfg: TrainConfig, tokenizer: Tokenizer) -> CausalLM:
    if cfg.init_from:
        return load_model(cfg.init_from, dtype=torch.float32)
    s = cfg.shape
    eos = tokenizer.eos_token_ids
    config = ModelConfig(
        architecture=TRAINED_FAMILY.architecture, vocab_size=tokenizer.vocab_size,
        hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_key_value_heads, head_dim=s.hidden_size // s.num_attention_heads,
        rope_theta=s.rope_theta, max_position_embeddings=max(2048, cfg.seq_len),
        tie_word_embeddings=s.tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=eos)
    return init_model(config, seed=cfg.seed)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def prepare_tokenizer(cfg: TrainConfig, out: Path) -> Tokenizer:
    source = cfg.tokenizer or cfg.init_from
    if source is None:
        train_tokenizer([cfg.data], cfg.vocab_size, out)
        source = out
    copy_tokenizer_files(source, out)
    return Tokenizer.from_dir(out)


def train(cfg: TrainConfig, show_progress: bool = True) -> dict:
    """Run (or resume) training; returns the final metrics. The output directory is an HF model
    directory at every checkpoint."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.resume and not (out / STATE_FILE).is_file():
        raise KvslimError(f"--resume: no {STATE_FILE} in {out}")
    tokenizer = prepare_tokenizer(cfg, out)
    train_tokens = tokenize_file(cfg.data, tokenizer, show_progress)
    valid = (eval_windows(tokenize_file(cfg.valid, tokenizer, show_progress), cfg.seq_len,
                          cfg.eval_windows).to(device) if cfg.valid else None)
    torch.manual_seed(cfg.seed)
    model, optimizer, start = _model_and_optimizer(cfg, tokenizer, out, device)
    loss_fn = make_loss(cfg, model, tokenizer, device)
    if cfg.compile_step:
        loss_fn = compiled_loss(loss_fn)
    # a pruned model's zeros; an exact latent norm's scaled rows (their modules say why)
    hooks = [h for h in (PrunedMasks.of(model), ExactLatentRows.of(model)) if h is not None]
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if cfg.dtype == "bfloat16" else contextlib.nullcontext())
    progress = _Progress(cfg, out, start, show_progress)
    metrics: dict = {}
    for step in range(start, cfg.steps):
        lr = cfg.lr_at(step)
        loss_sum, grad_norm = _train_step(model, optimizer, cfg, train_tokens, step, lr,
                                          device, autocast, loss_fn, hooks)
        done = step + 1
        metrics = {"step": done, "loss": round(loss_sum, 5), "lr": lr,
                   "grad_norm": round(grad_norm, 4)}
        progress.record(metrics, loss_sum, model, valid)
        if done % cfg.save_every == 0 or done == cfg.steps:
            save_checkpoint(model, optimizer, cfg, done, out)
    progress.close()
    return metrics


def _model_and_optimizer(cfg: TrainConfig, tokenizer: Tokenizer, out: Path, device: torch.device
                         ) -> tuple[CausalLM, torch.optim.AdamW, int]:
    """The model on `device` in training mode, its optimizer, and the first step to run (from
    the checkpoint in OUT with --resume)."""
    if cfg.resume:
        model = load_model(out, dtype=torch.float32)
    else:
        model = build_model(cfg, tokenizer)
    if model.config.vocab_size < tokenizer.vocab_size:
        raise KvslimError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only "
                          f"{model.config.vocab_size}")
    model.train()
    optimizer = make_optimizer(model, cfg)
    start = 0
    if cfg.resume:
        state = torch.load(out / STATE_FILE, weights_only=False)
        model.to(device)      # before loading: the optimizer state follows its parameters
        saved = state["optimizer"]
        if is_unfused_state(saved, optimizer):         # saved before q/k/v, gate/up fused
            saved = fuse_optimizer_state(saved, model, optimizer)
        optimizer.load_state_dict(saved)
        start = state["step"]
    model.to(device)
    return model, optimizer, start


def make_loss(cfg: TrainConfig, model: CausalLM, tokenizer: Tokenizer,
              device: torch.device):
    """The training loss: next-token cross-entropy, or distillation from `cfg.teacher`."""
    if cfg.teacher is None:
        return lm_loss
    teacher = load_teacher(cfg.teacher, model, tokenizer, device)
    return Distiller(teacher, cfg.distill_temperature, cfg.distill_weight,
                     cfg.attention_weight if cfg.match_attention else None)


# torch.compile's backend for `--compile` (tests trace with "aot_eager": the same graphs and
# autograd split, eager kernels, seconds instead of C++ builds)
COMPILE_BACKEND = "inductor"


def compiled_loss(loss_fn):
    """`loss_fn(model, batch)` through torch.compile: Inductor generates the forward and, through
    AOTAutograd, the backward; the optimizer step and the hooks stay eager."""
    def loss(model, batch):
        return loss_fn(model, batch)
    return torch.compile(loss, backend=COMPILE_BACKEND)


def _train_step(model: CausalLM, optimizer, cfg: TrainConfig, train_tokens, step: int,
                lr: float, device: torch.device, autocast, loss_fn=lm_loss,
                hooks: list = ()) -> tuple[float, float]:
    """One optimizer step over `grad_accum` micro-batches; returns (loss, gradient norm).
    `hooks` (PrunedMasks, ExactLatentRows) see the gradients before the clip and the weights
    after the step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = 0.0
    for micro in range(cfg.grad_accum):
        batch = random_windows(train_tokens, cfg.batch_size, cfg.seq_len, cfg.seed,
                               step * cfg.grad_accum + micro).to(device)
        with autocast:
            loss = loss_fn(model, batch) / cfg.grad_accum
        loss.backward()
        loss_sum += loss.item()
    for hook in hooks:
        hook.before_clip()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
    optimizer.step()
    for hook in hooks:
        hook.after_step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


class _Progress:
    """The log file (train_log.jsonl), the progress bar and the tokens/s clock of a run."""

    def __init__(self, cfg: TrainConfig, out: Path, start: int, show_progress: bool):
        self.cfg = cfg
        if not cfg.resume:
            (out / LOG_FILE).write_text("")
        self.log = (out / LOG_FILE).open("a")
        self.bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step",
                        disable=not show_progress)
        self.t_last, self.tokens_since = time.perf_counter(), 0
        self.speed = "…"                         # tokens/s, refreshed every log_every steps

    def record(self, metrics: dict, loss: float, model: CausalLM,
               valid: torch.Tensor | None) -> None:
        """Add throughput and validation loss to a step's `metrics` when due; log them and show
        them (with the unrounded `loss`)."""
        cfg, done = self.cfg, metrics["step"]
        self.tokens_since += cfg.tokens_per_step
        if done % cfg.log_every == 0 or done == cfg.steps:
            now = time.perf_counter()
            metrics["tokens_per_s"] = round(self.tokens_since / (now - self.t_last), 1)
            self.t_last, self.tokens_since = now, 0
        if valid is not None and (done % cfg.eval_every == 0 or done == cfg.steps):
            metrics["val_loss"] = round(evaluate(model, valid), 5)
        if len(metrics) > 4 or done == cfg.steps:
            self.log.write(json.dumps(metrics) + "\n")
            self.log.flush()
        if "tokens_per_s" in metrics:
            self.speed = f"{metrics['tokens_per_s']:,.0f}"
        self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{metrics['lr']:.2e}",
                             tok_s=self.speed,
                             **({"val": f"{metrics['val_loss']:.3f}"} if "val_loss" in metrics
                                else {}))
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.log.close()


def save_checkpoint(model: CausalLM, optimizer, cfg: TrainConfig, step: int, out: Path
                    ) -> None:
    save_model(model.hf_state_dict(), model.config, out)
    tmp = out / (STATE_FILE + ".tmp")
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "config": cfg.to_dict()}, tmp)
    tmp.replace(out / STATE_FILE)
