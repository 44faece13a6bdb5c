"""`kvslim bench structured`: what constrained decoding costs a decode step. The same batch of
chat prompts (lab/kvslim_lab/bench/schema_suite.py) runs twice in each round, plain and with each
request's JSON schema, to the same length (ignore_eos: a finished grammar keeps masking all but
EOS, so every step of the constrained run pays for its masks); the rounds alternate the two
runs. Reported: the median time of a full-batch decode step in each run, the overhead, and
where the masks' time goes — filled on the grammar thread beside the forward pass, then what
the step still waited for them."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams
from kvslim_lab.bench.decode_steps import full_batch_steps
from kvslim_lab.bench.schema_suite import schema_suite


@dataclass
class StructuredBenchResult:
    model: str
    batch: int
    tokens: int
    rounds: int
    plain_step_ms: float = 0.0
    constrained_step_ms: float = 0.0
    fill_ms_per_step: float = 0.0
    wait_ms_per_step: float = 0.0
    per_round: list[dict] = field(default_factory=list)

    @property
    def overhead(self) -> float:
        return self.constrained_step_ms / self.plain_step_ms - 1

    def to_dict(self) -> dict:
        return {**asdict(self), "overhead": self.overhead}


def run_structured_bench(model: str | None, batch: int = 32, tokens: int = 64, rounds: int = 3,
                         kv_cache_memory: str = "1GiB", show_progress: bool = True
                         ) -> StructuredBenchResult:
    llm = LLM(model, kv_cache_memory=kv_cache_memory, max_num_seqs=max(batch, 8))
    cases = (schema_suite() * (batch // 50 + 1))[:batch]
    tok = llm.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": c.prompt}]) if tok.chat_template
               else tok.encode(c.prompt + "\n") for c in cases]     # a base model: the text
    plain = [SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True) for _ in cases]
    constrained = [SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                  structured_outputs={"json": c.schema}) for c in cases]
    times = llm.engine.structured.times
    result = StructuredBenchResult(str(llm.model_dir), batch, tokens, rounds)
    all_plain, all_constrained = [], []
    llm.engine.grammar_compiler.ll_tokenizer          # built once, outside the timings
    full_batch_steps(llm, prompts[:2], plain[:2])         # warm-up
    for r in tqdm(range(rounds), desc="rounds", disable=not show_progress):
        before = (times.steps, times.fill_s, times.wait_s)
        runs = [("plain", plain), ("constrained", constrained)]
        steps = {name: full_batch_steps(llm, prompts, params)
                 for name, params in (runs if r % 2 == 0 else runs[::-1])}
        n = times.steps - before[0]
        result.per_round.append({
            "plain_step_ms": 1e3 * statistics.median(steps["plain"]),
            "constrained_step_ms": 1e3 * statistics.median(steps["constrained"]),
            "fill_ms_per_step": 1e3 * (times.fill_s - before[1]) / max(n, 1),
            "wait_ms_per_step": 1e3 * (times.wait_s - before[2]) / max(n, 1)})
        all_plain += steps["plain"]
        all_constrained += steps["constrained"]
    result.plain_step_ms = 1e3 * statistics.median(all_plain)
    result.constrained_step_ms = 1e3 * statistics.median(all_constrained)
    result.fill_ms_per_step = statistics.median(r["fill_ms_per_step"] for r in result.per_round)
    result.wait_ms_per_step = statistics.median(r["wait_ms_per_step"] for r in result.per_round)
    return result


def format_structured(r: StructuredBenchResult) -> str:
    goal = "PASS" if r.overhead <= 0.10 else "FAIL"
    return "\n".join([
        f"constrained decoding, {r.model}: batch {r.batch}, {r.tokens} tokens, {r.rounds} rounds",
        "| run | decode step ms (median) |", "|---|---|",
        f"| plain | {r.plain_step_ms:.2f} |",
        f"| JSON schema per request | {r.constrained_step_ms:.2f} |",
        f"overhead {100 * r.overhead:+.1f}% (goal <= 10%: {goal}); masks filled "
        f"{r.fill_ms_per_step:.2f} ms per step beside the forward pass, waited for "
        f"{r.wait_ms_per_step:.2f} ms"])
