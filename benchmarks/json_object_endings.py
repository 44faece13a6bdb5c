"""How often does a small model finish a `json_object` answer? The fifty chat prompts of
lab/kvslim_lab/bench/schema_suite.py, each answered greedily with response_format json_object (any JSON
object, no schema) within --max-tokens: counts of answers that end by themselves, of answers
whose JSON kvslim closed because max_tokens was near (finish_reason "length"), and of answers
that parse (all of them, if the grammar and the closing keep their promise).

    python benchmarks/json_object_endings.py [--model NAME_OR_DIR] [--max-tokens 300] [--json]
"""
from __future__ import annotations

import argparse
import json

from kvslim import LLM, SamplingParams
from kvslim_lab.bench.schema_suite import schema_suite


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
    texts = [o.outputs[0].text for o in outs]
    reasons = [o.outputs[0].finish_reason for o in outs]
    parsed = sum(_parses(t) for t in texts)
    result = {"model": str(llm.model_dir), "answers": len(cases),
              "ended": reasons.count("stop"), "closed_at_budget": reasons.count("length"),
              "parsed": parsed, "unparsed": [t for t in texts if not _parses(t)],
              "max_tokens": args.max_tokens}
    print(json.dumps(result) if args.json else
          f"{result['answers']} answers: {result['ended']} ended by themselves, "
          f"{result['closed_at_budget']} closed as max_tokens={args.max_tokens} neared; "
          f"{parsed} parse")


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


if __name__ == "__main__":
    main()
