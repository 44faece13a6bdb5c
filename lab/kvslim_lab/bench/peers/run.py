"""One peers run from its settings — the engines built from the catalog, started, taking turns
round by round, then (with `serve`) the serving run — as `kvslim bench peers` and `kvslim bench
report` both run it. `PeersSettings` holds what a user chooses; its field defaults are the
commands' defaults."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from kvslim_lab.bench.llamacpp_tools import DEFAULT_BIN
from kvslim_lab.bench.peers import catalog
from kvslim_lab.bench.peers.suite import PeersPlan, PeersResult, run_peers
from kvslim_lab.bench.workload import Workload
from kvslim.errors import KvslimError


@dataclass
class PeersSettings:
    engines: str | None = None               # names or families; None: all
    rounds: int = 3
    num_prompts: int = 64                    # offline
    input_len: int = 128                     # prompt tokens (every workload)
    output_len: int = 128                    # offline: new tokens per prompt
    decode_len: int = 64                     # batch-1 decode (and serving): new tokens
    llamacpp_bin: str = DEFAULT_BIN
    vllm_python: str | None = None
    vllm_eager: bool = False
    serve_prompts: int = 64
    request_rate: float = 2.0
    server_slots: int = 16

    def __post_init__(self) -> None:
        if min(self.rounds, self.num_prompts, self.input_len, self.output_len,
               self.decode_len, self.serve_prompts) < 1:
            raise KvslimError("--rounds, --num-prompts, --input-len, --output-len, --decode-len "
                              "and --serve-prompts must be at least 1")

    @property
    def names(self) -> list[str]:
        return catalog.parse_engines(self.engines)

    def plan(self) -> PeersPlan:
        return PeersPlan(Workload(1, self.input_len, self.decode_len, seed=1),
                         Workload(self.num_prompts, self.input_len, self.output_len),
                         self.rounds)

    def options(self, threads: int) -> catalog.PeerOptions:
        return catalog.PeerOptions(
            threads, Path(self.llamacpp_bin), Path(self.vllm_python) if self.vllm_python else None,
            self.vllm_eager, max_num_seqs=max(64, self.num_prompts),
            max_model_len=self.input_len + max(self.output_len, self.decode_len) + 16)

    def to_dict(self) -> dict:
        return asdict(self)


def measure(settings: PeersSettings, threads: int, serve: bool, show_progress: bool = True,
            engines: list | None = None, bandwidth: dict | None = None) -> PeersResult:
    """`engines`: the catalog's engines for settings.names, when the caller built (and maybe
    started) them already; `bandwidth`: the memory bandwidth measured in the caller's run."""
    from kvslim_lab.bench.machine import machine_info, memory_bandwidth
    plan, opts = settings.plan(), settings.options(threads)
    if engines is None:
        engines = catalog.build(settings.names, opts)
    result = run_peers(engines, catalog.prompts(plan), plan, machine_info().to_dict(),
                       bandwidth or vars(memory_bandwidth()), threads, show_progress)
    if serve:
        from kvslim_lab.bench.peers.serving import ServingPlan, build_servers, run_serving
        serving = ServingPlan(settings.serve_prompts, settings.request_rate, settings.input_len,
                              settings.decode_len)
        servers = build_servers(settings.names, opts, settings.server_slots,
                                settings.input_len + settings.decode_len + 16)
        result.plan["serving"] = asdict(serving)
        result.serving = run_serving(servers, serving, show_progress)
    return result
