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
    p.add_argument("--windows", default=None,
                   help="window sizes to consider (sinks + W tokens kept), comma-separated "
                        "(default 1/16, 1/4, 1/2 and 3/4 of --context)")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens of a window (default 4)")
    p.add_argument("--calibration", required=True, help="a text file to measure on")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per calibration window (default --context: a window's loss is "
                        "what it drops of a whole sequence)")
    p.add_argument("--batches", type=int, default=1, help="calibration windows (default 1)")
    p.add_argument("--out", default=None, help="write the plan here (JSON)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan_kv)


def _settings(args, context: int, tokens: int) -> list:
    """Every precision with and without each window; a window is only offered where it
    drops tokens both of the context and of the calibration windows (a window as long as
    the calibration text would measure no loss)."""
    from kvslim.kv_cache.budget import KVSetting, default_windows
    windows = ([int(w) for w in args.windows.split(",") if w.strip()] if args.windows
               else default_windows(context))
    if any(w < 1 for w in windows) or args.sinks < 0:
        raise KvslimError("--windows must be positive token counts, --sinks at least 0")
    return [KVSetting(p, w) for p in PRECISIONS for w in [None, *windows]
            if w is None or args.sinks + w < min(context, tokens)]


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
    from kvslim.kv_cache.budget import sequence_bytes
    from kvslim.tokenizer.tokenizer import Tokenizer
    memory, block = parse_bytes(args.kv_memory), 16
    if args.context < 2 or args.concurrency < 1:
        raise KvslimError("--context must be at least 2 and --concurrency at least 1")
    tokens = args.tokens or args.context
    model = load_model(args.model, dtype="float32", device="cpu")
    batches = _calibration(Tokenizer.from_dir(args.model), args.calibration, tokens,
                           args.batches)
    settings = _settings(args, args.context, tokens)
    n = model.config.num_hidden_layers
    with tqdm(total=n * len(batches), desc="layers measured", disable=args.json) as bar:
        losses = layer_sensitivity(model, batches, settings, args.sinks, block, bar)
    options = [{s: (sequence_bytes(model.config, layer, s, _storage(s), args.context,
                                   args.sinks, block), losses[layer][s]) for s in settings}
               for layer in range(n)]
    chosen, used, predicted = _compile_for_engine(model.config, options, memory, args.concurrency,
                                                  block)
    plan = {"model": str(args.model), "context": args.context, "concurrency": args.concurrency,
            "kv_memory": memory, "block_size": block,
            "layers": [{"precision": s.precision, "window": s.window} for s in chosen],
            "sinks": args.sinks, "bytes_per_sequence": used,
            "engine_options": {"kv_cache_memory": memory, "max_num_seqs": args.concurrency},
            "predicted_kl": predicted,
            "measured_kl": plan_kl(model, batches, chosen, args.sinks, block)}
    try:
        plan["max_tokens"] = _engine_capacity(model, plan)
    except KvslimError as e:        # the packed layers' recent rows leave no room for a block
        plan["max_tokens"], plan["engine_error"] = 0, str(e)
    if args.out:
        Path(args.out).write_text(json.dumps(plan, indent=2))
    print(json.dumps(plan, indent=2) if args.json else _table(plan))
    return 0


def _compile_for_engine(config, options, memory: int, concurrency: int, block: int):
    """compile_plan within what the engine leaves of `memory` for blocks: its packed layers'
    recent rows (kv_cache/plan.py) come out of the same budget, and depend on which layers the
    plan packs, so the plan is compiled again within the rest until that stops growing."""
    from types import SimpleNamespace

    from kvslim.dtypes import packed_kv_bits
    from kvslim.kv_cache.budget import compile_plan
    from kvslim.kv_cache.plan import packed_recent_bytes, recent_blocks
    options_of_engine = SimpleNamespace(speculative=None)
    reserve = 0
    for _ in range(len(options) + 1):
        chosen, used, predicted = compile_plan(options, (memory - reserve) // concurrency)
        packed = [s.precision for s in chosen if packed_kv_bits(s.precision)]
        needed = sum(packed_recent_bytes(config, block, concurrency,
                                         recent_blocks(options_of_engine, p)) // len(chosen)
                     for p in packed)
        if needed <= reserve:
            return chosen, used, predicted
        reserve = needed
    return chosen, used, predicted


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
