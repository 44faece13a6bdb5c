"""`train_drafter`: Medusa heads or an EAGLE head trained by self-distillation on a frozen model.

The targets are the model's own answers: prompts (lines of a text file, as plain prompts or as
chat turns) are answered by kvslim's engine in one batch, half greedily and half sampled, and
cached in OUT. The frozen model's last hidden states over prompt + answer are computed once;
then Medusa's head k learns to guess the answer's token k + 2 places after each position,
against the answer itself (cross-entropy), or the EAGLE head learns to guess the next hidden
state (train/eagle.py), while the model stays as it is."""
from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvslim.drafters.eagle import EagleConfig, EagleHead
from kvslim.drafters.medusa import MedusaConfig, MedusaHeads
from kvslim.errors import KvslimError

KINDS = ("medusa", "eagle")
DATA_FILE = "self_distill.json"
LOG_FILE = "train_log.json"


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class DrafterTrainConfig:
    """The CLI's flags are these fields' (cli/drafter_cmds.py)."""
    model: str | None                 # what the engine runs (None: the embedded default)
    out: str
    prompts: str                      # a text file: one prompt a line
    kind: str = _opt("medusa", "the drafter: medusa (heads) or eagle (one decoder layer)")
    chat: bool = _opt(True, "prompts as chat turns through the model's template (else plain)")
    heads: int = _opt(3, "Medusa heads: head k guesses the token k + 2 ahead")
    layers: int = _opt(1, "residual blocks per head")
    share_lm_head: bool = _opt(True, "heads share the model's LM head (else each its own copy)")
    window: int = _opt(64, "eagle: positions its layer attends over")
    draft_vocab: int = _opt(8192, "eagle: the draft vocabulary's size (0: the model's)")
    feature_noise: float = _opt(0.1, "eagle: uniform noise on its input hidden states, in "
                                     "units of their root mean square")
    unroll: int = _opt(1, "eagle: passes per step, each reading the last one's guesses")
    tokens: int = _opt(100_000, "self-distilled answer tokens to generate, at most")
    text: str = _opt("", "a plain-text file whose tokens are trained on too, beside the "
                         "answers (the model's own next-token distribution is the target)")
    text_tokens: int = _opt(0, "tokens of --text to use (in sequences of --text-length)")
    text_length: int = _opt(192, "tokens per --text sequence")
    max_answer_tokens: int = _opt(128, "each answer's max_tokens")
    sampled_fraction: float = _opt(0.5, "share of prompts answered at temperature 0.7")
    steps: int = _opt(400, "optimizer steps")
    batch_positions: int = _opt(256, "positions per step (each trains every head)")
    lr: float = _opt(1e-3, "peak learning rate (cosine to 0)")
    seed: int = _opt(0, "sampling and training seed")
    log_every: int = _opt(20, "steps between log entries (loss, per-head accuracy)")

    def __post_init__(self) -> None:
        if self.unroll < 1:
            raise KvslimError(f"--unroll must be at least 1, got {self.unroll}")
        if self.kind not in KINDS:
            raise KvslimError(f"drafter kind must be one of {', '.join(KINDS)}, got "
                              f"{self.kind!r}")


def train_drafter(cfg: DrafterTrainConfig, show_progress: bool = True) -> dict:
    from kvslim.engine.llm import LLM
    from kvslim.formats.loader import load_model
    start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(cfg.model, kv_cache_memory="256MiB")
    answers, texts = _self_distilled(llm, cfg, out, show_progress), _text_sequences(llm, cfg)
    seconds = {"answers": time.perf_counter() - start}
    sequences = answers + texts
    model_dir = llm.model_dir
    eos = list(llm.engine.eos_token_ids)
    del llm                                      # its KV cache: not needed from here on
    model = load_model(model_dir).eval()
    hidden, targets, prompt_lens = _cached_hidden_states(model, sequences, out, show_progress)
    seconds["hidden_states"] = time.perf_counter() - start - sum(seconds.values())
    lm_head = _frozen_lm_head(model)
    if cfg.kind == "eagle":
        drafter, log = _train_eagle(model, model_dir, lm_head, hidden, targets, sequences, eos,
                                    cfg, show_progress)
    else:
        drafter = MedusaHeads(MedusaConfig(cfg.heads, cfg.layers, model.config.hidden_size,
                                           model.config.vocab_size, cfg.share_lm_head,
                                           str(model_dir)))
        drafter.init_own_lm_heads(lm_head.weight)
        log = _fit(drafter, lm_head, hidden, targets, prompt_lens, cfg, show_progress)
    drafter.save(out)
    summary = {"config": asdict(cfg), "sequences": len(sequences),
               "answer_tokens": sum(len(a) for _, a in answers),
               "text_tokens": sum(len(t) for _, t in texts),
               "log": log, "final": log[-1] if log else {},
               # the cost as paid: answers or hidden states found in OUT cost ~0 here
               "seconds": {**{k: round(v, 1) for k, v in seconds.items()},
                           "steps": round(time.perf_counter() - start - sum(seconds.values()), 1),
                           "total": round(time.perf_counter() - start, 1)}}
    (out / LOG_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _self_distilled(llm, cfg: DrafterTrainConfig, out: Path, show_progress: bool
                    ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) pairs, generated once and cached in OUT."""
    from kvslim.engine.sampling_params import SamplingParams
    cache = out / DATA_FILE
    key = {"model": str(llm.model_dir), "prompts": str(cfg.prompts), "chat": cfg.chat,
           "tokens": cfg.tokens, "max_answer_tokens": cfg.max_answer_tokens,
           "sampled_fraction": cfg.sampled_fraction, "seed": cfg.seed}
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved["key"] == key:
            return [tuple(pair) for pair in saved["pairs"]]
    lines = [ln.strip() for ln in Path(cfg.prompts).read_text().splitlines() if ln.strip()]
    lines = lines[:max(1, math.ceil(cfg.tokens / cfg.max_answer_tokens))]
    if not lines:
        raise KvslimError(f"{cfg.prompts}: no prompts (one a line)")
    sampled = int(len(lines) * cfg.sampled_fraction)
    params = [SamplingParams(max_tokens=cfg.max_answer_tokens, temperature=0.7 if i < sampled
                             else 0.0, seed=cfg.seed + i) for i in range(len(lines))]
    if cfg.chat:
        outs = llm.chat([[{"role": "user", "content": ln}] for ln in lines], params,
                        use_tqdm=show_progress)
    else:
        outs = llm.generate(lines, params, use_tqdm=show_progress)
    pairs = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
    cache.write_text(json.dumps({"key": key, "pairs": pairs}))
    return pairs


HIDDEN_BATCH = 8
HIDDEN_FILE = "hidden_states.safetensors"


def _cached_hidden_states(model, pairs, out: Path, show_progress: bool):
    """_hidden_states, kept in OUT (bfloat16) for the next run on the same sequences: a
    drafter's second try at other training options skips the model's passes."""
    from safetensors.torch import load_file, save_file
    key = hashlib.sha256(json.dumps([list(p) + [-1] + list(a) for p, a in pairs]).encode()
                         ).hexdigest()
    path = out / HIDDEN_FILE
    if path.is_file():
        from safetensors import safe_open
        with safe_open(path, "pt") as f:
            same = f.metadata().get("sequences") == key
        if same:
            flat = load_file(path)["hidden"].float()
            seqs = [torch.tensor(list(p) + list(a)) for p, a in pairs]
            hidden = list(flat.split([len(s) for s in seqs]))
            return hidden, seqs, [len(p) for p, _ in pairs]
    hidden, seqs, prompt_lens = _hidden_states(model, pairs, show_progress)
    flat = torch.cat(hidden).to(torch.bfloat16)
    save_file({"hidden": flat}, path, metadata={"sequences": key})
    # The numbers a later run reads back: both runs train on the same ones.
    return list(flat.float().split([len(s) for s in seqs])), seqs, prompt_lens


def _text_sequences(llm, cfg: DrafterTrainConfig) -> list[tuple[list[int], list[int]]]:
    """(empty prompt, text tokens) pairs: --text-length token sequences read at evenly spaced
    places of --text (a corpus's sources in turn, not its first one only)."""
    if not cfg.text or cfg.text_tokens <= 0:
        return []
    if cfg.text_length < 8:
        raise KvslimError(f"--text-length must be at least 8, got {cfg.text_length}")
    chars = Path(cfg.text).read_text(encoding="utf-8")
    count = max(1, cfg.text_tokens // cfg.text_length)
    span = cfg.text_length * 8                      # characters: ample for the tokens
    starts = [i * max(0, len(chars) - span) // count for i in range(count)]
    pieces = [llm.tokenizer.encode(chars[s:s + span], add_special_tokens=False)[1:]
              for s in starts]                      # [1:]: the first may be half a word
    return [([], ids[:cfg.text_length]) for ids in pieces if len(ids) >= cfg.text_length]


@torch.no_grad()
def _hidden_states(model, pairs, show_progress: bool):
    """The frozen model's last hidden state at every position of every prompt + answer, in
    batches of similar lengths (right-padded: causal attention never reads the padding)."""
    seqs = [torch.tensor(list(prompt) + list(answer)) for prompt, answer in pairs]
    hidden: list[torch.Tensor | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    bar = tqdm(total=len(seqs), desc="hidden states", disable=not show_progress)
    for at in range(0, len(order), HIDDEN_BATCH):
        batch = order[at:at + HIDDEN_BATCH]
        ids = torch.nn.utils.rnn.pad_sequence([seqs[i] for i in batch], batch_first=True)
        out = model(ids).float()
        for row, i in enumerate(batch):
            hidden[i] = out[row, :len(seqs[i])].clone()
        bar.update(len(batch))
    bar.close()
    return hidden, seqs, [len(prompt) for prompt, _ in pairs]


@torch.no_grad()
def _frozen_lm_head(model) -> torch.nn.Linear:
    """The model's LM head as a plain float32 linear (a quantized one, dequantized once): the
    heads' gradients flow through it, which a block-quantized kernel need not support."""
    weight = model.lm_head(torch.eye(model.config.hidden_size)).T.float()
    head = torch.nn.Linear(model.config.hidden_size, weight.shape[0], bias=False)
    head.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    return head


def _train_eagle(model, model_dir, lm_head, hidden, targets, pairs, eos, cfg, show_progress):
    from kvslim.train.eagle import draft_vocabulary, fit_eagle
    mc = model.config
    size = cfg.draft_vocab or mc.vocab_size
    head = EagleHead(EagleConfig.for_model(mc, window=cfg.window, draft_vocab_size=size,
                                           base_model_name_or_path=str(model_dir)))
    head.set_draft_vocab(draft_vocabulary([list(a) for _, a in pairs], size, mc.vocab_size, eos))
    lm_rows = lm_head.weight[head.draft_ids]
    log = fit_eagle(head, lm_rows, model.model.embed_tokens, hidden, targets, cfg,
                    show_progress)
    return head, log


def _positions(targets, prompt_lens, heads: int) -> list[tuple[int, int]]:
    """(sequence, position) whose every head's target is an answer token: position t trains
    head k on token t + k + 2, from the answer's first token on."""
    return [(i, t) for i, (ids, p) in enumerate(zip(targets, prompt_lens))
            for t in range(max(0, p - 2), len(ids) - heads - 1)]


def _fit(heads: MedusaHeads, lm_head, hidden, targets, prompt_lens, cfg, show_progress):
    positions = _positions(targets, prompt_lens, heads.num_heads)
    if not positions:
        raise KvslimError("the answers are too short to train the heads on")
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=0.0)
    offsets = torch.arange(2, heads.num_heads + 2)
    log, bar = [], tqdm(range(cfg.steps), desc="medusa heads", disable=not show_progress)
    for step in bar:
        batch = rng.sample(positions, min(cfg.batch_positions, len(positions)))
        h = torch.stack([hidden[i][t] for i, t in batch])
        want = torch.stack([targets[i][t + offsets] for i, t in batch]).T   # [heads, B]
        lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        logits = heads(h, lm_head)                                           # [heads, B, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), want.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            entry = {"step": step + 1, "loss": round(loss.item(), 4),
                     **_accuracies(logits.detach(), want)}
            log.append(entry)
            bar.set_postfix(loss=entry["loss"], top1=entry["top1"])
    return log


def _accuracies(logits: torch.Tensor, want: torch.Tensor) -> dict:
    top5 = logits.topk(5, dim=-1).indices
    return {"top1": [round(x, 3) for x in (top5[..., 0] == want).float().mean(1).tolist()],
            "top5": [round(x, 3) for x in (top5 == want[..., None]).any(-1).float()
                     .mean(1).tolist()]}
