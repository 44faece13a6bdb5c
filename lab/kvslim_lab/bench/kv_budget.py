"""`kvslim bench kv-budget`: the KV budget compiler's plan against every uniform setting that
fits the same bytes, per model:

- the budget: `fraction` of what int8 stores for a sequence of `context` tokens;
- the plan: each layer's sensitivity measured on calibration text (eval/kv_sensitivity.py),
  the exact one-setting-per-layer choice within the budget (kv_cache/budget.py);
- the uniform rivals: each precision alone, whole if it fits, else with sinks + the widest
  window that does;
- KL of the next-token distribution against the exact model on held-out text in windows of
  `context` tokens (so that a window drops what it would drop at serve time), for the plan (its
  predicted KL beside it) and each rival;
- through the engine (`kv_plan=` for the plan): perplexity read back through the cache and
  passkey retrieval (kv_quality.py's), with every setting's capacity in the same memory."""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvslim_lab.bench.kv_quality import KVQualityConfig, SettingResult, measure_setting


@dataclass
class KVBudgetConfig:
    models: list = field(default_factory=lambda: [None])   # None: the embedded default model
    context: int = 1024
    concurrency: int = 4
    fraction: float = 0.5                  # of int8's bytes per sequence
    precisions: tuple[str, ...] = ("auto", "int8", "int4", "int2")
    # The plan's window choices; None: kv_cache/budget.py's default_windows of the context.
    windows: tuple[int, ...] | None = None
    sinks: int = 4
    block_size: int = 16
    calibration: str = "../shared/corpus/valid.txt"
    # Calibration windows; None: the context's length, so that a window's loss is what it
    # drops of a whole sequence (a shorter text would hide most of it).
    calib_tokens: int | None = None
    calib_batches: int = 1
    data: str = "../shared/corpus/test.txt"   # held-out: KL, perplexity
    kl_batches: int = 2                    # held-out windows of `context` tokens
    ppl_tokens: int = 4096
    ppl_window: int | None = None          # perplexity windows; None: the context
    chunk: int = 64
    passkey_contexts: tuple[int, ...] = (1024,)
    passkey_depths: tuple[float, ...] = (0.1, 0.5, 0.9)


@dataclass
class Candidate:
    name: str                              # "plan" or a uniform setting's, e.g. "int8+w1020"
    layers: list[dict]                     # per layer: precision, window
    bytes_per_sequence: int
    predicted_kl: float | None = None      # the plan's: its layers' calibration KL summed
    calibration_kl: float | None = None    # the plan's: all its layers at once, calibration
    measured_kl: float | None = None       # held-out, every layer at its setting at once
    engine: dict | None = None             # kv_quality's SettingResult
    rival: bool = True                     # False: the exact cache, the reference (over budget)


@dataclass
class ModelBudget:
    model: str
    budget_per_sequence: int
    int8_per_sequence: int
    candidates: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class KVBudgetResult:
    config: dict
    models: list[ModelBudget] = field(default_factory=list)
    command: str = ""
    date: str = ""
    machine: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def run_kv_budget(cfg: KVBudgetConfig, show_progress: bool = True) -> KVBudgetResult:
    from kvslim.formats.registry import engine_model_dir
    result = KVBudgetResult(asdict(cfg) | {"models": [str(m or "default") for m in cfg.models]})
    for model in cfg.models:
        start = time.perf_counter()
        model_dir = engine_model_dir(model, "float32", show_progress)
        entry = budget_one_model(model_dir, cfg, show_progress)
        entry.seconds = round(time.perf_counter() - start, 1)
        result.models.append(entry)
    return result


def _windows_of(path: str, tokenizer, tokens: int, count: int) -> list[torch.Tensor]:
    from kvslim.train.data import tokenize_file
    ids = tokenize_file(path, tokenizer, show_progress=False)
    if len(ids) < tokens * count:
        raise ValueError(f"{path} holds {len(ids)} tokens, {tokens * count} needed")
    return [torch.tensor(ids[i * tokens:(i + 1) * tokens], dtype=torch.long)[None]
            for i in range(count)]


def budget_one_model(model_dir, cfg: KVBudgetConfig, show_progress: bool) -> ModelBudget:
    from kvslim.eval.kv_sensitivity import layer_sensitivity, plan_kl
    from kvslim.formats.loader import load_model
    from kvslim.kv_cache.budget import KVSetting, compile_plan, default_windows
    from kvslim.tokenizer.tokenizer import Tokenizer
    model = load_model(model_dir, dtype="float32", device="cpu")
    tok = Tokenizer.from_dir(model_dir)
    n = model.config.num_hidden_layers
    calib_tokens = cfg.calib_tokens or cfg.context
    windows = cfg.windows or default_windows(cfg.context)
    settings = [KVSetting(p, w) for p in cfg.precisions for w in (None, *windows)
                if w is None or cfg.sinks + w < calib_tokens]
    calib = _windows_of(cfg.calibration, tok, calib_tokens, cfg.calib_batches)
    with tqdm(total=n * len(calib), desc=f"{Path(model_dir).name}: layers",
              disable=not show_progress) as bar:
        losses = layer_sensitivity(model, calib, settings, cfg.sinks, cfg.block_size, bar)
    cost = _costs(model.config, cfg)
    int8 = sum(cost(layer, KVSetting("int8")) for layer in range(n))
    budget = int(int8 * cfg.fraction)
    options = [{s: (cost(layer, s), losses[layer][s]) for s in settings} for layer in range(n)]
    chosen, used, predicted = compile_plan(options, budget)
    entry = ModelBudget(Path(model_dir).name, budget, int8)
    entry.candidates.append(Candidate("plan", _layers(chosen), used, predicted, plan_kl(
        model, calib, chosen, cfg.sinks, cfg.block_size)))
    for setting in uniform_rivals(model.config, cfg, budget, cost):
        entry.candidates.append(Candidate(setting.name, _layers([setting] * n),
                                          sum(cost(layer, setting) for layer in range(n))))
    entry.candidates.append(Candidate("exact", _layers([KVSetting("auto")] * n),
                                      sum(cost(layer, KVSetting("auto")) for layer in range(n)),
                                      rival=False))
    held_out = _windows_of(cfg.data, tok, cfg.context, cfg.kl_batches)
    for c in tqdm(entry.candidates, desc="held-out KL", disable=not show_progress):
        c.measured_kl = plan_kl(model, held_out, [KVSetting(l["precision"], l["window"])
                                                  for l in c.layers], cfg.sinks, cfg.block_size)
    del model
    for c in tqdm(entry.candidates, desc="through the engine", disable=not show_progress):
        c.engine = asdict(_through_engine(model_dir, c, cfg))
    return entry


def _costs(config, cfg: KVBudgetConfig):
    """(layer, setting) -> the bytes a sequence of `context` tokens holds in that layer."""
    from kvslim.kv_cache.budget import sequence_bytes

    def cost(layer: int, setting) -> int:
        precision = "float32" if setting.precision == "auto" else setting.precision
        return sequence_bytes(config, layer, setting, precision, cfg.context, cfg.sinks,
                              cfg.block_size)
    return cost


def uniform_rivals(config, cfg: KVBudgetConfig, budget: int, cost) -> list:
    """Each precision for every layer: whole where it fits the budget, else with sinks + the
    widest window that does (the bytes grow with the window: bisected)."""
    from kvslim.kv_cache.budget import KVSetting
    n, rivals = config.num_hidden_layers, []

    def total(setting) -> int:
        return sum(cost(layer, setting) for layer in range(n))
    for p in cfg.precisions:
        if total(KVSetting(p)) <= budget:
            rivals.append(KVSetting(p))
            continue
        lo, hi = 0, cfg.context - cfg.sinks - 1          # lo: 0 means no window fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if total(KVSetting(p, mid)) <= budget else (lo, mid - 1)
        if lo > 0:
            rivals.append(KVSetting(p, lo))
    return rivals


def _layers(settings) -> list[dict]:
    return [{"precision": s.precision, "window": s.window} for s in settings]


def _through_engine(model_dir, c: Candidate, cfg: KVBudgetConfig) -> SettingResult:
    """Perplexity through the cache and passkey (kv_quality.py), in the memory of
    `concurrency` planned sequences; the plan through `kv_plan=`, a rival through the engine's
    uniform options."""
    from kvslim_lab.bench.kv_quality import KVSetting as EngineSetting, _corpus
    memory = c.bytes_per_sequence * cfg.concurrency
    qcfg = KVQualityConfig(kv_cache_memory=max(memory, 1), context=cfg.context, data=cfg.data,
                           max_tokens=cfg.ppl_tokens, window=cfg.ppl_window or cfg.context,
                           chunk=cfg.chunk,
                           passkey_contexts=cfg.passkey_contexts,
                           passkey_depths=cfg.passkey_depths, speed_batches=())
    first = c.layers[0]
    with tempfile.TemporaryDirectory() as tmp:
        if c.name == "plan":       # written as plan-kv writes it (kv_cache/layer_plan.py)
            path = Path(tmp) / "plan.json"
            path.write_text(json.dumps({"layers": c.layers, "sinks": cfg.sinks,
                                        "context": cfg.context, "block_size": cfg.block_size,
                                        "concurrency": cfg.concurrency}))
            options = {"kv_plan": str(path)}
        else:
            options = {"kv_cache_dtype": first["precision"], "block_size": cfg.block_size}
            if first["window"] is not None:
                options |= {"kv_window": first["window"], "kv_sink_tokens": cfg.sinks}
        return measure_setting(model_dir, EngineSetting(c.name, options),
                               _corpus(model_dir, qcfg), qcfg)
