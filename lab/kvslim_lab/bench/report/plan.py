"""What `kvslim bench report` measures besides the peers run, in its full and its quick plan, and
the parts a run may leave out (`--skip`)."""
from __future__ import annotations

from dataclasses import dataclass

from kvslim_lab.bench.compiled_decode import BATCHES
from kvslim.errors import KvslimError

# part -> what it measures; the peers run itself is never skipped.
PARTS = {
    "serving": "the peers run's serving run (kvslim serve, llama-server, vLLM's server)",
    "startup": "kvslim serve's start-up: launch to first answer, compiled and eager",
    "compiled": "the compiled decode step against eager at each batch",
    "profile": "where a batch-1 decode step's time goes, eager and compiled",
    "ref": "the reference model (--ref-model) against llama.cpp's 4-bit files",
    "capacity": "the GQA capacity check on the reference model",
}
EAGER, COMPILED = "kvslim-q4_1", "kvslim-q4_1+compile"     # the peers engines measured further


@dataclass
class ReportPlan:
    profile_steps: int = 16                  # decode steps profiled
    compiled_batches: tuple[int, ...] = BATCHES
    compiled_rounds: int = 2
    capacity_memory: str = "64MiB"           # one KV-cache budget for MHA and its conversions
    capacity_context: int = 256
    start_timeout: float = 1200.0            # a server's start (a compiled one builds programs)


FULL = ReportPlan()
QUICK = ReportPlan(profile_steps=4, compiled_batches=(1, 2), compiled_rounds=1,
                   capacity_memory="4MiB", capacity_context=64)
# --quick's peers run, for the flags not given (the full plan is PeersSettings' defaults).
QUICK_PEERS = dict(rounds=1, num_prompts=4, input_len=32, output_len=16, decode_len=16,
                   serve_prompts=4, request_rate=4.0)


def parse_skip(value: str | None) -> set[str]:
    parts = {p.strip() for p in (value or "").split(",") if p.strip()}
    bad = sorted(parts - set(PARTS))
    if bad:
        raise KvslimError(f"--skip: unknown part {bad[0]!r}; choose from {', '.join(PARTS)}")
    return parts
