"""Batch-1 decode of the embedded model (or --model) three ways, taking turns: every layer of a
step in one native call (kernels/decoder_layer.py's stack, one hold of torch's threads), one
native call a layer, and the layers' modules one by one; and that all three give the same
greedy tokens and logprobs (alone and batched).

    python benchmarks/decoder_layer.py [--model gemma3-270m] [--rounds 2] [--json]"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from kvslim import LLM, SamplingParams

WAYS = ("stack", "layers", "modules")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, linear_activations="int8")
    model = llm.engine.model.model
    layers, stack = model.layers, model.native
    natives = [layer.native for layer in layers]

    def use(way: str) -> None:
        model.native = stack if way == "stack" else None
        for layer, n in zip(layers, natives):
            layer.native = None if way == "modules" else n

    prompts = [list(range(100 + i, 160 + 7 * i)) for i in range(4)]
    check = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    answers = {}
    for way in WAYS:
        use(way)
        outs = llm.generate(prompts, check, use_tqdm=False)
        answers[way] = [(o.outputs[0].token_ids, [repr(d) for d in o.outputs[0].logprobs])
                        for o in outs]
    prompt = [list(range(100, 228))]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rates = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            use(way)
            llm.generate(prompt, params, use_tqdm=False)
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            rates[way].append(64 / (time.perf_counter() - start))
    use("stack")
    result = {"model": args.model or "SmolLM2-135M-Instruct (shipped Q4_1)",
              "native_layers": sum(n is not None for n in natives), "layers": len(layers),
              "stack": stack is not None,
              "same_bits": answers["stack"] == answers["layers"] == answers["modules"],
              "tok_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
              "rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()}}
    t = result["tok_s"]
    print(json.dumps(result) if args.json else
          f"{result['model']}: {result['native_layers']}/{result['layers']} native layers, "
          f"stack {result['stack']}, same bits: {result['same_bits']}; batch-1 tok/s (128-token "
          f"prompt, 64 new, prefill included, median of {args.rounds}): one call a step "
          f"{t['stack']}, one a layer {t['layers']}, modules {t['modules']}")


if __name__ == "__main__":
    main()
