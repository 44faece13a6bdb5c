"""`kvslim bench capacity`: an MHA model and its GQA/MQA conversions under one KV-cache budget.

For each: the blocks the budget buys, how many sequences of `context` tokens fit at once, and,
with enough requests arriving to fill the cache, how many ran concurrently and the sustained
output tokens/s. This is the promise of GQA measured in the engine: H/K times the batch. With
`mla`, each GQA count also has a latent-attention twin at the same KV bytes (`kvslim convert
--to-mla --method mha2mla`, which needs no calibration text: what fits depends on the bytes, and
the throughput on the attention's form, not on the weights' quality)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvslim_lab.bench.runners import kvslim_llm
from kvslim_lab.bench.workload import Workload, special_ids
from kvslim.engine.config import parse_bytes
from kvslim.engine.sampling_params import SamplingParams
from kvslim.models.config import ModelConfig


@dataclass
class CapacityEntry:
    model: str
    kv_heads: int
    kv_bytes_per_token: int
    num_blocks: int
    max_sequences: int              # whole sequences of `context` tokens the blocks hold
    peak_running: int               # measured: most sequences in one step
    output_tokens_per_s: float
    preemptions: int
    seconds: float
    latent: str | None = None       # an MLA model's cached row: "kv_lora_rank+qk_rope_head_dim"


@dataclass
class CapacityResult:
    kv_cache_memory: int
    context: int
    block_size: int
    num_requests: int
    entries: list[CapacityEntry] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def conversions(mha_dir: Path, kv_heads: list[int], work: Path, show_progress: bool,
                mla: bool = False) -> list[Path]:
    """The MHA model and its mean-pooled conversions, each followed (`mla`) by its latent twin
    at the same KV bytes (made once, under `work`)."""
    from kvslim.surgery.convert import convert_to_gqa
    dirs = [Path(mha_dir)]
    for k in kv_heads:
        out = work / f"{Path(mha_dir).name}-k{k}-mean"
        if not (out / "config.json").is_file():
            convert_to_gqa(mha_dir, out, k, "mean", show_progress=show_progress)
        dirs.append(out)
        if mla:
            dirs.append(_latent_twin(mha_dir, k, work, show_progress))
    return dirs


def _latent_twin(mha_dir: Path, k: int, work: Path, show_progress: bool) -> Path:
    from kvslim.surgery.mla.convert import convert_to_mla
    from kvslim.surgery.mla.options import MLAOptions, mla_widths
    out = work / f"{Path(mha_dir).name}-k{k}-mla"
    if not (out / "config.json").is_file():
        rope_dim, rank = mla_widths(ModelConfig.from_dir(mha_dir), k, "mha2mla", 0.5)
        convert_to_mla(mha_dir, out, MLAOptions("mha2mla", rank, rope_dim, "exact"),
                       show_progress=show_progress)
    return out


def run_capacity(model_dirs: list[Path], kv_cache_memory: str | int = "64MiB",
                 context: int = 256, num_requests: int | None = None, block_size: int = 16,
                 show_progress: bool = True, kv_cache_dtype: str = "auto") -> CapacityResult:
    """`kv_cache_dtype` "int8" / "fp8_e4m3": every model with a quantized cache (what fits
    then grows by the bytes it saves per token)."""
    budget = parse_bytes(kv_cache_memory)
    # Prompts of nearly the whole context: a sequence holds (almost) all its blocks from its
    # admission, so the concurrency measured is the concurrency that fits, not a transient.
    output_len = max(4, context // 16)
    prompt_len = context - output_len
    blocks_per_seq = -(-context // block_size)
    configs = [ModelConfig.from_dir(d) for d in model_dirs]
    # Enough requests to fill the cache of the model with the fewest KV heads, and a bit more.
    smallest = min(c.kv_cache_bytes_per_token(_stored(kv_cache_dtype)) for c in configs)
    n = num_requests or int(1.25 * budget // (smallest * block_size) // blocks_per_seq) + 1
    result = CapacityResult(budget, context, block_size, n)
    for model_dir, cfg in zip(model_dirs, configs):
        llm = kvslim_llm(model_dir, budget, max_num_seqs=4096, max_num_batched_tokens=4096,
                         kv_cache_dtype=kv_cache_dtype)
        stats = llm.kv_cache_stats()
        w = Workload(n, prompt_len, output_len, seed=2)
        prompts = w.prompts(cfg.vocab_size, special_ids(llm.tokenizer))
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                    ignore_eos=True), use_tqdm=show_progress)
        seconds = time.perf_counter() - start
        result.entries.append(CapacityEntry(
            model=Path(model_dir).name, kv_heads=cfg.num_key_value_heads,
            kv_bytes_per_token=stats.bytes_per_token, num_blocks=stats.num_blocks,
            max_sequences=stats.num_blocks // blocks_per_seq,
            peak_running=llm.engine.peak_num_running,
            output_tokens_per_s=round(sum(len(o.outputs[0].token_ids) for o in outs) / seconds, 1),
            preemptions=llm.kv_cache_stats().num_preemptions, seconds=round(seconds, 1),
            latent=(f"{cfg.mla.kv_lora_rank}+{cfg.mla.qk_rope_head_dim}" if cfg.mla else None)))
    return result


def _stored(kv_cache_dtype: str) -> str:
    return "float32" if kv_cache_dtype == "auto" else kv_cache_dtype     # CPU runs float32


def format_capacity(r: CapacityResult) -> str:
    lines = [f"capacity: KV budget {r.kv_cache_memory / 2**20:.0f} MiB, sequences of {r.context} "
             f"tokens, {r.num_requests} requests at once",
             f"{'model':<28} {'KV heads':>8} {'B/token':>8} {'blocks':>7} {'fit':>5} "
             f"{'peak':>5} {'out tok/s':>10} {'preempt':>8}"]
    base = r.entries[0] if r.entries else None
    for e in r.entries:
        heads = f"MLA {e.latent}" if e.latent else e.kv_heads
        lines.append(f"{e.model:<28} {heads:>8} {e.kv_bytes_per_token:>8} "
                     f"{e.num_blocks:>7} {e.max_sequences:>5} {e.peak_running:>5} "
                     f"{e.output_tokens_per_s:>10.1f} {e.preemptions:>8}")
    for e in r.entries[1:]:
        lines.append(f"{e.model}: {e.max_sequences / base.max_sequences:.2f}x the sequences "
                     f"that fit, {e.peak_running / base.peak_running:.2f}x measured peak, "
                     f"{e.output_tokens_per_s / base.output_tokens_per_s:.2f}x throughput "
                     f"of {base.model}")
    return "\n".join(lines)
