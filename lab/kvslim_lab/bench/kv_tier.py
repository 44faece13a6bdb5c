"""`kvslim bench kv-tier`: what the KV offload tier saves a long prompt's first token. For each
prompt length, the time to the first token (TTFT, one greedy token):
  * cold: no cache anywhere (a fresh engine);
  * pool: the prefix still in the paged pool (the same prompt again);
  * memory: the pool's prefix cache dropped, the blocks read back from host memory;
  * disk: a new engine (as after a restart) reading the blocks from the directory.
Each figure is the median of `rounds`; the prompts are random token ids, the same for all."""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams

GOAL = 0.20                          # disk TTFT of the 4k prompt <= 20% of its cold prefill
SOURCES = ("cold", "pool", "memory", "disk")


@dataclass
class KVTierBenchResult:
    model: str
    lengths: list[int]
    rounds: int
    ttft_ms: dict[str, dict[str, float]] = field(default_factory=dict)   # length -> source -> ms

    def ratio(self, length: int, source: str) -> float:
        row = self.ttft_ms[str(length)]
        return row[source] / row["cold"]

    def to_dict(self) -> dict:
        return asdict(self)


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and how many prompt tokens were cached."""
    engine = llm.engine
    start = time.perf_counter()
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return time.perf_counter() - start, out.metrics.num_cached_tokens


def _engine(model, dtype: str, **tier) -> LLM:
    """A new engine, its first step's one-time costs paid on a short unrelated prompt (as a
    server's first request would), so that TTFTs compare where the KV comes from."""
    llm = LLM(model, dtype=dtype, kv_cache_memory="1GiB", max_num_seqs=4, **tier)
    _ttft(llm, [7, 8, 9, 10])
    return llm


def _round(model, dtype: str, prompt: list[int], directory: str) -> dict[str, float]:
    """One measurement of each source, for one prompt."""
    times = {}
    cold = _engine(model, dtype)
    times["cold"], _ = _ttft(cold, prompt)
    times["pool"], _ = _ttft(cold, prompt)
    del cold
    memory = _engine(model, dtype, kv_offload_memory="2GiB", kv_offload_write_through=True)
    _ttft(memory, prompt)
    memory.engine.block_manager.reset_prefix_cache()
    times["memory"], cached = _ttft(memory, prompt)
    assert cached, "the memory tier served nothing"
    del memory
    _ttft(_engine(model, dtype, kv_offload_dir=directory, kv_offload_write_through=True), prompt)
    times["disk"], cached = _ttft(_engine(model, dtype, kv_offload_dir=directory), prompt)
    assert cached, "the disk tier served nothing"
    return times


def run_kv_tier_bench(model: str | None, lengths: tuple[int, ...] = (1024, 4096),
                      rounds: int = 3, dtype: str = "auto",
                      show_progress: bool = True) -> KVTierBenchResult:
    g = torch.Generator().manual_seed(0)
    result = None
    for length in lengths:
        prompt = torch.randint(100, 20000, (length,), generator=g).tolist()
        samples: dict[str, list[float]] = {s: [] for s in SOURCES}
        for r in tqdm(range(rounds), desc=f"{length} tokens", disable=not show_progress):
            with tempfile.TemporaryDirectory() as directory:
                prompt_r = [prompt[0] + r] + prompt[1:]          # no file from an earlier round
                for source, seconds in _round(model, dtype, prompt_r, directory).items():
                    samples[source].append(seconds)
        if result is None:
            result = KVTierBenchResult(str(model or "default"), list(lengths), rounds)
        result.ttft_ms[str(length)] = {s: 1e3 * statistics.median(v) for s, v in samples.items()}
    return result


def format_kv_tier(r: KVTierBenchResult) -> str:
    lines = [f"KV offload tier, {r.model}: time to the first token, median of {r.rounds}",
             "| prompt tokens | " + " | ".join(SOURCES) + " | disk / cold |",
             "|---|" + "---|" * (len(SOURCES) + 1)]
    for length in r.lengths:
        row = r.ttft_ms[str(length)]
        lines.append(f"| {length} | " + " | ".join(f"{row[s]:.0f} ms" for s in SOURCES)
                     + f" | {100 * r.ratio(length, 'disk'):.0f}% |")
    longest = max(r.lengths)
    verdict = "PASS" if r.ratio(longest, "disk") <= GOAL else "FAIL"
    lines.append(f"{longest} tokens from disk: {100 * r.ratio(longest, 'disk'):.1f}% of the cold "
                 f"prefill (goal <= {100 * GOAL:.0f}%: {verdict})")
    return "\n".join(lines)


def plot_kv_tier(r: KVTierBenchResult, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(SOURCES)
    for k, source in enumerate(SOURCES):
        ax.bar([i + k * width for i in range(len(r.lengths))],
               [r.ttft_ms[str(n)][source] for n in r.lengths], width, label=source)
    ax.set_xticks([i + width * (len(SOURCES) - 1) / 2 for i in range(len(r.lengths))],
                  [f"{n} tokens" for n in r.lengths])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (ms, log)")
    ax.set_title("Where a long prompt's KV comes from")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
