"""`kvslim bench lora`: what serving LoRA adapters costs a decode step. One engine runs the base
model alone (enable_lora off: its fastest path); a second, with `max_loras` slots, runs the same
batch of prompts with 0, 1, 4 and 8 distinct adapters spread over its sequences (random rank-R
adapters on every attention and MLP linear, written in peft's format by this benchmark). Rounds
take the runs in alternating order; reported: the median time of a full-batch decode step, its
tokens per second and the ratio to the base model alone (the goal: 8 adapters >= 70%)."""
from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams
from kvslim.lora.request import LoRARequest
from kvslim_lab.bench.decode_steps import full_batch_steps

GOAL = 0.70
# kvslim's fused linears' shards -> the checkpoint names peft writes
HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj"}


@dataclass
class LoRABenchResult:
    model: str
    batch: int
    tokens: int
    rank: int
    rounds: int
    step_ms: dict[str, float] = field(default_factory=dict)     # run -> median step ms

    def tokens_per_s(self, run: str) -> float:
        return 1e3 * self.batch / self.step_ms[run]

    def ratio(self, run: str) -> float:
        return self.step_ms["base model alone"] / self.step_ms[run]

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": {r: self.tokens_per_s(r) for r in self.step_ms},
                "ratio_to_base": {r: self.ratio(r) for r in self.step_ms}}


def write_random_adapter(llm: LLM, path: Path, rank: int, seed: int) -> Path:
    """A peft LoRA directory for the model `llm` serves: every wrapped linear's shards, A and
    B random (small, so the model still writes text)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, linear in llm.engine.lora.linears.items():
        parent = name.rpartition(".")[0]
        for shard, rows in linear.shard_sizes.items():
            hf = f"base_model.model.{parent}.{HF_NAMES[shard] if shard else name.rpartition('.')[2]}"
            tensors[f"{hf}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=g) * 0.02
            tensors[f"{hf}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    targets = sorted({k.split(".")[-3] for k in tensors})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "bias": "none"}))
    return path


def run_lora_bench(model: str | None, batch: int = 32, tokens: int = 32, rank: int = 16,
                   rounds: int = 3, counts: tuple[int, ...] = (0, 1, 4, 8), dtype: str = "auto",
                   show_progress: bool = True) -> LoRABenchResult:
    common = dict(kv_cache_memory="1GiB", max_num_seqs=max(batch, 8), dtype=dtype)
    base = LLM(model, **common)
    served = LLM(model, enable_lora=True, max_loras=max(counts), max_lora_rank=rank, **common)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (64,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"bench{i}", i + 1, str(write_random_adapter(
            served, Path(tmp) / f"a{i}", rank, seed=i))) for i in range(max(counts))]
        runs = [("base model alone", base, [None] * batch)] + [
            (f"{n} adapters", served, [adapters[i % n] if n else None for i in range(batch)])
            for n in counts]
        for _, llm, loras in runs:                                    # warm-up, adapters read
            full_batch_steps(llm, prompts, [params] * batch, loras)
        steps: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        for r in tqdm(range(rounds), desc="rounds", disable=not show_progress):
            for name, llm, loras in (runs if r % 2 == 0 else runs[::-1]):
                steps[name] += full_batch_steps(llm, prompts, [params] * batch, loras)
    result = LoRABenchResult(str(base.model_dir), batch, tokens, rank, rounds)
    result.step_ms = {name: 1e3 * statistics.median(t) for name, t in steps.items()}
    return result


def format_lora(r: LoRABenchResult) -> str:
    lines = [f"LoRA serving, {r.model}: batch {r.batch}, {r.tokens} tokens, rank {r.rank}, "
             f"{r.rounds} rounds (runs alternating)",
             "| run | decode step ms (median) | tokens/s | vs base alone |", "|---|---|---|---|"]
    lines += [f"| {run} | {ms:.2f} | {r.tokens_per_s(run):.0f} | {r.ratio(run):.2f}x |"
              for run, ms in r.step_ms.items()]
    eight = next((run for run in r.step_ms if run.startswith("8 ")), None)
    if eight is not None:
        verdict = "PASS" if r.ratio(eight) >= GOAL else "FAIL"
        lines.append(f"8 adapters: {100 * r.ratio(eight):.0f}% of the base model alone "
                     f"(goal >= {100 * GOAL:.0f}%: {verdict})")
    return "\n".join(lines)


def plot_lora(results: dict[str, LoRABenchResult], path: Path) -> None:
    """Tokens per second of each run, one group of bars per model import."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(results)
    for k, (label, r) in enumerate(results.items()):
        runs = list(r.step_ms)
        ax.bar([i + k * width for i in range(len(runs))], [r.tokens_per_s(x) for x in runs],
               width, label=label)
        ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(runs))], runs)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"LoRA serving: batch of {r.batch}, rank-{r.rank} adapters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
