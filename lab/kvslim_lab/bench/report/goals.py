"""Issue 31's goals against one report's JSON: each a measured figure, its threshold, and for a
missed goal the measured reason (what the profile, the eager server or the slower batches show).
A figure is rounded as the page shows it before it is compared, so that a line never reads
"0.60x" beside a FAIL of "at least 0.6x"."""
from __future__ import annotations

from dataclasses import dataclass

from kvslim_lab.bench.report.plan import COMPILED, EAGER

FOUR_BIT_RATIO = 0.6             # SmolLM2 4-bit batch-1 decode / llama.cpp's best 4-bit file
REF_RATIO = 0.5                  # the reference model, the same ratio
OUTSIDE_SHARE = 0.10             # of a profiled decode step, outside any operation
SECOND_START_S = 10.0            # kvslim serve --compile, launch to first answer
COMPILED_SPEEDUP = 1.0           # compiled / eager at every batch
LLAMACPP_4BIT = ("llamacpp-q4_0", "llamacpp-q4_1")


@dataclass
class Goal:
    name: str
    value: float | None          # None: not measured
    target: float
    at_least: bool               # PASS when value >= target (else when value <= target)
    figure: str = ""             # the measured figure, as the page shows it
    reason: str = ""             # why a goal failed, or why it was not measured
    unit: str = "x"              # of the target: "x" (a ratio), "%" (a share), "s"

    @property
    def status(self) -> str:
        if self.value is None:
            return "NOT MEASURED"
        met = self.value >= self.target if self.at_least else self.value <= self.target
        return "PASS" if met else "FAIL"

    def line(self) -> str:
        if self.value is None:
            return f"- NOT MEASURED: {self.name}: {self.reason}"
        target = {"x": f"{self.target:g}x", "%": f"{self.target:.0%}",
                  "s": f"{self.target:g} s"}[self.unit]
        text = (f"- {self.status}: {self.name}: {self.figure} "
                f"(goal {'≥' if self.at_least else '≤'} {target})")
        return text + (f". Why: {self.reason}" if self.status == "FAIL" and self.reason else "")


def check_goals(d: dict) -> list[Goal]:
    return [four_bit_goal(d), ref_goal(d), *outside_goals(d), startup_goal(d),
            compiled_goal(d), capacity_goal(d)]


def _speeds(peers: dict | None, names) -> dict[str, float]:
    engines = (peers or {}).get("engines", [])
    return {e["engine"]: e["decode"]["tokens_per_s"] for e in engines
            if e["engine"] in names and e["decode"]["tokens_per_s"]}


def _ratio_goal(name: str, peers: dict | None, own_names, target: float, profile: dict | None,
                profiled: str | None, missing: str) -> Goal:
    own, peer = _speeds(peers, own_names), _speeds(peers, LLAMACPP_4BIT)
    if not own or not peer:
        return Goal(name, None, target, True, reason=missing)
    a, b = max(own, key=own.get), max(peer, key=peer.get)
    ratio = round(own[a] / peer[b], 2)
    figure = f"{ratio:.2f}x ({a} {own[a]:.1f} tok/s, {b} {peer[b]:.1f} tok/s)"
    reason = (f"{b}'s step takes {1e3 / peer[b]:.1f} ms, {a}'s {1e3 / own[a]:.1f} ms; "
              + (profile_text(profile, profiled or a) if profile else "no profile measured"))
    return Goal(name, ratio, target, True, figure, reason)


def four_bit_goal(d: dict) -> Goal:
    own = (EAGER, COMPILED)
    speeds = _speeds(d.get("peers"), own)
    best = max(speeds, key=speeds.get) if speeds else None
    profile = (d.get("profile") or {}).get("compiled" if best == COMPILED else "eager")
    return _ratio_goal("SmolLM2 4-bit batch-1 decode vs llama.cpp's faster 4-bit file",
                       d.get("peers"), own, FOUR_BIT_RATIO, profile, best,
                       "needs kvslim-q4_1 (or +compile) and llamacpp-q4_0 or -q4_1 in the run")


def ref_goal(d: dict) -> Goal:
    ref = d.get("ref") or {}
    model = ref.get("model", "the reference model")
    return _ratio_goal(f"{model} batch-1 decode vs llama.cpp's faster 4-bit file",
                       ref.get("peers"), ("kvslim-q4_1", "kvslim-f32"), REF_RATIO,
                       ref.get("profile"), ref.get("profiled_engine"),
                       (d.get("skipped") or {}).get("ref")
                       or "needs a kvslim engine and llamacpp-q4_0 or -q4_1 in the run")


def profile_text(profile: dict, engine: str) -> str:
    """What a batch-1 profile shows: the step's parts and its costliest operations."""
    p = profile["profiles"][0]
    ms, total = p["ms_per_step"], p["profiled_step_ms"]
    parts = ", ".join(f"{label} {ms[key]:.1f} ms ({ms[key] / total:.0%})" for key, label in (
        ("gemm", "GEMM"), ("attention", "attention"), ("other_ops", "other ops"),
        ("outside_ops", "outside any op")))
    top = ", ".join(f"{op_name(name)} {t:.2f} ms" for name, t in p["top_ops"][:3])
    return (f"the profiled batch-{p['batch']} step of {engine} ({total:.1f} ms, "
            f"{p.get('op_calls', 0):.0f} operator calls): {parts}; costliest: {top}")


def op_name(event: str) -> str:
    """A profiler event as the page shows it: a compiled program's by what it is."""
    if event.startswith("## Call CompiledFxGraph"):
        return "the compiled program (`CompiledFxGraph`)"
    return f"`{event}`"


def outside_goals(d: dict) -> list[Goal]:
    goals = []
    for mode, engine in (("eager", EAGER), ("compiled", COMPILED)):
        name = f"time of a batch-1 decode step outside any operation, {mode} ({engine})"
        profile = (d.get("profile") or {}).get(mode)
        if profile is None:
            goals.append(Goal(name, None, OUTSIDE_SHARE, False, unit="%", reason=(
                d.get("skipped") or {}).get("profile") or f"{engine} was not in the run"))
            continue
        p = profile["profiles"][0]
        share = round(p["ms_per_step"]["outside_ops"] / p["profiled_step_ms"], 3)
        goals.append(Goal(name, share, OUTSIDE_SHARE, False,
                          f"{share:.1%} ({p['ms_per_step']['outside_ops']:.1f} of "
                          f"{p['profiled_step_ms']:.1f} ms)", profile_text(profile, engine),
                          unit="%"))
    return goals


def startup_goal(d: dict) -> Goal:
    name = "a second start of kvslim serve --compile answers within 10 s of launch"
    rows = {r["engine"]: r for r in d.get("startup") or []}
    s = rows.get(COMPILED)
    if s is None or s["status"] != "ran":
        why = (s or {}).get("reason") or (d.get("skipped") or {}).get("startup")
        return Goal(name, None, SECOND_START_S, False, unit="s",
                    reason=why or f"{COMPILED} was not in the run")
    value = round(s["first_answer_s"], 1)
    eager = rows.get(EAGER) if rows.get(EAGER, {}).get("status") == "ran" else None
    reason = (f"it listened {s['ready_s']:.1f} s after launch"
              + (f"; the eager server answered after {eager['first_answer_s']:.1f} s, so "
                 f"{value - eager['first_answer_s']:.1f} s of the start are the compiled "
                 f"step's" if eager else ""))
    return Goal(name, value, SECOND_START_S, False, f"{value:.1f} s", reason, unit="s")


def compiled_goal(d: dict) -> Goal:
    name = "compiled decode never slower than eager, batch 1 to 64"
    rows = d.get("compiled_decode") or []
    if not rows:
        return Goal(name, None, COMPILED_SPEEDUP, True,
                    reason=(d.get("skipped") or {}).get("compiled") or "not measured")
    worst = min(rows, key=lambda r: r["speedup"])
    value = round(worst["speedup"], 2)
    slower = [r for r in rows if round(r["speedup"], 2) < COMPILED_SPEEDUP]
    batches = ", ".join(str(r["batch"]) for r in rows)
    reason = "slower at " + "; ".join(
        f"batch {r['batch']} ({r['speedup']:.2f}x: {r['compiled_tok_s']:.1f} against "
        f"{r['eager_tok_s']:.1f} tok/s)" for r in slower)
    return Goal(name, value, COMPILED_SPEEDUP, True,
                f"slowest {value:.2f}x at batch {worst['batch']} (batches {batches})", reason)


def capacity_goal(d: dict) -> Goal:
    cap = d.get("capacity")
    if not cap or len(cap["entries"]) < 2:
        return Goal("GQA holds H/K times the concurrent sequences of its MHA parent", None, 1.0,
                    True, reason=(d.get("skipped") or {}).get("capacity") or "not measured")
    base, gqa = cap["entries"][0], cap["entries"][1]
    value = round(gqa["max_sequences"] / base["max_sequences"], 2)
    return Goal(f"GQA-{gqa['kv_heads']} holds {base['kv_heads'] // gqa['kv_heads']}x the "
                f"concurrent sequences of its MHA parent", value,
                base["kv_heads"] / gqa["kv_heads"], True,
                f"{value:.2f}x ({gqa['max_sequences']} against {base['max_sequences']})",
                f"{gqa['kv_bytes_per_token']:,} KV bytes per token against "
                f"{base['kv_bytes_per_token']:,}")
