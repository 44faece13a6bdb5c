"""One `kvslim bench report` run: the parts in order, a progress line before each, the JSON
written after each (a run stopped late keeps what it measured), then the page. The peers run's
own kvslim engines (the shipped Q4_1 blocks, eager and compiled) are started first and measured
further — the compiled step against eager at each batch, the batch-1 profiles — before the
peers' rounds run on them, so that no engine starts twice. A part that fails is reported with its
reason, never fatal; `skipped` says why each missing part is missing."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from kvslim_lab.bench.peers import catalog
from kvslim_lab.bench.peers.suite import reason_of
from kvslim_lab.bench.report.plan import COMPILED, EAGER, ReportPlan

FORMAT = 2                       # of benchmarks.json; 1 was the old standard suite's


class Progress:
    """A line on stderr before each part (the parts' own bars follow it)."""

    def __init__(self, total: int):
        self.start, self.total, self.step = time.time(), total, 0

    def __call__(self, text: str) -> None:
        self.step += 1
        print(f"[report {self.step}/{self.total}, {self.minutes:.1f} min] {text}",
              file=sys.stderr, flush=True)

    @property
    def minutes(self) -> float:
        return (time.time() - self.start) / 60


def run_report(out: Path, settings, plan: ReportPlan, ref_model: Path, skip: set[str],
               threads: int, command: str, show_progress: bool = True) -> dict:
    """Measure every part not in `skip`; writes OUT.json as it goes and returns its dict.
    show_progress: the parts' progress bars (the line before each part is always shown)."""
    from kvslim_lab.bench.machine import machine_info, memory_bandwidth
    from kvslim_lab.bench.peers.run import measure
    from kvslim_lab.bench.report.ref_model import run_ref
    progress = Progress(8)
    progress("the machine and its memory bandwidth")
    d = {"report": FORMAT, "command": command,
         "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "minutes": 0.0,
         "threads": threads, "machine": machine_info().to_dict(),
         "bandwidth": vars(memory_bandwidth()), "settings": settings.to_dict(),
         "plan": asdict(plan), "skipped": {part: "left out (--skip)" for part in sorted(skip)},
         "peers": None, "compiled_decode": None, "profile": {}, "startup": [], "ref": None,
         "capacity": None}
    opts = settings.options(threads)
    engines = catalog.build(settings.names, opts)
    ref_model = Path(ref_model)

    def part(name: str, text: str, fn) -> None:
        progress(text + (" (left out)" if name in skip else ""))
        if name not in skip:
            try:
                fn()
            except Exception as e:                   # reported in the page, never fatal
                d["skipped"][name] = f"failed: {reason_of(e)}"
        d["minutes"] = round(progress.minutes, 1)
        save(d, out)

    progress("starting the peers run's kvslim-q4_1 engines (a compiled one builds its programs)")
    llms = early_start(d, engines, skip)
    part("compiled", "the compiled decode step against eager, batch by batch",
         lambda: compiled_rates(d, llms, settings, plan, show_progress))
    part("profile", "where a batch-1 decode step's time goes, eager and compiled",
         lambda: profiles(d, llms, settings, plan))
    progress(f"peers: {len(engines)} engines, {settings.rounds} rounds"
             + ("" if "serving" in skip else ", then the serving run"))
    d["peers"] = measure(settings, threads, "serving" not in skip, show_progress, engines,
                         d["bandwidth"]).to_dict()
    save(d, out)
    part("startup", "kvslim serve's start-up, launch to first answer",
         lambda: d.update(startup=startups(settings.names, opts, plan)))
    part("ref", f"the reference model {ref_model.name} against llama.cpp",
         lambda: d.update(ref=run_ref(ref_model, settings.names, settings, opts, d["machine"],
                                      d["bandwidth"], plan.profile_steps, show_progress)))
    part("capacity", "GQA capacity", lambda: d.update(capacity=capacity(
        ref_model, plan, catalog.work_dir(opts) / "capacity", show_progress)))
    return d


def save(d: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(d, indent=2) + "\n")


def early_start(d: dict, engines: list, skip: set[str]) -> dict:
    """The peers' kvslim-q4_1 engines (eager, compiled) that the compiled and profile parts
    measure, started now: name -> its LLM. One that cannot start is left to the peers run,
    which reports it; the parts that needed it say so."""
    by = {e.name: e for e in engines if e.name in (EAGER, COMPILED)}
    wanted = set()
    if "compiled" not in skip:
        if len(by) == 2:
            wanted |= set(by)
        else:
            d["skipped"]["compiled"] = f"needs {EAGER} and {COMPILED} in --engines"
    if "profile" not in skip:
        wanted |= set(by)
        if not by:
            d["skipped"]["profile"] = f"needs {EAGER} or {COMPILED} in --engines"
    llms = {}
    for name in sorted(wanted):
        try:
            by[name].start()
            llms[name] = by[name].llm
        except Exception as e:                       # the peers run reports it again
            for part in ("compiled", "profile"):
                d["skipped"].setdefault(part, f"{name} did not start: {reason_of(e)}")
    return llms


def compiled_rates(d: dict, llms: dict, settings, plan: ReportPlan, show_progress: bool) -> None:
    from kvslim_lab.bench.compiled_decode import compare
    if len(llms) == 2:
        d["compiled_decode"] = compare({"eager": llms[EAGER], "compiled": llms[COMPILED]},
                                       plan.compiled_batches, settings.input_len,
                                       settings.decode_len, plan.compiled_rounds, show_progress)


def profiles(d: dict, llms: dict, settings, plan: ReportPlan) -> None:
    from kvslim_lab.bench.profile import profile_llm
    for name, llm in llms.items():
        mode = "compiled" if name == COMPILED else "eager"
        d["profile"][mode] = profile_llm(llm, str(catalog.shipped_dir()), (1,),
                                         settings.input_len, plan.profile_steps,
                                         compiled=mode == "compiled").to_dict()


def startups(names: list[str], opts, plan: ReportPlan) -> list[dict]:
    """`kvslim serve --compile`, then `kvslim serve`, each launched and asked one completion.
    The compiled server's is a second start: the peers run's compiled engine (the same model,
    --max-num-seqs and KV-cache size: the same programs) compiled first and left them cached."""
    from kvslim_lab.bench.peers.serving import kvslim_server, time_to_first_answer
    log_dir = catalog.work_dir(opts) / "logs"
    rows = []
    for name in [n for n in (COMPILED, EAGER) if n in names]:
        server = kvslim_server(opts.threads, log_dir, compile_decode=name == COMPILED,
                               max_num_seqs=opts.max_num_seqs)
        rows.append({"engine": name, "label": server.label,
                     **time_to_first_answer(server, plan.start_timeout)})
    return rows


def capacity(ref_model: Path, plan: ReportPlan, work: Path, show_progress: bool) -> dict:
    """The MHA reference model and its GQA (H/4 KV heads) and MQA conversions, one budget."""
    from kvslim_lab.bench.capacity import conversions, run_capacity
    from kvslim.models.config import ModelConfig
    h = ModelConfig.from_dir(ref_model).num_key_value_heads
    dirs = conversions(ref_model, sorted({h // 4, 1}, reverse=True), work, show_progress)
    return run_capacity(dirs, plan.capacity_memory, plan.capacity_context,
                        show_progress=show_progress).to_dict()
