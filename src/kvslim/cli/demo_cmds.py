"""`kvslim demo`: the README's main job."""
from __future__ import annotations

import json

from kvslim.cli.engine_args import add_engine_args, llm_from_args


def register(sub) -> None:
    p = sub.add_parser("demo", help="16 chat requests as one continuous batch, with a report")
    p.add_argument("--model", default=None,
                   help="model directory or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--json", action="store_true", help="print the report as JSON only")
    add_engine_args(p, kv_cache_memory="512MiB", max_num_seqs=16)
    p.set_defaults(func=run)


def run(args) -> int:
    from kvslim.demo import run_demo
    llm = llm_from_args(args)
    convs, outputs, report = run_demo(llm, args.max_tokens, use_tqdm=not args.json)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    for conv, out in zip(convs, outputs):
        system = " [shared system prompt]" if conv[0]["role"] == "system" else ""
        print(f"\n>>> {conv[-1]['content']}{system}\n{out.outputs[0].text.strip()}")
    r = report
    print(f"""
== kvslim demo: {r.requests} requests, one continuous batch ==
output tokens       {r.output_tokens} in {r.seconds:.1f} s  ->  {r.output_tokens_per_s:.1f} tokens/s
prompt tokens       {r.prompt_tokens}
KV cache            {r.kv_bytes_per_token:,} bytes per token ({r.kv_dtype}); \
{r.blocks_peak_used} of {r.blocks_total} blocks of {r.block_size} tokens at peak
concurrency         {r.peak_concurrent_sequences} sequences in one step at peak
prefix cache        {r.prefix_cache_hit_rate:.1%} of prompt tokens served from cache \
({r.prefix_cache_hit_tokens} tokens)
time to 1st token   {r.mean_time_to_first_token_s:.2f} s on average""")
    return 0
