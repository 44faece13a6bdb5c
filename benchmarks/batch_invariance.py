"""Does a greedy answer depend on what else is in the batch? For each mode of the embedded
SmolLM2-135M, N chat prompts are generated together (one batch) and each alone; a prompt counts
as invariant when its tokens are the same, and as bit-identical when every chosen token's
logprob is too (every step's logits equal).

    python benchmarks/batch_invariance.py [--modes q4_1,f32,w8a8] [--prompts 24] [--tokens 48] \
        [--threads 2] [--json]

Modes: q4_1 (the shipped Q4_1 blocks, what LLM() runs), f32 (the float32 import), w8a8
(kvslim's W8A8 checkpoint of the float32 import, as `kvslim bench peers` makes it); `+gather`
after a mode runs it with attention_backend="gather" (torch's SDPA over the gathered context)
instead of the CPU default, kvslim's decode kernel. With KVSLIM_NO_EXTENSION=1 every mode runs
torch's kernels instead of kvslim's."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from kvslim import LLM, SamplingParams
from kvslim_lab.bench.peers.catalog import float_dir, shipped_dir, w8a8_dir
from kvslim.paths import kvslim_home

TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "honey bees", "the piano",
          "glaciers", "lighthouses", "tea", "comets", "owls", "maps", "bridges", "coral",
          "windmills", "paper", "thunder", "libraries", "salt", "kites", "deserts", "clocks",
          "whales", "mushrooms", "trains", "silk", "caves", "rainbows", "bicycles", "ink", "ice"]


def prompts(n: int) -> list[list[dict]]:
    styles = ["Tell me one fact about {}.", "Write two sentences about {}.",
              "Why do people like {}?", "Describe {} to a child."]
    return [[{"role": "user", "content": styles[i % len(styles)].format(TOPICS[i % len(TOPICS)])}]
            for i in range(n)]


def model_of(mode: str) -> str:
    base = mode.split("+")[0]
    if base == "q4_1":
        return str(shipped_dir())
    if base == "f32":
        return str(float_dir())
    if base == "w8a8":
        return str(w8a8_dir(kvslim_home() / "peers"))
    raise SystemExit(f"unknown mode {mode!r}: q4_1, f32, w8a8, each optionally +gather")


def measure(mode: str, chats: list, tokens: int) -> dict:
    backend = "gather" if mode.endswith("+gather") else "auto"
    llm = LLM(model_of(mode), max_num_seqs=len(chats), attention_backend=backend)
    params = SamplingParams(max_tokens=tokens, temperature=0, logprobs=0, ignore_eos=True)

    def answers(batch):
        outs = llm.chat(batch, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                for o in outs]
    together = answers(chats)
    alone = [answers([c])[0] for c in chats]
    same_tokens = sum(t[0] == a[0] for t, a in zip(together, alone))
    same_bits = sum(t == a for t, a in zip(together, alone))
    attention = llm.engine.runner.attention_backend
    llm.shutdown()
    return dict(mode=mode, prompts=len(chats), tokens=tokens, attention=attention,
                same_tokens=same_tokens, bit_identical=same_bits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="q4_1,f32,w8a8")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chats = prompts(args.prompts)
    rows = []
    for mode in args.modes.split(","):
        rows.append(measure(mode, chats, args.tokens))
        r = rows[-1]
        print(f"[invariance] {mode}: tokens {r['same_tokens']}/{r['prompts']}, bits "
              f"{r['bit_identical']}/{r['prompts']}", file=sys.stderr, flush=True)
    result = dict(command="python benchmarks/batch_invariance.py " + " ".join(sys.argv[1:]),
                  rows=rows)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("| mode | attention | prompts | greedy tokens batched == alone | logprobs "
              "bit-identical |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['mode']} | {r['attention']} | {r['prompts']} | {r['same_tokens']} | "
                  f"{r['bit_identical']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
