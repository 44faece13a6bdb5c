"""`kvslim train-tokenizer` and `kvslim train`."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from kvslim.cli.engine_args import add_engine_flags
from kvslim.train.train_config import ModelShape, PRESETS, TrainConfig, shape_from_preset


def register(sub) -> None:
    p = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer")
    p.add_argument("--data", required=True, nargs="+", help="text file(s)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run_train_tokenizer)

    p = sub.add_parser("train", help="train a Llama-family model from scratch")
    p.add_argument("--data", required=True, help="training text file")
    p.add_argument("--valid", help="validation text file")
    p.add_argument("--out", required=True, help="output model directory (HF format)")
    p.add_argument("--tokenizer", help="directory with tokenizer.json (default: train one)")
    p.add_argument("--vocab-size", type=int, default=8192, help="when training the tokenizer")
    p.add_argument("--preset", choices=sorted(PRESETS), help="named model shape")
    p.add_argument("--layers", type=int, help="num_hidden_layers")
    p.add_argument("--hidden", type=int, help="hidden_size")
    p.add_argument("--heads", type=int, help="num_attention_heads")
    p.add_argument("--kv-heads", type=int, help="num_key_value_heads (default: = heads)")
    p.add_argument("--intermediate", type=int, help="intermediate_size")
    p.add_argument("--untied", action="store_true", help="separate lm_head and embeddings")
    add_loop_args(p, steps=1000, lr=3e-3, warmup=100)
    p.set_defaults(func=run_train)


def add_loop_args(p, steps: int, lr: float, warmup: int) -> None:
    p.add_argument("--seq-len", type=int, help="training window (default: preset's, or 256)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=warmup)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    add_engine_flags(p, "dtype", dtype=dict(default="float32", choices=["float32", "bfloat16"],
                                            help="training dtype (default float32)"))
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--device", default="auto")
    p.add_argument("--resume", action="store_true", help="continue from OUT/trainer_state.pt")
    p.add_argument("--compile-step", action="store_true",
                   help="torch.compile the loss's forward and backward (the first steps pay the "
                        "compilation; benchmarks/train_compile.py measures whether it pays)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print final metrics as JSON")


def loop_kwargs(args) -> dict:
    return dict(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum,
                lr=args.lr, min_lr_ratio=args.min_lr_ratio, warmup_steps=args.warmup_steps,
                weight_decay=args.weight_decay, grad_clip=args.grad_clip, dtype=args.dtype,
                eval_every=args.eval_every, eval_windows=args.eval_windows,
                save_every=args.save_every, log_every=args.log_every, seed=args.seed,
                threads=args.threads,
                device=args.device, resume=args.resume, compile_step=args.compile_step)


def run_train_tokenizer(args) -> int:
    from kvslim.train.tokenizer_train import train_tokenizer
    tok = train_tokenizer(args.data, args.vocab_size, args.out)
    print(f"wrote {Path(args.out) / 'tokenizer.json'} ({tok.get_vocab_size()} tokens)")
    return 0


def run_train(args) -> int:
    from kvslim.train.trainer import train
    shape, seq_len = shape_from_preset(args.preset) if args.preset else (ModelShape(), 256)
    overrides = {"num_hidden_layers": args.layers, "hidden_size": args.hidden,
                 "num_attention_heads": args.heads, "intermediate_size": args.intermediate,
                 "num_key_value_heads": args.kv_heads or args.heads}
    for k, v in overrides.items():
        if v is not None:
            setattr(shape, k, v)
    shape.tie_word_embeddings = not args.untied
    cfg = TrainConfig(data=args.data, valid=args.valid, out=args.out, tokenizer=args.tokenizer,
                      vocab_size=args.vocab_size, shape=shape,
                      seq_len=args.seq_len or seq_len, **loop_kwargs(args))
    record_command(args.out)
    metrics = train(cfg, show_progress=not args.quiet)
    print(json.dumps(metrics) if args.json else f"done: {metrics}")
    return 0


def record_command(out: str) -> None:
    """Keep the exact command beside the model, so that the checkpoint can be reproduced."""
    Path(out).mkdir(parents=True, exist_ok=True)
    line = "kvslim " + " ".join(shlex.quote(a) for a in sys.argv[1:]) + "\n"
    with (Path(out) / "train_command.txt").open("a") as f:
        f.write(line)
