"""The compiled CPU decode step against the eager one (engine/cpu_compile.py): is it faster at
every batch, are its greedy tokens the eager path's, and how long does a start take, the first
time (nothing cached) and the second (Inductor's caches on disk)?

Start-up is timed in child processes, each a fresh interpreter with one KVSLIM_HOME: the first
compiles into an empty cache, the second finds what the first wrote; both then answer one request
(the time to that answer is what `kvslim serve` would show). Decode speed is measured in one
process holding both engines, taking turns in every round (kvslim_lab.bench.compiled_decode, which
`kvslim bench report` runs too): a batch's decode rate is its size over its requests' mean time
per output token, medians over rounds.

    python benchmarks/compiled_decode.py                     # the default model (Q4_1 blocks)
    python benchmarks/compiled_decode.py --batches 1,8 --rounds 1 --json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from kvslim_lab.bench.compiled_decode import BATCHES, build_engines, compare, decode_table


def startup_child(model: str | None) -> None:
    """Build a compiled engine and answer one request; prints seconds as JSON."""
    start = time.perf_counter()
    from kvslim import LLM, SamplingParams
    llm = LLM(model, compile_decode=True, max_num_seqs=64)
    ready = time.perf_counter()
    llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=8, temperature=0),
                 use_tqdm=False)
    print(json.dumps({"engine_ready_s": ready - start,
                      "first_answer_s": time.perf_counter() - start,
                      "programs": llm.engine.runner.decode_graphs.compilations}))


def startups(model: str | None, home: str) -> list[dict]:
    """Cold then warm start in fresh interpreters sharing the new KVSLIM_HOME `home` (the
    model's import is done by a first, uncompiled start so that it is not timed)."""
    env = dict(os.environ, KVSLIM_HOME=home)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    argv = [sys.executable, __file__, "--startup-child"] + (["--model", model] if model else [])
    subprocess.run([sys.executable, "-c", f"from kvslim import LLM; LLM({model!r})"], env=env,
                   check=True, capture_output=True)
    rows = []
    for which in ("first start (empty cache)", "second start (cache on disk)"):
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"start-up child failed:\n{done.stderr[-2000:]}")
        rows.append({"start": which, **json.loads(done.stdout.strip().splitlines()[-1])})
    return rows


def markdown(result: dict) -> str:
    lines = ["| start | engine ready s | first answer s | programs |", "|---|---|---|---|"]
    lines += [f"| {r['start']} | {r['engine_ready_s']:.1f} | {r['first_answer_s']:.1f} | "
              f"{r['programs']} |" for r in result["startup"]]
    return "\n".join(lines + ["", decode_table(result["decode"])])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-startup", action="store_true", help="skip the start-up timing")
    p.add_argument("--startup-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    opts = p.parse_args()
    if opts.startup_child:
        return startup_child(opts.model)
    opts.batches = [int(b) for b in opts.batches.split(",")]
    startup = []
    if not opts.no_startup:                     # else: KVSLIM_HOME as it is (its cache too)
        home = tempfile.mkdtemp(prefix="kvslim-compile-bench-")
        startup = startups(opts.model, home)
        os.environ["KVSLIM_HOME"] = home        # the decode runs find the programs compiled
    engines = build_engines(opts.model, max(opts.batches))
    result = {"machine": {"threads": torch.get_num_threads(), "torch": torch.__version__},
              "startup": startup, "decode": compare(engines, opts.batches, opts.input_len,
                                                    opts.output_len, opts.rounds)}
    print(json.dumps(result, indent=2) if opts.json else markdown(result))


if __name__ == "__main__":
    main()
