"""`kvslim experiment speculative`: when speculative decoding wins, and by how much.

For each target model and proposer (n-gram prompt lookup, or a draft model), on two workloads —
free generation and an input-grounded one (rewriting or continuing a given passage, editing
code) — at each batch size: greedy plain decoding and speculative decoding of the same prompts
in the same run, taking turns in every repeat. Recorded per run: wall time, output tokens,
draft and accepted tokens; the greedy outputs must be identical. From these runs the adaptivity
thresholds are measured per proposer (the largest batch where it still wins, and the
acceptance at which a verification step breaks even at batch 1); a second phase then runs
plain decoding again beside each proposer with those thresholds on, to check that speculation
is then never slower. Results go to WORK_DIR/results.json (saved as they come); the report
module writes docs/speculative.md from them. A target whose runs there are complete, under the
same target and settings, is kept rather than measured again (`resume`): each target's ratios
come from its own runs, taken in turns, so a study too long for one sitting can be finished in
another."""
from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict
from pathlib import Path

from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams
from kvslim_lab.experiments.speculative.records import Run, SpecExperimentConfig, Target
from kvslim_lab.experiments.speculative.thresholds import adaptive_settings
from kvslim_lab.experiments.speculative.workloads import WORKLOADS, workload_prompts

RESULTS = "results.json"


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

    def run(self, resume: bool = True) -> list[str]:
        """Measure every target (with `resume`, those complete in results.json kept, and a
        target whose first phase is complete there goes on with its second); returns the
        names of the targets kept whole."""
        from tqdm import tqdm
        cfg = self.cfg
        text = Path(cfg.test_text).read_text(encoding="utf-8")
        saved = self._saved_runs() if resume else {}
        kept = {n: r for n, r in saved.items() if len(r) == self.runs_per_target(_named(cfg, n))}
        self.runs = [r for runs in kept.values() for r in runs]
        self.thresholds = {name: t for name, t in self.thresholds.items() if name in kept}
        todo = [t for t in cfg.targets if t.name not in kept]
        total = sum(self.runs_per_target(t) for t in todo)
        with tqdm(total=total, desc="speculative", unit="run",
                  disable=not self.show_progress) as bar:
            for target in todo:
                first = [r for r in saved.get(target.name, []) if r.phase == 1]
                whole = len(first) == self.runs_per_target(target) // 2
                self._run_target(target, text, bar, first if whole else None)
        self._save()
        return list(kept)

    def runs_per_target(self, target: Target) -> int:
        cfg = self.cfg
        return (len(target.proposers) + 1) * 2 * len(WORKLOADS) * len(cfg.batch_sizes) \
            * cfg.repeats

    def _saved_runs(self) -> dict[str, list[Run]]:
        """target name -> its runs in results.json, for each target measured there with this
        target's definition and these settings (complete or not)."""
        if not self.results_path.exists():
            return {}
        data = json.loads(self.results_path.read_text())
        saved, now = data["config"], _config_dict(self.cfg)
        settings = [k for k in now if k not in ("targets", "work_dir")]
        if any(saved.get(k) != now[k] for k in settings):
            return {}
        self.thresholds = data.get("thresholds", {})
        defined = {t["name"]: t for t in saved["targets"]}
        runs = [Run(**r) for r in data["runs"]]
        return {t.name: [r for r in runs if r.target == t.name] for t in self.cfg.targets
                if defined.get(t.name) == asdict(t)}

    def _completed_targets(self) -> dict[str, list[Run]]:
        """The targets `run` keeps whole: complete in results.json, their thresholds there."""
        return {name: runs for name, runs in self._saved_runs().items()
                if name in self.thresholds
                and len(runs) == self.runs_per_target(_named(self.cfg, name))}

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

    def _run_target(self, target: Target, text: str, bar,
                    first_phase: list[Run] | None = None) -> None:
        """Both phases; `first_phase`: the first's runs, measured before (only the second
        runs)."""
        prompts = None
        phases = ((1, "spec"), (2, "adaptive"))
        if first_phase:
            self.runs += first_phase
            bar.update(len(first_phase))
            phases = phases[1:]
        for phase, arm in phases:
            # Phase 1 measures speculation itself: no adaptivity, whatever the defaults.
            specs = {label: {**spec, "disable_by_batch_size": None, "backoff_acceptance": 0.0}
                     for label, spec in target.proposers.items()}
            if phase == 2:
                self.thresholds[target.name] = adaptive_settings(self.runs, self.cfg.batch_sizes,
                                                                 target)
                specs = {label: {**spec, **self.thresholds[target.name][label]["settings"],
                                 **self.cfg.adaptive} for label, spec in specs.items()}
            engines = self._engines(target, specs, arm)
            if prompts is None:
                tokenizer = engines[("plain", "plain")].tokenizer
                prompts = {w: workload_prompts(target, tokenizer, w, text,
                                               max(*self.cfg.batch_sizes, self.cfg.min_prompts),
                                               self.cfg.passage_tokens, self.cfg.seed)
                           for w in WORKLOADS}
            self._rounds(target, engines, prompts, phase, bar)
            # the next phase's engines need the memory: nine SmolLM2 engines hold ~14 GB, and
            # an engine's reference cycles keep it until the collector runs
            engines.clear()
            gc.collect()

    def _rounds(self, target: Target, engines: dict, prompts: dict, phase: int, bar) -> None:
        cfg = self.cfg
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0)
        for repeat in range(cfg.repeats):
            for workload in WORKLOADS:
                for batch in cfg.batch_sizes:
                    reference = None
                    batch_prompts = prompts[workload][:max(batch, cfg.min_prompts)]
                    for (label, arm), llm in engines.items():
                        run, tokens = _timed(llm, batch_prompts, params, batch)
                        reference = tokens if reference is None else reference
                        self.runs.append(Run(target.name, label, workload, batch, arm, repeat,
                                             phase, identical=tokens == reference, **run))
                        bar.update(1)
                    self._save()


def _timed(llm: LLM, prompts: list, params: SamplingParams, batch: int
           ) -> tuple[dict, list]:
    """`prompts` decoded `batch` at a time (one generate call each), timed as one run."""
    before = _spec_counts(llm)
    steps = llm.engine.num_steps
    start = time.perf_counter()
    outs = [o for i in range(0, len(prompts), batch)
            for o in llm.generate(prompts[i:i + batch], params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    during = {k: [a - b for a, b in zip(v, before[k])] if isinstance(v, list) else v - before[k]
              for k, v in _spec_counts(llm).items()}
    return dict(seconds=seconds, output_tokens=sum(len(t) for t in tokens),
                steps=llm.engine.num_steps - steps, **during), tokens


def _spec_counts(llm: LLM) -> dict:
    """The engine's speculation counters so far, under Run's names (none: plain decoding)."""
    stats = llm.engine.spec_decode_stats()
    if stats is None:
        return {}
    return dict(draft_tokens=stats.num_draft_tokens, accepted_tokens=stats.num_accepted_tokens,
                verifications=stats.num_verifications,
                drafted_per_depth=list(stats.drafted_per_position),
                accepted_per_depth=list(stats.accepted_per_position))


def _named(cfg: SpecExperimentConfig, name: str) -> Target:
    return next(t for t in cfg.targets if t.name == name)


def _config_dict(cfg: SpecExperimentConfig) -> dict:
    return asdict(cfg)


def smollm2_variants(work_dir: Path, calib: str, show_progress: bool = True,
                     copies: tuple[str, ...] = ("q4", "mqa")) -> dict[str, Path]:
    """SmolLM2-135M-Instruct as float32 (the target) and the project's cheaper `copies` of it
    that need no new weights: its shipped 4-bit blocks kept as they are ("q4"), and its MQA
    conversion (3 -> 1 KV heads, `align`: "mqa"). Built once under work_dir."""
    from kvslim.formats.gguf.importer import import_gguf
    from kvslim.formats.registry import default_model_gguf
    from kvslim.surgery.convert import convert_to_gqa
    gguf = default_model_gguf()
    dirs = {name: work_dir / f"smollm2-{name}" for name in ("f32", *copies)}
    if not (dirs["f32"] / "config.json").exists():
        import_gguf(gguf, dirs["f32"], show_progress)
    if "q4" in dirs and not (dirs["q4"] / "config.json").exists():
        import_gguf(gguf, dirs["q4"], show_progress, keep_quantized=True)
    if "mqa" in dirs and not (dirs["mqa"] / "config.json").exists():
        convert_to_gqa(dirs["f32"], dirs["mqa"], 1, "align", calib=calib,
                       show_progress=show_progress)
    return dirs
