"""The rounds of `kvslim bench peers` and their result: every engine started once, then in each
round every engine's batch-1 decode, then every engine's offline run, so that a slow spell of
a shared machine falls on all of them; cells are medians over the rounds."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from kvslim_lab.bench.workload import Workload


class Unavailable(Exception):
    """An engine that cannot run here; the message says why (reported, never a crash)."""


@dataclass
class PeersPlan:
    decode: Workload = field(default_factory=lambda: Workload(1, 128, 64, seed=1))
    offline: Workload | None = field(default_factory=lambda: Workload(64, 128, 128))
    rounds: int = 3                          # offline None: batch-1 decode only

    @property
    def parts(self) -> tuple[str, ...]:
        return ("decode", "offline") if self.offline is not None else ("decode",)


@dataclass
class EngineRuns:
    """One engine's measurements over the rounds. `offline_runs`: output tokens/s per setting
    (a batch size, a number of parallel sequences) the engine tried; the best setting's median
    is its number."""
    engine: str
    label: str
    reason: str = ""                         # why it was skipped or stopped, when it was
    decode_tpot_s: list[float] = field(default_factory=list)
    offline_runs: dict[str, list[float]] = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float | None:
        if not self.decode_tpot_s:
            return None
        return round(1 / statistics.median(self.decode_tpot_s), 1)

    @property
    def best_setting(self) -> str | None:
        runs = {k: v for k, v in self.offline_runs.items() if v}
        return max(runs, key=lambda k: statistics.median(runs[k])) if runs else None

    @property
    def offline_tokens_per_s(self) -> float | None:
        best = self.best_setting
        return None if best is None else round(statistics.median(self.offline_runs[best]), 1)

    def to_dict(self) -> dict:
        ran = bool(self.decode_tpot_s or self.best_setting)
        tpot = statistics.median(self.decode_tpot_s) if self.decode_tpot_s else None
        return {"engine": self.engine, "label": self.label,
                "status": "ran" if ran else "skipped", "reason": self.reason,
                "decode": {"tokens_per_s": self.decode_tokens_per_s,
                           "tpot_ms": None if tpot is None else round(tpot * 1e3, 3),
                           "tpot_ms_runs": [round(t * 1e3, 3) for t in self.decode_tpot_s]},
                "offline": {"output_tokens_per_s": self.offline_tokens_per_s,
                            "best_setting": self.best_setting, "runs": self.offline_runs}}


@dataclass
class PeersResult:
    plan: dict
    threads: int
    machine: dict
    bandwidth: dict
    engines: list[EngineRuns] = field(default_factory=list)
    started: str = ""
    seconds: float = 0.0
    command: str = ""
    serving: list[dict] = field(default_factory=list)   # serving.py's entries, when run

    def ratios(self, metric: str) -> dict[str, float]:
        """Each kvslim engine's number over each other engine's, both from this run."""
        value = {e.engine: getattr(e, metric) for e in self.engines}
        own = [n for n in value if n.startswith("kvslim") and value[n]]
        return {f"{a}/{b}": round(value[a] / value[b], 2) for a in own for b in value
                if not b.startswith("kvslim") and value[b]}

    def to_dict(self) -> dict:
        return {"command": self.command, "started": self.started, "seconds": round(self.seconds),
                "threads": self.threads, "machine": self.machine, "bandwidth": self.bandwidth,
                "plan": self.plan, "engines": [e.to_dict() for e in self.engines],
                "ratios": {"decode": self.ratios("decode_tokens_per_s"),
                           "offline": self.ratios("offline_tokens_per_s")},
                "serving": self.serving}


def plan_dict(plan: PeersPlan) -> dict:
    return {"decode": asdict(plan.decode),
            "offline": asdict(plan.offline) if plan.offline is not None else None,
            "rounds": plan.rounds}


def start_all(engines: list, show_progress: bool) -> tuple[list, list[EngineRuns]]:
    """Start every engine (load its model, build its files); one that cannot run is kept as a
    skipped entry with its reason."""
    started, runs = [], []
    for engine in tqdm(engines, desc="starting engines", disable=not show_progress):
        try:
            engine.start()
        except Exception as e:                       # any failure to start is a reason
            runs.append(EngineRuns(engine.name, engine.label, reason_of(e)))
            _close(engine)                           # what it started before failing
            continue
        started.append(engine)
        runs.append(EngineRuns(engine.name, engine.label))
    return started, runs


def run_rounds(engines: list, runs: list[EngineRuns], prompts: dict[str, list[list[int]]],
               plan: PeersPlan, show_progress: bool) -> None:
    """Every round: each engine's batch-1 decode, then each engine's offline run. An engine
    that fails stops there, its reason kept and its earlier rounds with it."""
    by_name = {r.engine: r for r in runs}
    live = list(engines)
    bar = tqdm(total=plan.rounds * len(plan.parts) * len(live), desc="peers",
               disable=not show_progress)
    for round_ in range(plan.rounds):
        for part in plan.parts:
            for engine in list(live):
                bar.set_postfix_str(f"round {round_ + 1} {part} {engine.name}")
                record = by_name[engine.name]
                try:
                    if part == "decode":
                        record.decode_tpot_s.append(
                            engine.decode(prompts["decode"][0], plan.decode.output_len))
                    else:
                        for setting, value in engine.offline(
                                prompts["offline"], plan.offline.output_len).items():
                            record.offline_runs.setdefault(setting, []).append(value)
                except Exception as e:
                    record.reason = f"failed in round {round_ + 1} ({part}): {reason_of(e)}"
                    live.remove(engine)
                    _close(engine)
                bar.update(1)
    bar.close()
    for engine in live:
        _close(engine)


def _close(engine) -> None:
    try:
        engine.close()
    except Exception:                                # closing is best effort
        pass


def reason_of(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if isinstance(e, Unavailable) and text
            else f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": "))


def run_peers(engines: list, prompts: dict[str, list[list[int]]], plan: PeersPlan,
              machine: dict, bandwidth: dict, threads: int, show_progress: bool = True
              ) -> PeersResult:
    """`prompts`: {"decode": [ids], "offline": [ids, ...]}, the same for every engine."""
    t0 = time.time()
    result = PeersResult(plan_dict(plan), threads, machine, bandwidth,
                         started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)))
    started, result.engines = start_all(engines, show_progress)
    run_rounds(started, result.engines, prompts, plan, show_progress)
    result.seconds = time.time() - t0
    return result
