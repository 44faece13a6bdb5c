"""How often does a small model finish a `json_object` answer? The fifty chat prompts of
structured/schema_suite.py, each answered greedily with response_format json_object (any JSON
object, no schema) within --max-tokens: counts of answers that end by themselves, of those that
parse (the grammar promises all of them), and of those cut at max_tokens.

    python benchmarks/json_object_endings.py [--model NAME_OR_DIR] [--max-tokens 300] [--json]
"""
from __future__ import annotations

import argparse
import json

from kvslim import LLM, SamplingParams
from kvslim.structured.schema_suite import schema_suite


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory="1GiB")
    cases = schema_suite()
    outs = llm.chat([[{"role": "user", "content": c.prompt}] for c in cases],
                    SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                   structured_outputs={"json_object": True}), use_tqdm=True)
    ended = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    parsed = 0
    for text in ended:
        try:
            parsed += isinstance(json.loads(text), dict)
        except ValueError:
            pass
    result = {"model": str(llm.model_dir), "answers": len(cases), "ended": len(ended),
              "ended_and_parsed": parsed, "cut_at_max_tokens": len(cases) - len(ended),
              "max_tokens": args.max_tokens}
    print(json.dumps(result) if args.json else
          f"{result['answers']} answers: {result['ended']} ended ({parsed} parse), "
          f"{result['cut_at_max_tokens']} cut at max_tokens={args.max_tokens}")


if __name__ == "__main__":
    main()
