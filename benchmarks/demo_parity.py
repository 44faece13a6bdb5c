"""Greedy answers of `kvslim demo`'s sixteen conversations from two imports of one model (by
default the embedded model's quantized import, what `LLM()` runs, and its float32 import, what
`LLM(dtype="float32")` runs): which answers are the same, and for each that is not, the first
differing position and the float model's top-1 vs top-2 logit margin there (how close to a tie
the float model itself was). A base model without a chat template (Gemma 3 270M) gets the
questions as plain prompts, as `kvslim demo` gives them.

    python benchmarks/demo_parity.py [--model gemma3-270m | --quantized DIR --float DIR]
        [--max-tokens 96] [--json]
"""
from __future__ import annotations

import argparse
import json

import torch

from kvslim.demo import as_plain_prompt, demo_conversations
from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams
from kvslim.formats.loader import load_model
from kvslim.formats.registry import engine_model_dir


def answers(model_dir: str, convs, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory="256MiB")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if llm.tokenizer.chat_template:
        outs = llm.chat(convs, params, use_tqdm=False)
    else:
        outs = llm.generate([as_plain_prompt(c) for c in convs], params, use_tqdm=False)
    return [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs]


@torch.no_grad()
def margin_at(model, prompt: list[int], prefix: list[int], other: int) -> dict:
    """The float model's logits after prompt + prefix: its top two and the other model's pick."""
    logits = model.logits(torch.tensor([prompt + prefix]))[0, -1].float()
    top = logits.topk(2)
    return {"float_top1": int(top.indices[0]), "float_top2": int(top.indices[1]),
            "margin": round(float(top.values[0] - top.values[1]), 4),
            "quantized_pick": other,
            "quantized_pick_margin": round(float(top.values[0] - logits[other]), 4)}


def compare(quantized: str, dense: str, max_tokens: int) -> dict:
    convs = demo_conversations()
    prompts, got_q = answers(quantized, convs, max_tokens)
    _, got_f = answers(dense, convs, max_tokens)
    model = load_model(dense, dtype=torch.float32)
    rows = []
    for i, (p, q, f) in enumerate(zip(prompts, got_q, got_f)):
        row = {"prompt": convs[i][-1]["content"], "same": q == f, "tokens": len(f)}
        if q != f:
            pos = next((k for k, (a, b) in enumerate(zip(q, f)) if a != b), min(len(q), len(f)))
            row["first_difference"] = pos
            if pos < min(len(q), len(f)):
                row.update(margin_at(model, p, f[:pos], q[pos]))
        rows.append(row)
    return {"quantized": quantized, "float": dense, "max_tokens": max_tokens,
            "same": sum(r["same"] for r in rows), "prompts": len(rows), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model name or .gguf whose two imports to "
                                                  "compare (default: the embedded model)")
    ap.add_argument("--quantized", default=None, help="default: the model's quantized import")
    ap.add_argument("--float", dest="dense", default=None, help="default: its float32 import")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quantized = args.quantized or str(engine_model_dir(args.model, "auto"))
    dense = args.dense or str(engine_model_dir(args.model, "float32"))
    result = compare(quantized, dense, args.max_tokens)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['same']} of {result['prompts']} greedy answers identical "
          f"({result['max_tokens']} tokens at most)")
    for r in result["rows"]:
        if not r["same"]:
            print(f"  {r['prompt']!r}: first difference at token {r['first_difference']}, "
                  f"float margin top1-top2 {r.get('margin')}, quantized pick "
                  f"{r.get('quantized_pick_margin')} below the float top-1")


if __name__ == "__main__":
    main()
