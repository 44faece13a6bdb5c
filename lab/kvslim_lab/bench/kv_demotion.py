"""`kvslim bench kv-demotion`: demotion against preemption under overload (`--kv-pressure
demote|preempt`, engine/kv_demotion.py), per model.

N requests of held-out text, all sent at once, whose prompts and greedy continuations need
`overload` times the blocks the pool holds (counted over every KV-cache group), run to the end
through `LLM.generate` in each mode on the same KV bytes, beside an unpressured run (a pool that
holds them all). Per run: wall time, output tokens/s, preemptions, blocks demoted, the
perplexity of its continuations scored by the unpressured engine (each prompt + continuation's
prompt logprobs, full precision) and how many continuations equal the unpressured run's. The
modes run in turn, A B A B, each run with an empty prefix cache; a mode's rate is the mean of
its runs."""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

MODES = ("preempt", "demote")


@dataclass
class KVDemotionConfig:
    models: list = field(default_factory=lambda: [None])   # None: the embedded default model
    requests: int = 16
    prompt_tokens: int = 256
    max_tokens: int = 256
    overload: float = 2.0                   # blocks the requests need / blocks the pool holds
    repeats: int = 2                        # runs of each mode, in turn
    free_memory: str = "2GiB"               # the unpressured run's KV memory
    data: str = "../shared/corpus/test.txt"


@dataclass
class ModeRun:
    seconds: float
    tok_s: float
    preemptions: int
    demoted_blocks: int
    ppl: float
    same_as_unpressured: int


@dataclass
class ModelDemotion:
    model: str
    blocks_needed: int
    kv_cache_memory: int
    blocks: dict                            # mode -> blocks its pool holds
    unpressured: ModeRun
    runs: dict = field(default_factory=dict)   # mode -> [ModeRun]

    def rate(self, mode: str) -> float:
        return sum(r.tok_s for r in self.runs[mode]) / len(self.runs[mode])


@dataclass
class KVDemotionResult:
    config: dict
    models: list[ModelDemotion] = field(default_factory=list)
    command: str = ""
    date: str = ""
    machine: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def run_kv_demotion(cfg: KVDemotionConfig, show_progress: bool = True) -> KVDemotionResult:
    text = Path(cfg.data).read_text(encoding="utf-8", errors="replace")
    result = KVDemotionResult(asdict(cfg) | {"models": [str(m or "default")
                                                        for m in cfg.models]})
    for model in cfg.models:
        result.models.append(demotion_one_model(model, text, cfg, show_progress))
    return result


def demotion_one_model(model, text: str, cfg: KVDemotionConfig,
                       show_progress: bool) -> ModelDemotion:
    from kvslim import LLM
    length = cfg.prompt_tokens + cfg.max_tokens
    common = dict(max_num_seqs=cfg.requests, max_model_len=length + 16)
    free = LLM(model, **common, kv_cache_memory=cfg.free_memory)
    prompts = prompts_of(free, text, cfg.requests, cfg.prompt_tokens)
    needed = cfg.requests * free.engine.kv_plan.blocks_per_sequence(length)
    memory = int(needed / cfg.overload * free.engine.kv_cache_stats().bytes_per_block)
    unpressured, reference = run_mode(free, prompts, cfg.max_tokens, free)
    engines = {mode: LLM(model, **common, kv_cache_memory=memory, kv_pressure=mode)
               for mode in MODES}
    entry = ModelDemotion(str(model or "default"), needed, memory,
                          {m: e.engine.kv_cache_stats().num_blocks for m, e in engines.items()},
                          unpressured, {mode: [] for mode in MODES})
    with tqdm(total=cfg.repeats * len(MODES), desc=f"{entry.model}: runs",
              disable=not show_progress) as bar:
        for _ in range(cfg.repeats):
            for mode, llm in engines.items():
                entry.runs[mode].append(run_mode(llm, prompts, cfg.max_tokens, free,
                                                 reference)[0])
                bar.update()
    return entry


def prompts_of(llm, text: str, n: int, tokens: int) -> list[list[int]]:
    """n prompts of `tokens` tokens from consecutive stretches of the text."""
    ids = llm.tokenizer.encode(text)
    if len(ids) < n * tokens:
        raise ValueError(f"the text holds {len(ids)} tokens, {n * tokens} needed")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(n)]


def generate(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds, continuations) of greedy generation, from an empty prefix cache."""
    from kvslim import SamplingParams
    llm.engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def perplexity(scorer, prompts, continuations) -> float:
    """exp of the mean negative log-likelihood of the continuations' tokens after their
    prompts, read by `scorer` (prompt logprobs)."""
    from kvslim import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = scorer.generate([p + c for p, c in zip(prompts, continuations)], params,
                           use_tqdm=False)
    nll = [-lp.logprob for o, p in zip(outs, prompts) for lp in o.prompt_logprobs[len(p):]]
    return math.exp(sum(nll) / len(nll))


def run_mode(llm, prompts, max_tokens: int, scorer,
             reference: list[list[int]] | None = None) -> tuple[ModeRun, list[list[int]]]:
    """One run of `llm`, its continuations scored by `scorer` and compared with the
    reference's (None: this run is the reference)."""
    before = llm.engine.kv_cache_stats()
    seconds, conts = generate(llm, prompts, max_tokens)
    after = llm.engine.kv_cache_stats()
    return ModeRun(round(seconds, 2), round(sum(map(len, conts)) / seconds, 2),
                   after.num_preemptions - before.num_preemptions,
                   after.num_demoted_blocks - before.num_demoted_blocks,
                   round(perplexity(scorer, prompts, conts), 4),
                   sum(c == r for c, r in zip(conts, reference or conts))), conts
