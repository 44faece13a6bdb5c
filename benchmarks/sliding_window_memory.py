"""Sliding windows that free memory, measured: one long greedy generation on a model with window
layers (Gemma 3 270M: 15 of 18 layers see 512 tokens), run twice in one process — releasing the
blocks that fell out of the windows (the default) and keeping every block (the mask-only path,
`--keep-out-of-window-blocks`) — on the same prompt tokens. Reports the KV blocks and bytes the
sequence holds as its context grows, the planner's figure at the final context, the step times,
and whether both runs produced the same tokens.

    python benchmarks/sliding_window_memory.py --model gemma3-270m --prompt-tokens 2048 \
        --max-tokens 128 --plot docs/img/sliding_window_memory.png --json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.sampling_params import SamplingParams
from kvslim.formats.registry import resolve_model
from kvslim.models.config import ModelConfig
from kvslim.plan.memory import plan_memory

FALLBACK_TEXT = ("It is a truth universally acknowledged, that a single man in possession of a "
                 "good fortune, must be in want of a wife. ") * 400


def prompt_ids(engine: LLMEngine, text_path: Path | None, num_tokens: int) -> list[int]:
    text = text_path.read_text(errors="ignore") if text_path and text_path.is_file() \
        else FALLBACK_TEXT
    ids = engine.tokenizer.encode(text)
    while len(ids) < num_tokens:
        ids = ids + ids
    return ids[:num_tokens]


def run_once(model_dir: Path, keep: bool, ids: list[int] | None, args) -> dict:
    config = EngineConfig(kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                          max_num_batched_tokens=args.chunk, keep_out_of_window_blocks=keep)
    engine = LLMEngine(model_dir, config)
    ids = ids or prompt_ids(engine, args.text, args.prompt_tokens)
    engine.add_request(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                           ignore_eos=True))
    curve, decode_times, prefill_time, out = [], [], 0.0, None
    page = engine.runner.bytes_per_block
    with tqdm(total=len(ids) + args.max_tokens, desc="keep" if keep else "free",
              file=sys.stderr) as bar:
        while engine.has_unfinished_requests():
            seq = engine.scheduler.running[0] if engine.scheduler.running else None
            decoding = seq is not None and seq.num_uncomputed_tokens == 1
            start = time.perf_counter()
            for o in engine.step():
                out = o
            elapsed = time.perf_counter() - start
            (decode_times.append if decoding else lambda t: None)(elapsed)
            prefill_time += 0 if decoding else elapsed
            if engine.scheduler.running:
                seq = engine.scheduler.running[0]
                held = sum(engine.block_manager.blocks_held(seq))
                curve.append((seq.num_computed_tokens, held * page))
                bar.n = seq.num_computed_tokens
                bar.refresh()
    decode_times.sort()
    return {"keep_out_of_window_blocks": keep, "tokens": out.outputs[0].token_ids,
            "ids": ids, "groups": len(engine.runner.kv_groups.groups),
            "bytes_per_block": page, "final_context": curve[-1][0],
            "final_kv_bytes": curve[-1][1], "peak_kv_bytes": max(b for _, b in curve),
            "prefill_s": round(prefill_time, 2),
            "decode_ms_median": round(1000 * decode_times[len(decode_times) // 2], 1),
            "decode_tok_s": round(len(decode_times) / sum(decode_times), 2), "curve": curve}


def measure(args) -> dict:
    model_dir = resolve_model(args.model)
    free = run_once(model_dir, False, None, args)
    keep = run_once(model_dir, True, free["ids"], args)
    spec = ModelConfig.from_dir(model_dir, runnable=False)
    plan = plan_memory(spec, context=free["final_context"], block_size=args.block_size,
                       kv_dtype="fp32")
    windows = sorted({g.window for g in plan.kv_groups if g.window})
    rows = [{k: v for k, v in r.items() if k not in ("ids", "tokens", "curve")}
            for r in (free, keep)]
    return {"model": args.model, "prompt_tokens": len(free["ids"]),
            "max_tokens": args.max_tokens, "block_size": args.block_size, "chunk": args.chunk,
            "windows": windows, "same_tokens": free["tokens"] == keep["tokens"],
            "planner_kv_bytes": sum(g.bytes for g in plan.kv_groups),
            "planner_kv_bytes_every_block": plan.kv_bytes_per_token * -(
                -free["final_context"] // args.block_size) * args.block_size,
            "rows": rows, "curves": {"free": free["curve"], "keep": keep["curve"]}}


def markdown(r: dict) -> str:
    lines = [f"{r['model']}, prompt {r['prompt_tokens']:,} tokens + {r['max_tokens']} greedy, "
             f"blocks of {r['block_size']}, prefill chunks of {r['chunk']}, windows "
             f"{r['windows']}; same tokens in both runs: {r['same_tokens']}", "",
             "| out-of-window blocks | KV held at the end | peak | planner | prefill s | "
             "decode ms/token (median) |", "|---|---:|---:|---:|---:|---:|"]
    for row, planned in zip(r["rows"], (r["planner_kv_bytes"],
                                        r["planner_kv_bytes_every_block"])):
        mode = "kept (mask only)" if row["keep_out_of_window_blocks"] else "released"
        lines.append(f"| {mode} | {row['final_kv_bytes'] / 2**20:.1f} MiB | "
                     f"{row['peak_kv_bytes'] / 2**20:.1f} MiB | {planned / 2**20:.1f} MiB | "
                     f"{row['prefill_s']} | {row['decode_ms_median']} |")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, label in (("keep", "every block kept (window as a mask)"),
                        ("free", "out-of-window blocks released")):
        xs, ys = zip(*r["curves"][name])
        ax.plot(xs, [y / 2**20 for y in ys], label=label, lw=2)
    ax.set_xlabel("tokens in the sequence")
    ax.set_ylabel("KV cache held, MiB")
    ax.set_title(f"{r['model']}: KV held by one sequence (windows {r['windows']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--text", type=Path, default=Path("../shared/corpus/test.txt"),
                   help="prompt text (a built-in sentence repeated when the file is missing)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--plot", type=Path, help="PNG of KV held vs context")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = measure(args)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=2))
    else:
        print(markdown(result))
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
