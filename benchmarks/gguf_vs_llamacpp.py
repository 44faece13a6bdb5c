"""Batch-1 decode of one GGUF file by kvslim and by llama.cpp, in the same run: kvslim runs the
file's own blocks (what `LLM(file)` runs), llama.cpp's `llama-bench` the same file; each cell
is the median of `--rounds` interleaved rounds (every engine takes its turn in each round, so a
shared machine's drift hits both alike).

    python benchmarks/gguf_vs_llamacpp.py [--model gemma3-270m | FILE.gguf] [--rounds 3] \
        [--input-len 128] [--decode-len 64] [--threads 2] [--modes float32,int8] \
        [--llamacpp-bin .cache/llamacpp/build/bin] [--json] [--out FILE.json]

--modes are kvslim's linear activations (`--linear-activations`): float32 (the default) and
int8 (llama.cpp's own arithmetic). The prompt is `--input-len` token ids already in the cache
(llama-bench's -d, kvslim's prefill left out of the decode rate)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from kvslim import LLM, SamplingParams
from kvslim_lab.bench.llamacpp_tools import DEFAULT_BIN, LlamaCppTools
from kvslim_lab.bench.machine import machine_info
from kvslim.formats.registry import GEMMA3_ALIASES, gemma3_gguf


def gguf_path(model: str) -> Path:
    return gemma3_gguf() if model in GEMMA3_ALIASES else Path(model)


def kvslim_decoder(model: str, mode: str, input_len: int, decode_len: int):
    llm = LLM(model, linear_activations=mode, max_num_seqs=1)
    vocab = llm.engine.model_config.vocab_size
    prompt = torch.randint(10, vocab - 10, (input_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=decode_len, temperature=0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    def tokens_per_s() -> float:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return 1 / out.metrics.time_per_output_token
    return llm, tokens_per_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="float32,int8")
    ap.add_argument("--llamacpp-bin", default=DEFAULT_BIN)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tools = LlamaCppTools(Path(args.llamacpp_bin), args.threads)
    if tools.missing():
        raise SystemExit(tools.missing())
    gguf = gguf_path(args.model)
    engines = {f"kvslim ({m} activations)": kvslim_decoder(args.model, m, args.input_len,
                                                           args.decode_len)[1]
               for m in args.modes.split(",")}
    engines["llama.cpp"] = lambda: tools.decode_tokens_per_s(gguf, args.input_len,
                                                             args.decode_len, repeats=1)
    speeds = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, run in engines.items():
            speeds[name].append(run())
            print(f"[round {r + 1}] {name}: {speeds[name][-1]:.1f} tok/s", file=sys.stderr)
    best_llama = statistics.median(speeds["llama.cpp"])
    rows = [{"engine": name, "tokens_per_s": round(statistics.median(v), 1),
             "rounds": [round(x, 1) for x in v],
             "vs_llamacpp": round(statistics.median(v) / best_llama, 2)}
            for name, v in speeds.items()]
    result = {"command": "python benchmarks/gguf_vs_llamacpp.py " + " ".join(sys.argv[1:]),
              "file": gguf.name, "input_len": args.input_len, "decode_len": args.decode_len,
              "threads": args.threads, "machine": machine_info().to_dict(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{gguf.name}, batch-1 decode after {args.input_len} tokens, {args.threads} threads")
    print("| engine | tok/s (median) | rounds | vs llama.cpp |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['tokens_per_s']} | {r['rounds']} | {r['vs_llamacpp']}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
