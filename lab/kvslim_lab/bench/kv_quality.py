"""`kvslim bench kv-quality`: what each KV-cache setting (float, int8, fp8, int4, int2, Hadamard
rotation, a window with sink tokens) costs and buys, measured through the engine itself:

- capacity, from the engine's own plan (`KVCachePlan`): KV bytes per token and how many
  sequences of `context` tokens the budget holds at once;
- perplexity on a text file read back through the cache: windows scored with prompt logprobs,
  prefilled in small chunks so that every chunk attends to tokens already stored (and
  quantized, or dropped out of a window) in the cache;
- passkey retrieval: a 5-digit number hidden at several depths of filler text, then asked for;
- decode speed at a few batch sizes (optional).

A setting the engine does not take (yet) is recorded as "not supported" and the run goes on."""
from __future__ import annotations

import gc
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvslim import LLM, SamplingParams
from kvslim.dtypes import lookup
from kvslim.errors import KvslimError

FLOAT_NAMES = ("float", "float32", "auto")     # the model's own dtype: float32 on the CPU
OPTION_KEYS = {"w": "kv_window", "s": "kv_sink_tokens", "bs": "block_size"}


@dataclass(frozen=True)
class KVSetting:
    name: str
    options: dict                      # LLM keyword options


@dataclass
class KVQualityConfig:
    models: list = field(default_factory=lambda: [None])   # None: the embedded default model
    settings: list[KVSetting] = field(default_factory=list)
    kv_cache_memory: str | int = "1GiB"
    context: int = 4096                # the sequences counted against the budget
    data: str = "../shared/corpus/test.txt"
    max_tokens: int = 8192
    window: int = 512                  # perplexity windows, side by side
    chunk: int = 64                    # max_num_batched_tokens of the quality runs
    passkey_contexts: tuple[int, ...] = (1024, 2048, 4096)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_tokens: int = 8
    seed: int = 0
    speed_batches: tuple[int, ...] = (1, 32)   # () skips the speed runs
    speed_tokens: int = 64
    dense_check: bool = True


@dataclass
class PasskeyScore:
    context: int
    passes: int = 0
    cases: int = 0
    skipped: str | None = None
    misses: list[dict] = field(default_factory=list)     # key, depth and what came out


@dataclass
class SettingResult:
    setting: str
    options: dict
    error: str | None = None           # "not supported: ..." or "failed: ..."
    kv_cache_dtype: str | None = None  # as the engine stores it
    kv_bytes_per_token: int | None = None
    max_tokens: int | None = None      # token slots in the budget
    sequences: int | None = None       # sequences of `context` tokens in the budget
    max_model_len: int | None = None
    perplexity: float | None = None
    ppl_tokens: int = 0
    vs_float_pct: float | None = None
    passkey: list[PasskeyScore] = field(default_factory=list)
    decode_tok_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class ModelResult:
    model: str
    model_dir: str
    dense_perplexity: float | None = None
    settings: list[SettingResult] = field(default_factory=list)


@dataclass
class KVQualityResult:
    config: dict
    models: list[ModelResult] = field(default_factory=list)
    command: str = ""
    date: str = ""
    machine: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_settings(values: list[str]) -> list[KVSetting]:
    """Settings from words like "int4+rot" or "int4,w=1024,s=4". In a comma list a part with
    "=" belongs to the setting before it, so "float,int8,int4,w=1024,s=4" is three settings."""
    groups: list[list[str]] = []
    for value in values:
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            if "=" not in part:
                groups.append([part])
            elif groups:
                groups[-1].append(part)
            else:
                raise KvslimError(f"--settings: {part!r} comes before any KV dtype")
    if not groups:
        raise KvslimError("--settings: no setting given")
    return [_setting(g) for g in groups]


def _setting(parts: list[str]) -> KVSetting:
    word = parts[0].lower()
    rotate = word.endswith("+rot")
    word = word.removesuffix("+rot")
    # Names the engine does not know yet pass through: the engine says whether it takes them.
    dtype = "auto" if word in FLOAT_NAMES else (lookup(word).name if lookup(word) else word)
    options: dict = {"kv_cache_dtype": dtype}
    if rotate:
        options["kv_hadamard"] = True
    for part in parts[1:]:
        key, _, value = part.partition("=")
        if key not in OPTION_KEYS or not value.isdigit():
            raise KvslimError(f"--settings: {part!r} is not w=TOKENS (window), s=TOKENS "
                              f"(sink tokens) or bs=TOKENS (block size)")
        options[OPTION_KEYS[key]] = int(value)
    return KVSetting(",".join(parts), options)


def build_llm(model_dir, setting: KVSetting, budget, chunk: int, max_num_seqs: int) -> LLM:
    gc.collect()       # an engine dropped in a reference cycle would keep its cache meanwhile
    return LLM(str(model_dir), dtype="float32", device="cpu", kv_cache_memory=budget,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk,
               enable_prefix_caching=False, **setting.options)


def one_line(e: BaseException, limit: int = 160) -> str:
    """The message's first line, without the list of every engine option an unknown one gets:
    a table cell, not a help page."""
    lines = str(e).strip().splitlines()
    text = lines[0].split(" (options: ")[0] if lines else type(e).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def run_kv_quality(cfg: KVQualityConfig, show_progress: bool = True) -> KVQualityResult:
    from kvslim.formats.registry import engine_model_dir
    result = KVQualityResult(_config_dict(cfg))
    for model in cfg.models:
        model_dir = engine_model_dir(model, "float32", show_progress)
        entry = ModelResult(Path(model_dir).name, str(model_dir))
        tokens = _corpus(model_dir, cfg)
        if cfg.dense_check:
            entry.dense_perplexity = dense_perplexity(model_dir, cfg)
        bar = tqdm(cfg.settings, desc=entry.model, unit="setting", disable=not show_progress)
        for setting in bar:
            bar.set_postfix(setting=setting.name)
            entry.settings.append(measure_setting(model_dir, setting, tokens, cfg))
        _relative_to_float(entry)
        result.models.append(entry)
    return result


def _config_dict(cfg: KVQualityConfig) -> dict:
    d = asdict(cfg)
    d["models"] = [str(m) if m else "default" for m in cfg.models]
    d["settings"] = [s.name for s in cfg.settings]
    return d


def _corpus(model_dir, cfg: KVQualityConfig) -> list[int]:
    from kvslim.tokenizer.tokenizer import Tokenizer
    from kvslim.train.data import tokenize_file
    tokens = tokenize_file(cfg.data, Tokenizer.from_dir(model_dir), show_progress=False)
    return [int(t) for t in tokens[:cfg.max_tokens]]


def dense_perplexity(model_dir, cfg: KVQualityConfig) -> float:
    """The same windows through the dense forward, no cache: what the float cache must match."""
    from kvslim.eval.perplexity import file_perplexity
    r = file_perplexity(model_dir, cfg.data, cfg.window, cfg.window, cfg.max_tokens,
                        show_progress=False)
    return round(r.perplexity, 4)


def measure_setting(model_dir, setting: KVSetting, tokens: list[int],
                    cfg: KVQualityConfig) -> SettingResult:
    r = SettingResult(setting.name, dict(setting.options))
    start = time.perf_counter()
    try:
        llm = build_llm(model_dir, setting, cfg.kv_cache_memory, cfg.chunk,
                        max(8, len(cfg.passkey_depths)))
    except (KvslimError, TypeError, NotImplementedError) as e:
        r.error = f"not supported: {one_line(e)}"
        return r
    try:
        _capacity(llm, cfg.context, r)
        r.perplexity, r.ppl_tokens = cache_perplexity(llm, tokens, cfg.window)
        r.passkey = [passkey(llm, c, cfg) for c in cfg.passkey_contexts]
    except KvslimError as e:           # taken, but a request it cannot serve
        r.error = f"failed: {one_line(e)}"
    except RuntimeError as e:          # EngineFailedError: a step failed; recorded, run goes on
        r.error = f"failed: {type(e).__name__}: {one_line(e)}"
    finally:
        llm.shutdown()
        del llm                        # before the speed run's engine allocates its cache
    if r.error is None and cfg.speed_batches:
        r.decode_tok_s = decode_speed(model_dir, setting, cfg)
    r.seconds = round(time.perf_counter() - start, 1)
    return r


def _capacity(llm: LLM, context: int, r: SettingResult) -> None:
    stats, plan = llm.kv_cache_stats(), llm.engine.kv_plan
    r.kv_cache_dtype = stats.kv_cache_dtype
    r.kv_bytes_per_token = stats.bytes_per_token
    r.max_tokens = plan.max_tokens
    r.sequences = plan.max_sequences(context)
    r.max_model_len = llm.engine.max_model_len


def _bos(llm: LLM) -> list[int]:
    """The BOS the tokenizer puts before text, as the dense perplexity does (unscored)."""
    bos = llm.tokenizer.prepended_bos_id
    return [] if bos is None else [bos]


def cache_perplexity(llm: LLM, tokens: list[int], window: int) -> tuple[float, int]:
    """Windows of `window` tokens side by side (`kvslim ppl --stride WINDOW`'s tokens), each a
    prompt whose every token but the first is scored."""
    lead = _bos(llm)
    prompts = [lead + tokens[i:i + window] for i in range(0, len(tokens), window)]
    prompts = [p for p in prompts if len(p) - len(lead) > 1]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        if o.error:
            raise KvslimError(o.error)
    nll = [-t.logprob for o in outs for t in o.prompt_logprobs[1 + len(lead):]]
    return round(math.exp(sum(nll) / len(nll)), 4), len(nll)


INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.")
FILLER = (" The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


def passkey_prompt(llm: LLM, length: int, depth: float, key: str) -> list[int]:
    """At most `length` tokens: the needle after `depth` of the filler's whole sentences. The
    pieces are encoded apart (each starts at a space), so the filler is counted in tokens."""
    def enc(text: str) -> list[int]:
        return llm.tokenizer.encode(text, add_special_tokens=False)
    head, tail = _bos(llm) + enc(INTRO), enc(QUESTION)
    needle, unit = enc(NEEDLE.format(key=key)), enc(FILLER)
    units = (length - len(head) - len(needle) - len(tail)) // len(unit)
    if units < 1:
        raise KvslimError(f"{length} prompt tokens are too few for the question and the filler")
    before = round(depth * units)
    return head + unit * before + needle + unit * (units - before) + tail


def passkey(llm: LLM, context: int, cfg: KVQualityConfig) -> PasskeyScore:
    """Greedy answers to prompts of `context` tokens less the answer's; the same keys for every
    setting (seeded by the context), so settings are compared on the same cases."""
    score = PasskeyScore(context)
    limit = llm.engine.max_model_len
    if context > limit:
        positions = llm.engine.model_config.max_position_embeddings
        score.skipped = (f"{context} > the model's {positions} positions" if context > positions
                         else f"{context} > max_model_len {limit} (what the KV budget holds)")
        return score
    rng = random.Random(cfg.seed * 1_000_003 + context)
    keys = [str(rng.randint(10000, 99999)) for _ in cfg.passkey_depths]
    try:
        prompts = [passkey_prompt(llm, context - cfg.passkey_tokens, d, k)
                   for d, k in zip(cfg.passkey_depths, keys)]
    except KvslimError as e:
        score.skipped = one_line(e)
        return score
    outs = llm.generate(prompts, SamplingParams(max_tokens=cfg.passkey_tokens, temperature=0.0),
                        use_tqdm=False)
    for depth, key, out in zip(cfg.passkey_depths, keys, outs):
        text = out.outputs[0].text
        score.cases += 1
        if key in text:
            score.passes += 1
        else:
            score.misses.append({"depth": depth, "key": key, "output": out.error or text})
    return score


def decode_speed(model_dir, setting: KVSetting, cfg: KVQualityConfig) -> dict[str, float]:
    """Decode tokens/s at each batch (median time per output token of the batch's requests),
    on an engine of its own whose whole short prompts prefill at once: the quality runs' small
    chunks would mix prefill into the decode steps timed."""
    from kvslim_lab.bench.latency import kvslim_measure
    from kvslim_lab.bench.workload import Workload, special_ids
    llm = build_llm(model_dir, setting, cfg.kv_cache_memory, 2048, max(cfg.speed_batches))
    try:
        w = Workload(max(cfg.speed_batches), 32, cfg.speed_tokens, seed=1)
        prompts = w.prompts(llm.engine.model_config.vocab_size, special_ids(llm.tokenizer))
        measure = kvslim_measure(llm, prompts, cfg.speed_tokens)
        return {str(b): round(b / measure(b)[1], 1) for b in cfg.speed_batches}
    finally:
        llm.shutdown()


def _relative_to_float(entry: ModelResult) -> None:
    """Each perplexity against the float cache's (the dense pass's when no float setting ran)."""
    base = next((s.perplexity for s in entry.settings
                 if s.options.get("kv_cache_dtype") == "auto" and len(s.options) == 1
                 and s.perplexity), entry.dense_perplexity)
    for s in entry.settings:
        if s.perplexity and base:
            s.vs_float_pct = round(100 * (s.perplexity / base - 1), 2)
