"""`kvslim plan-kv`: spend a KV memory budget across layers by measured loss. Each layer's
sensitivity to each setting (a precision, with or without sinks + a window) is measured on
calibration text (eval/kv_sensitivity.py); the exact one-setting-per-layer plan that fits
`--kv-memory` for `--concurrency` sequences of `--context` tokens with the least summed KL is
compiled (kv_cache/budget.py), then measured with every layer at its setting at once.
plan.json records the choice, its bytes, KL and capacity: `max_tokens`, what the engine that
runs it (`--kv-plan plan.json` with the `engine_options` it names) reports, computed by the
engine's own sizing (kv_cache/plan.py's pools)."""
from __future__ import annotations

import json
from pathlib import Path

from kvslim.errors import KvslimError

PRECISIONS = ("auto", "int8", "int4", "int2")


def register(sub) -> None:
    p = sub.add_parser("plan-kv", help="per-layer KV precision and window for a memory budget, "
                                       "chosen by measured loss")
    p.add_argument("model", metavar="MODEL", help="model directory (HF format)")
    p.add_argument("--kv-memory", required=True, help="KV-cache budget, e.g. 256MiB")
    p.add_argument("--context", type=int, required=True, help="tokens per sequence")
    p.add_argument("--concurrency", type=int, default=1, help="sequences at once (default 1)")
    p.add_argument("--windows", default="256,1024",
                   help="window sizes to consider (sinks + W tokens kept), comma-separated")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens of a window (default 4)")
    p.add_argument("--calibration", required=True, help="a text file to measure on")
    p.add_argument("--tokens", type=int, default=256, help="tokens per calibration window")
    p.add_argument("--batches", type=int, default=2, help="calibration windows (default 2)")
    p.add_argument("--out", default=None, help="write the plan here (JSON)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan_kv)


def _settings(args, context: int) -> list:
    """Every precision with and without each window; a window is only offered where it
    drops tokens both of the context and of the calibration windows (a window as long as
    the calibration text would measure no loss)."""
    from kvslim.kv_cache.budget import KVSetting
    windows = [int(w) for w in args.windows.split(",") if w.strip()]
    if any(w < 1 for w in windows) or args.sinks < 0:
        raise KvslimError("--windows must be positive token counts, --sinks at least 0")
    return [KVSetting(p, w) for p in PRECISIONS for w in [None, *windows]
            if w is None or args.sinks + w < min(context, args.tokens)]


def _calibration(tokenizer, path: str, tokens: int, batches: int):
    import torch
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    ids = tokenizer.encode(text)
    if len(ids) < tokens * batches:
        raise KvslimError(f"--calibration has {len(ids)} tokens; {tokens * batches} needed "
                          f"(--tokens x --batches)")
    return [torch.tensor([ids[i * tokens:(i + 1) * tokens]]) for i in range(batches)]


def run_plan_kv(args) -> int:
    from tqdm import tqdm

    from kvslim.engine.config import parse_bytes
    from kvslim.eval.kv_sensitivity import layer_sensitivity, plan_kl
    from kvslim.formats.loader import load_model
    from kvslim.kv_cache.budget import compile_plan, sequence_bytes
    from kvslim.tokenizer.tokenizer import Tokenizer
    memory, block = parse_bytes(args.kv_memory), 16
    if args.context < 2 or args.concurrency < 1:
        raise KvslimError("--context must be at least 2 and --concurrency at least 1")
    model = load_model(args.model, dtype="float32", device="cpu")
    batches = _calibration(Tokenizer.from_dir(args.model), args.calibration, args.tokens,
                           args.batches)
    settings = _settings(args, args.context)
    n = model.config.num_hidden_layers
    with tqdm(total=n * len(batches), desc="layers measured", disable=args.json) as bar:
        losses = layer_sensitivity(model, batches, settings, args.sinks, block, bar)
    options = [{s: (sequence_bytes(model.config, layer, s, _storage(s), args.context,
                                   args.sinks, block), losses[layer][s]) for s in settings}
               for layer in range(n)]
    chosen, used, predicted = compile_plan(options, memory // args.concurrency)
    plan = {"model": str(args.model), "context": args.context, "concurrency": args.concurrency,
            "kv_memory": memory, "block_size": block,
            "layers": [{"precision": s.precision, "window": s.window} for s in chosen],
            "sinks": args.sinks, "bytes_per_sequence": used,
            "engine_options": {"kv_cache_memory": memory, "max_num_seqs": args.concurrency},
            "predicted_kl": predicted,
            "measured_kl": plan_kl(model, batches, chosen, args.sinks, block)}
    plan["max_tokens"] = _engine_capacity(model, plan)
    if args.out:
        Path(args.out).write_text(json.dumps(plan, indent=2))
    print(json.dumps(plan, indent=2) if args.json else _table(plan))
    return 0


def _engine_capacity(model, plan: dict) -> int:
    """The token slots the engine running this plan reports (kv_cache_stats().max_tokens):
    its own sizing of the plan's pools."""
    import tempfile

    from kvslim.engine.config import EngineConfig
    from kvslim.engine.model_runner import kv_cache_plan_of
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        path.write_text(json.dumps(plan))
        config = EngineConfig(kv_plan=str(path), **plan["engine_options"])
        return kv_cache_plan_of(model, config).max_tokens


def _storage(setting):
    """The torch-side name the byte formulas take for a setting's precision ("auto": float32,
    what the dense pass measured)."""
    return "float32" if setting.precision == "auto" else setting.precision


def _table(plan: dict) -> str:
    rows = [f"| {i} | {l['precision']} | {l['window'] or 'all'} |"
            for i, l in enumerate(plan["layers"])]
    return "\n".join([
        f"KV plan for {plan['concurrency']} x {plan['context']} tokens in "
        f"{plan['kv_memory']} bytes: {plan['bytes_per_sequence']} bytes a sequence, "
        f"{plan['max_tokens']} token slots; KL predicted {plan['predicted_kl']:.4f}, "
        f"measured {plan['measured_kl']:.4f}", "| layer | precision | window |", "|---|---|---|",
        *rows])
