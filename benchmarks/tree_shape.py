"""The shape of a learned drafter's tree of candidates, chosen from measured acceptance, and
what each size buys on this machine.

1. Probe: the drafter with a wide tree (Medusa: every path of ranks < --width up to the heads'
   depth, cheapest rank sums first, 63 nodes at most; EAGLE: --width guesses at each depth of its
   best chain) on the speculative study's sixteen questions, greedy, batch 1: how often each
   node lay on the accepted path.
2. For each size N of --sizes, the N nodes most often accepted (a prefix-closed tree: a child is
   never accepted more often than its parent) and their expected accepted length, 1 + the sum
   of their acceptance rates (Medusa's construction).
3. Timed runs of plain decoding, the chains k = 1..3, and each chosen tree (drafter_speedup.py's
   rows: seconds, speedup, identical greedy output, mean accepted length).

    python benchmarks/tree_shape.py DRAFTER_DIR [--model NAME] [--width 4] [--depth 3]
        [--sizes 2 4 8 16 32] [--max-tokens 64] [--json] [--out docs/drafters_tree.json]
        [--plot docs/drafters_tree.png]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
from drafter_speedup import spec_row, timed
from tqdm import tqdm

from kvslim import LLM, SamplingParams
from kvslim.drafters.kind import drafter_kind
from kvslim_lab.experiments.speculative.workloads import QUESTIONS

MAX_NODES = 63


def probe_tree(method: str, width: int, depth: int) -> list[list[int]]:
    if method == "eagle":
        return by_depth([[0] * d + [r] for d in range(depth) for r in range(width)])
    paths = [list(p) for n in range(1, depth + 1)
             for p in itertools.product(range(width), repeat=n)]
    paths.sort(key=lambda p: (sum(p), len(p), p))     # a path's prefixes sort before it
    return by_depth(paths[:MAX_NODES])


def by_depth(paths: list[list[int]]) -> list[list[int]]:
    """The order of DraftTree's nodes, which the per-node counts follow."""
    return sorted(paths, key=lambda p: (len(p), p))


def best_trees(paths: list[list[int]], accepted: list[int], verifications: int,
               sizes: list[int]) -> list[dict]:
    """Per size, the most often accepted nodes (ties: shallower first, so a parent comes
    before a child accepted as often) and the accepted length they are expected to give."""
    rate = [a / max(1, verifications) for a in accepted]
    order = sorted(range(len(paths)), key=lambda i: (-rate[i], len(paths[i]), paths[i]))
    return [{"size": n, "tree": by_depth([paths[i] for i in order[:n]]),
             "expected_accepted_length": round(1 + sum(rate[i] for i in order[:n]), 3)}
            for n in sizes if n <= len(paths)]


def run_arm(args, spec: dict, label: str, conversations, params, base_s, expected) -> dict:
    llm = LLM(args.model, kv_cache_memory="512MiB",
              speculative=spec | {"method": args.method, "model": args.drafter,
                                  "disable_by_batch_size": None})
    return spec_row(llm, label, conversations, params, 1, base_s, expected)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, marker in (("chain", "o"), ("tree", "s")):
        pts = [(r["rows"], r["speedup"]) for r in rows if r.get("kind") == kind]
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=kind)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft rows verified per step")
    ax.set_ylabel("speedup over plain decoding (batch 1)")
    ax.set_xscale("log", base=2)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("drafter")
    ap.add_argument("--model", default=None)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--plot", default=None, help="a PNG of speedup against rows per step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.method = drafter_kind(args.drafter)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    plain = LLM(args.model, kv_cache_memory="512MiB")
    timed(plain, conversations[:2], params, 1)
    base_s, expected = timed(plain, conversations, params, 1)
    rows = [{"method": "plain", "seconds": round(base_s, 2), "tokens": sum(map(len, expected))}]
    paths = probe_tree(args.method, args.width, args.depth)
    probe = run_arm(args, {"tree": paths}, f"probe ({len(paths)} nodes)", conversations, params,
                    base_s, expected)
    trees = best_trees(paths, probe["accepted_per_node"], probe["verifications"], args.sizes)
    arms = [("chain", k, {"num_speculative_tokens": k}) for k in (1, 2, 3)]
    arms += [("tree", t["size"], {"tree": t["tree"]}) for t in trees]
    for kind, n, spec in tqdm(arms, desc="timed runs"):
        row = run_arm(args, spec, f"{kind} {n}", conversations, params, base_s, expected)
        rows.append(row | {"kind": kind, "rows": n})
    result = {"drafter": args.drafter, "method": args.method, "max_tokens": args.max_tokens,
              "probe": {"tree": paths, **probe}, "chosen": trees, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        print(json.dumps(result))
        return
    print("| arm | s | identical | speedup | mean accepted | off best chain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['seconds']} | {r.get('identical', '')} | "
              f"{r.get('speedup', '')} | {r.get('mean_accepted_length', '')} | "
              f"{r.get('accepted_off_chain', '')} |")


if __name__ == "__main__":
    main()
