"""Speed of two revisions of kvslim, interleaved: did a change (a refactor, a new code path)
leave batch-1 decoding and offline throughput where they were?

Each revision is checked out into a temporary worktree and run from its own `src/` by the same
interpreter, with its own KVSLIM_HOME (each imports the default model itself). In every round
both revisions run `kvslim bench latency` (batch 1) and `kvslim bench throughput` one after the
other, so that a change in the machine's load hits both; the tables show medians over rounds.

    python benchmarks/before_after.py --before 1c71cf1            # against the working tree
    python benchmarks/before_after.py --before A --after B --rounds 5 --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
WORKTREE = "WORKTREE"                      # --after's default: the files as they are now


def checkout(rev: str, root: Path) -> Path:
    if rev == WORKTREE:
        return REPO
    path = root / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(path), rev],
                   check=True)
    return path


def bench(tree: Path, home: Path, args: list[str]) -> dict:
    # Its own kvslim and, from the split on, its own lab (which adds `kvslim bench`).
    path = os.pathsep.join(str(tree / d) for d in ("src", "lab") if (tree / d).is_dir())
    env = dict(os.environ, PYTHONPATH=path, KVSLIM_HOME=str(home))
    done = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "bench", *args, "--json"],
                          capture_output=True, text=True, env=env, cwd=tree)
    if done.returncode:
        raise SystemExit(f"{tree}: kvslim bench {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def workloads(opts) -> dict[str, tuple[list[str], callable]]:
    """name -> (bench arguments, what to read from the JSON)."""
    latency = ["latency", "--batches", "1", "--input-len", "128", "--output-len", "64",
               "--compare", "", "--repeats", "1"]
    throughput = ["throughput", "--num-prompts", str(opts.num_prompts), "--input-len", "128",
                  "--output-len", "128", "--compare", ""]
    return {"batch-1 decode tok/s": (latency, lambda r: r["results"][0]["decode_tokens_per_s"]),
            "offline output tok/s": (throughput, _output_tokens_per_s)}


def _output_tokens_per_s(result: dict) -> float:
    row = next(r for r in result["results"] if r["engine"] == "kvslim")
    return row["output_tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="git revision")
    p.add_argument("--after", default=WORKTREE, help="git revision (default: the working tree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--json", action="store_true")
    opts = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trees = {name: checkout(rev, root) for name, rev in
                 (("before", opts.before), ("after", opts.after))}
        values = {(w, name): [] for w in workloads(opts) for name in trees}
        runs = [(w, name) for _ in range(opts.rounds) for w in workloads(opts) for name in trees]
        for w, name in tqdm(runs, desc="before/after", unit="run"):
            args, read = workloads(opts)[w]
            values[w, name].append(read(bench(trees[name], root / f"home-{name}", args)))
        for tree in trees.values():
            if tree != REPO:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(tree)], check=True)
    report(opts, values)


def report(opts, values: dict) -> None:
    rows = [{"workload": w, "before": statistics.median(values[w, "before"]),
             "after": statistics.median(values[w, "after"]),
             "before_runs": values[w, "before"], "after_runs": values[w, "after"]}
            for w in dict.fromkeys(w for w, _ in values)]
    if opts.json:
        print(json.dumps({"before": opts.before, "after": opts.after, "rounds": opts.rounds,
                          "rows": rows}, indent=2))
        return
    print(f"| workload | {opts.before} | {opts.after} | after / before | runs (before; after) |")
    print("|---|---|---|---|---|")
    for r in rows:
        runs = f"{', '.join(map(str, r['before_runs']))}; {', '.join(map(str, r['after_runs']))}"
        print(f"| {r['workload']} | {r['before']:.1f} | {r['after']:.1f} | "
              f"{r['after'] / r['before']:.2f} | {runs} |")


if __name__ == "__main__":
    main()
