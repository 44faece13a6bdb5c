"""Batch-1 decode of the embedded model with each decoder layer as one native call
(kernels/decoder_layer.py) against the same layers run module by module, taking turns, and
that both give the same greedy tokens and logprobs (alone and batched).

    python benchmarks/decoder_layer.py [--rounds 2] [--json]"""
from __future__ import annotations

import argparse
import json
import time

from kvslim import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    llm = LLM(linear_activations="int8")
    layers = llm.engine.model.model.layers
    natives = [layer.native for layer in layers]

    def use(native: bool) -> None:
        for layer, n in zip(layers, natives):
            layer.native = n if native else None

    prompts = [list(range(100 + i, 160 + 7 * i)) for i in range(4)]
    check = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    answers = {}
    for native in (True, False):
        use(native)
        outs = llm.generate(prompts, check, use_tqdm=False)
        answers[native] = [(o.outputs[0].token_ids, [repr(d) for d in o.outputs[0].logprobs])
                           for o in outs]
    prompt = [list(range(100, 228))]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rates = {"native": [], "modules": []}
    for _ in range(args.rounds):
        for native in (True, False):
            use(native)
            llm.generate(prompt, params, use_tqdm=False)
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            rates["native" if native else "modules"].append(64 / (time.perf_counter() - start))
    result = {"native_layers": sum(n is not None for n in natives), "layers": len(layers),
              "same_bits": answers[True] == answers[False],
              "tok_s": {k: max(v) for k, v in rates.items()}}
    print(json.dumps(result) if args.json else
          f"{result['native_layers']}/{result['layers']} native layers, same bits: "
          f"{result['same_bits']}; batch-1 tok/s (128-token prompt, 64 new, prefill "
          f"included): native {result['tok_s']['native']:.1f}, modules "
          f"{result['tok_s']['modules']:.1f}")


if __name__ == "__main__":
    main()
