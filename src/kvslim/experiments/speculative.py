"""`kvslim experiment speculative`: when speculative decoding wins, and by how much.

For each target model and proposer (n-gram prompt lookup, or a draft model), on two workloads —
free generation and an input-grounded one (rewriting or continuing a given passage, editing
code) — at each batch size: greedy plain decoding and speculative decoding of the same prompts
in the same run, taking turns in every repeat. Recorded per run: wall time, output tokens,
draft and accepted tokens; the greedy outputs must be identical. From these runs the adaptivity
thresholds are measured per proposer (the largest batch where it still wins, and the
acceptance at which a verification step breaks even at batch 1); a second phase then runs
plain decoding again beside each proposer with those thresholds on, to check that speculation
is then never slower. Results go to WORK_DIR/results.json; the report module writes
docs/speculative.md from them."""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams

RESULTS = "results.json"

QUESTIONS = [
    "What is the capital of France?", "Explain what a hash table is.",
    "Give three tips for writing clear emails.", "Why is the sky blue?",
    "How do vaccines work?", "Write a short poem about autumn.",
    "What causes the seasons on Earth?", "Describe how a bicycle works.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.", "How does a refrigerator keep food cold?",
    "What are the benefits of regular exercise?", "Explain recursion to a beginner.",
    "What is photosynthesis?", "How do I make a cup of tea?", "What is a black hole?",
]

CODE = [
    "def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n\n"
    "def mean(xs):\n    return total(xs) / len(xs)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
    "def read_lines(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
    "    return [line.strip() for line in lines if line.strip()]\n",
]


@dataclass
class Target:
    name: str
    model: str
    proposers: dict[str, dict]         # label -> speculative config (without adaptivity)
    chat: bool = False                 # prompts through the chat template


@dataclass
class SpecExperimentConfig:
    targets: list[Target]
    test_text: str                     # passages for the input-grounded workload
    work_dir: str = "runs/speculative"
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_tokens: int = 64
    passage_tokens: int = 120
    repeats: int = 2
    # The adaptive arm: the measured thresholds, then these settings over them.
    adaptive: dict = field(default_factory=dict)
    seed: int = 0


@dataclass
class Run:
    target: str
    proposer: str                      # "plain" for the baseline
    workload: str                      # "free" or "grounded"
    batch: int
    arm: str                           # "plain", "spec" or "adaptive"
    repeat: int
    phase: int                         # 1: plain and spec; 2: plain and adaptive
    seconds: float
    output_tokens: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0
    steps: int = 0                     # engine steps (target forward passes)
    identical: bool = True             # greedy tokens equal to plain decoding's

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def workload_prompts(target: Target, tokenizer, workload: str, text: str, n: int,
                     passage_tokens: int, seed: int) -> list:
    """Prompts (text or token ids) for one workload: free generation (questions for a chat
    model, passage openings for a base model) or input-grounded (rewrite a passage or edit
    code for a chat model; continue a passage it has just read for a base model)."""
    rng = random.Random(seed)
    ids = tokenizer.encode(text)
    starts = [rng.randrange(0, len(ids) - 2 * passage_tokens) for _ in range(n)]
    passages = [tokenizer.decode(ids[s:s + passage_tokens]) for s in starts]
    if target.chat:
        if workload == "free":
            messages = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
        else:
            messages = [f"Rename the function or class in this code to a clearer name and "
                        f"give the whole code back:\n\n{CODE[i % len(CODE)]}" if i % 2 else
                        f"Rewrite this passage in modern English, keeping every sentence:\n\n"
                        f"{passages[i]}" for i in range(n)]
        return [tokenizer.encode_chat([{"role": "user", "content": m}]) for m in messages]
    if workload == "free":
        return [ids[s:s + 32] for s in starts]
    # The passage, a blank line, then its first words again: a continuation can copy it.
    return [ids[s:s + passage_tokens] + tokenizer.encode("\n\n") + ids[s:s + 12]
            for s in starts]


WORKLOADS = ("free", "grounded")


class SpecExperiment:
    def __init__(self, cfg: SpecExperimentConfig, show_progress: bool = True):
        self.cfg = cfg
        self.work = Path(cfg.work_dir)
        self.show_progress = show_progress
        self.runs: list[Run] = []
        self.thresholds: dict[str, dict[str, dict]] = {}     # target -> proposer -> values

    @property
    def results_path(self) -> Path:
        return self.work / RESULTS

    def reload(self) -> None:
        if self.results_path.exists():
            data = json.loads(self.results_path.read_text())
            self.runs = [Run(**r) for r in data["runs"]]
            self.thresholds = data.get("thresholds", {})

    def _save(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.results_path.write_text(json.dumps(
            {"config": _config_dict(self.cfg), "thresholds": self.thresholds,
             "runs": [asdict(r) for r in self.runs]},
            indent=1) + "\n")

    def run(self) -> None:
        from tqdm import tqdm
        cfg = self.cfg
        text = Path(cfg.test_text).read_text(encoding="utf-8")
        total = sum(len(t.proposers) + 1 for t in cfg.targets) * 2 * len(WORKLOADS) \
            * len(cfg.batch_sizes) * cfg.repeats
        self.runs = []
        with tqdm(total=total, desc="speculative", unit="run",
                  disable=not self.show_progress) as bar:
            for target in cfg.targets:
                self._run_target(target, text, bar)
        self._save()

    def _engines(self, target: Target, specs: dict[str, dict], arm: str
                 ) -> dict[tuple[str, str], LLM]:
        """(proposer, arm) -> an engine; ("plain", "plain") is the baseline."""
        cfg = self.cfg
        kwargs = dict(dtype="float32", max_num_seqs=max(cfg.batch_sizes),
                      kv_cache_memory="1GiB", enable_prefix_caching=False, seed=cfg.seed)
        engines = {("plain", "plain"): LLM(target.model, **kwargs)}
        for label, spec in specs.items():
            engines[(label, arm)] = LLM(target.model, speculative=spec, **kwargs)
        for llm in engines.values():             # warm-up: first-call costs out of the runs
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0),
                         use_tqdm=False)
        return engines

    def _run_target(self, target: Target, text: str, bar) -> None:
        from kvslim.experiments.speculative_thresholds import adaptive_settings
        prompts = None
        for phase, arm in ((1, "spec"), (2, "adaptive")):
            # Phase 1 measures speculation itself: no adaptivity, whatever the defaults.
            specs = {label: {**spec, "disable_by_batch_size": None, "backoff_acceptance": 0.0}
                     for label, spec in target.proposers.items()}
            if phase == 2:
                self.thresholds[target.name] = adaptive_settings(self, target)
                specs = {label: {**spec, **self.thresholds[target.name][label]["settings"],
                                 **self.cfg.adaptive} for label, spec in specs.items()}
            engines = self._engines(target, specs, arm)
            if prompts is None:
                tokenizer = engines[("plain", "plain")].tokenizer
                prompts = {w: workload_prompts(target, tokenizer, w, text,
                                               max(self.cfg.batch_sizes),
                                               self.cfg.passage_tokens, self.cfg.seed)
                           for w in WORKLOADS}
            self._rounds(target, engines, prompts, phase, bar)
            del engines

    def _rounds(self, target: Target, engines: dict, prompts: dict, phase: int, bar) -> None:
        cfg = self.cfg
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0)
        for repeat in range(cfg.repeats):
            for workload in WORKLOADS:
                for batch in cfg.batch_sizes:
                    reference = None
                    for (label, arm), llm in engines.items():
                        run, tokens = _timed(llm, prompts[workload][:batch], params)
                        reference = tokens if reference is None else reference
                        self.runs.append(Run(target.name, label, workload, batch, arm, repeat,
                                             phase, identical=tokens == reference, **run))
                        bar.update(1)
                    self._save()


def _timed(llm: LLM, prompts: list, params: SamplingParams) -> tuple[dict, list]:
    stats = llm.engine.spec_decode_stats()
    before = (0, 0, 0) if stats is None else (stats.num_draft_tokens, stats.num_accepted_tokens,
                                              stats.num_verifications)
    steps = llm.engine.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    after = (0, 0, 0) if stats is None else (stats.num_draft_tokens, stats.num_accepted_tokens,
                                             stats.num_verifications)
    return dict(seconds=seconds, output_tokens=sum(len(t) for t in tokens),
                draft_tokens=after[0] - before[0], accepted_tokens=after[1] - before[1],
                verifications=after[2] - before[2], steps=llm.engine.num_steps - steps), tokens


def _config_dict(cfg: SpecExperimentConfig) -> dict:
    return asdict(cfg)


def smollm2_variants(work_dir: Path, calib: str, show_progress: bool = True) -> dict[str, Path]:
    """SmolLM2-135M-Instruct as float32 (the target) and the project's cheaper copies of it
    that need no new weights: its shipped 4-bit blocks kept as they are, and its MQA
    conversion (3 -> 1 KV heads, `align`). Built once under work_dir."""
    from kvslim.formats.gguf.importer import import_gguf
    from kvslim.formats.registry import default_model_gguf
    from kvslim.surgery.convert import convert_to_gqa
    gguf = default_model_gguf()
    dirs = {name: work_dir / f"smollm2-{name}" for name in ("f32", "q4", "mqa")}
    if not (dirs["f32"] / "config.json").exists():
        import_gguf(gguf, dirs["f32"], show_progress)
    if not (dirs["q4"] / "config.json").exists():
        import_gguf(gguf, dirs["q4"], show_progress, keep_quantized=True)
    if not (dirs["mqa"] / "config.json").exists():
        convert_to_gqa(dirs["f32"], dirs["mqa"], 1, "align", calib=calib,
                       show_progress=show_progress)
    return dirs
