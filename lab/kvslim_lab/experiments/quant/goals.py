"""The quantization goals, checked against the recorded numbers of `kvslim experiment quant`:
PASS or FAIL when both sides were measured, NOT MEASURED (with why) when one was not."""
from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "NOT MEASURED"
LLAMA_Q4 = ("llamacpp-q4_0", "llamacpp-q4_1", "llamacpp-shipped")


@dataclass
class Goal:
    model: str
    text: str
    status: str
    detail: str

    def line(self) -> str:
        return f"- {self.status}: {self.model}: {self.text} — {self.detail}"


class _Numbers:
    """One model's recorded arms."""

    def __init__(self, results: dict, model: str):
        self.arms = {r.arm: r for r in results.values() if r.model == model}

    def get(self, arm: str, key: str):
        r = self.arms.get(arm)
        return r.numbers.get(key) if r is not None and r.status == "done" else None

    def why(self, arm: str) -> str:
        r = self.arms.get(arm)
        if r is None:
            return f"{arm} not in this run"
        return f"{arm}: {r.status}" + (f" ({r.reason})" if r.reason else "")

    def done(self, kind: str, engine: str = "kvslim") -> list:
        return [r for r in self.arms.values()
                if r.status == "done" and r.kind == kind and r.engine == engine]

    def best(self, arms: list[str], key: str) -> tuple[str | None, float | None]:
        vals = [(a, self.get(a, key)) for a in arms if self.get(a, key) is not None]
        return max(vals, key=lambda x: x[1]) if vals else (None, None)


def _ratio_goal(model, text, a_name, a, b_name, b, factor, missing) -> Goal:
    if a is None or b is None:
        return Goal(model, text, NOT_MEASURED, missing)
    ratio = a / b
    return Goal(model, text, PASS if ratio >= factor else FAIL,
                f"{a_name} {a:,.1f} vs {b_name} {b:,.1f}: {ratio:.2f}x")


def _ppl_goal(model, text, a_name, a, b_name, b, limit, missing) -> Goal:
    if a is None or b is None:
        return Goal(model, text, NOT_MEASURED, missing)
    delta = (a - b) / b
    return Goal(model, text, PASS if delta <= limit else FAIL,
                f"{a_name} {a:.3f} vs {b_name} {b:.3f} ({delta:+.2%})")


def model_goals(results: dict, model: str, group_sizes: list[int]) -> list[Goal]:
    n = _Numbers(results, model)
    dec, thr = "decode_tokens_per_s", "throughput_tokens_per_s"
    goals = [
        _ratio_goal(model, "int8 batch-1 decode >= llama.cpp q8_0", "int8", n.get("int8", dec),
                    "llama.cpp q8_0", n.get("llamacpp-q8_0", dec), 1.0,
                    f"{n.why('int8')}; {n.why('llamacpp-q8_0')}"),
        _ratio_goal(model, "int8 batch-1 decode >= 1.8x float32", "int8", n.get("int8", dec),
                    "float32", n.get("float32", dec), 1.8,
                    f"{n.why('int8')}; {n.why('float32')}")]
    four = [r.arm for r in n.done("4bit")]
    best4, best4_v = n.best(four, dec)
    bestq, bestq_v = n.best(list(LLAMA_Q4), dec)
    goals += [
        _ratio_goal(model, "4-bit batch-1 decode >= llama.cpp q4 (fastest of each)",
                    best4 or "4-bit", best4_v, f"llama.cpp {bestq}", bestq_v, 1.0,
                    "no 4-bit arm or no llama.cpp q4 file measured"),
        _ratio_goal(model, "4-bit batch-1 decode >= 2.5x float32", best4 or "4-bit", best4_v,
                    "float32", n.get("float32", dec), 2.5, "no 4-bit arm or float32 measured"),
        _ratio_goal(model, "W8A8 offline throughput >= 2x float32", "w8a8", n.get("w8a8", thr),
                    "float32", n.get("float32", thr), 2.0, n.why("w8a8")),
        _ratio_goal(model, "W8A8 offline throughput >= 2x llama.cpp parallel decoding (q8_0, "
                    "best -npl)", "w8a8", n.get("w8a8", thr), "llama.cpp q8_0",
                    n.get("llamacpp-q8_0", thr), 2.0,
                    f"{n.why('w8a8')}; {n.why('llamacpp-q8_0')}"),
        _no_slower_goal(n, model),
        _ppl_goal(model, "int8 perplexity within 0.5% of float32", "int8", n.get("int8", "ppl"),
                  "float32", n.get("float32", "ppl"), 0.005, n.why("int8"))]
    goals += _group_goals(n, model, group_sizes)
    goals.append(_ppl_goal(model, "int8 KV cache perplexity within 1% of the float cache",
                           "int8 KV", n.get("kv-int8", "ppl"), "float KV",
                           n.get("kv-int8", "ppl_float_kv"), 0.01, n.why("kv-int8")))
    goals += _size_goals(n, model, four)
    return goals


def _no_slower_goal(n: _Numbers, model: str) -> Goal:
    text = "no quantized mode slower than float32 at any batch size measured (1 and offline)"
    base = {k: n.get("float32", k) for k in ("decode_tokens_per_s", "throughput_tokens_per_s")}
    if None in base.values():
        return Goal(model, text, NOT_MEASURED, n.why("float32"))
    slower, compared = [], 0
    for r in n.arms.values():
        if r.engine != "kvslim" or r.kind == "float" or r.status != "done":
            continue
        for key, what in (("decode_tokens_per_s", "batch 1"), ("throughput_tokens_per_s",
                                                                "offline")):
            v = r.numbers.get(key)
            if v is not None:
                compared += 1
                if v < base[key]:
                    slower.append(f"{r.arm} {what} {v:,.1f} < {base[key]:,.1f}")
    if not compared:
        return Goal(model, text, NOT_MEASURED, "no quantized arm measured")
    return Goal(model, text, FAIL if slower else PASS,
                "; ".join(slower) if slower else f"{compared} comparisons, none slower")


def _group_goals(n: _Numbers, model: str, group_sizes: list[int]) -> list[Goal]:
    """GPTQ-4 and AWQ-4 vs RTN-4 at the largest group size the model allowed."""
    allowed = [g for g in sorted(group_sizes, reverse=True)
               if n.get(f"rtn-4-g{g}", "ppl") is not None]
    refused = [f"g{g}: {n.arms[f'rtn-4-g{g}'].reason}" for g in group_sizes
               if f"rtn-4-g{g}" in n.arms and n.arms[f"rtn-4-g{g}"].status == "not possible"]
    goals = []
    for method in ("gptq", "awq"):
        text = f"{method.upper()}-4 perplexity better than RTN-4"
        if not allowed:
            goals.append(Goal(model, text, NOT_MEASURED, "no RTN-4 arm measured"))
            continue
        g = allowed[0]
        text += f" at g{g}, the largest group size measured here" + (
            f" ({'; '.join(refused)})" if refused else "")
        a, b = n.get(f"{method}-4-g{g}", "ppl"), n.get(f"rtn-4-g{g}", "ppl")
        goals.append(_ppl_goal(model, text, f"{method}-4-g{g}", a, f"rtn-4-g{g}", b, -1e-12,
                               n.why(f"{method}-4-g{g}")))
    return goals


def _size_goals(n: _Numbers, model: str, four: list[str]) -> list[Goal]:
    """4-bit bytes against the same weights in bfloat16: half the float32 arm's."""
    goals = []
    for key, what in (("weight_bytes", "whole checkpoint"), ("linear_bytes", "decoder linears")):
        text = f"4-bit weights >= 3.5x smaller than bfloat16 ({what})"
        f32 = n.get("float32", key)
        sizes = [(a, n.get(a, key)) for a in four if n.get(a, key)]
        if f32 is None or not sizes:
            goals.append(Goal(model, text, NOT_MEASURED, "no 4-bit arm or float32 measured"))
            continue
        arm, size = min(sizes, key=lambda x: x[1])
        ratio = f32 / 2 / size
        goals.append(Goal(model, text, PASS if ratio >= 3.5 else FAIL,
                          f"{arm} {size / 1e6:.1f} MB vs bf16 {f32 / 2e6:.1f} MB: {ratio:.2f}x"))
    return goals
