"""The PNG plots of `kvslim experiment gqa`, drawn only from the recorded runs."""
from __future__ import annotations

from pathlib import Path

from kvslim_lab.experiments.gqa.mla_arms import is_mla
from kvslim_lab.experiments.gqa.study import Experiment
from kvslim_lab.experiments.gqa.goals import (METHOD_ORDER, SMOLLM2_GOAL, ref_index,
                                          smollm2_tokens)

COLORS = {"mean": "tab:blue", "first": "tab:orange", "random": "tab:gray", "align": "tab:green",
          "align-kd": "tab:red", "align-nu": "tab:purple", "align-nu-kd": "tab:brown",
          "mla": "tab:cyan", "mla-kd": "tab:pink", "mla-mha2mla": "tab:olive", "mha": "black"}


def plot(exp: Experiment, img_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    img_dir.mkdir(parents=True, exist_ok=True)
    paths = [_ppl_vs_alpha(exp, img_dir / "gqa-ppl-vs-alpha.png"),
             _ppl_vs_kv_bytes(exp, img_dir / "gqa-ppl-vs-kv-bytes.png")]
    if any(r.model == "smollm2" for r in exp.results.values()):
        paths.append(_smollm2_ppl_vs_tokens(exp, img_dir / "gqa-smollm2-ppl-vs-tokens.png"))
    return paths


def _ppl_vs_alpha(exp: Experiment, path: Path) -> Path:
    import matplotlib.pyplot as plt
    idx = ref_index(exp.results)
    h = exp.config.num_attention_heads
    ks = sorted({k for k, m, _ in idx if m != "mha"}, reverse=True)
    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 4), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, k in zip(axes, ks):
        for m in ["mha"] + METHOD_ORDER:
            kk = h if m == "mha" else k
            pts = sorted((a, idx[(kk, m, a)].test_ppl) for a in exp.all_alphas
                         if (kk, m, a) in idx)
            if m.endswith("-kd") and (k, m.removesuffix("-kd"), 0.0) in idx and pts:
                pts.insert(0, (0.0, idx[(k, m.removesuffix("-kd"), 0.0)].test_ppl))
            if pts:
                ax.plot(*zip(*pts), marker="o", color=COLORS[m],
                        label="MHA control" if m == "mha" else m,
                        linestyle="--" if m == "mha" else "-")
        ax.set_title(f"{'MQA' if k == 1 else f'GQA-{k:g}'} bytes (from {h} heads)")
        ax.set_xlabel("uptraining fraction alpha")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test perplexity")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ppl_vs_kv_bytes(exp: Experiment, path: Path) -> Path:
    import matplotlib.pyplot as plt
    idx = ref_index(exp.results)
    h = exp.config.num_attention_heads
    ks = sorted({k for k, m, _ in idx if m != "mha"}, reverse=True)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    arms = [("mean", 0.0), ("align", 0.0), ("align-nu", 0.0), ("mla", 0.0), ("mla-mha2mla", 0.0),
            ("mean", 0.05), ("align", 0.05), ("align-kd", 0.05), ("align-nu-kd", 0.05),
            ("mla", 0.05), ("mla-kd", 0.05)]
    for m, a in arms:
        pts = [(idx[(k, m, a)].kv_bytes_per_token_bf16, idx[(k, m, a)].test_ppl)
               for k in ks if (k, m, a) in idx]
        if (h, "mha", a) in idx:
            pts.append((idx[(h, "mha", a)].kv_bytes_per_token_bf16, idx[(h, "mha", a)].test_ppl))
        if len(pts) > 1:
            # MLA arms: squares, at the bytes of the GQA arms they are compared with
            ax.plot(*zip(*sorted(pts)), marker="s" if is_mla(m) else "o", color=COLORS[m],
                    linestyle="-" if a else ":", label=f"{m}, alpha={a:g}")
    ax.set_xscale("log", base=2)
    return _save(fig, ax, path, "KV-cache bytes per token (bf16)", "Quality vs KV-cache size")


def _smollm2_ppl_vs_tokens(exp: Experiment, path: Path) -> Path:
    import matplotlib.pyplot as plt
    runs = [r for r in exp.results.values() if r.model == "smollm2"]
    orig = next((r for r in runs if r.method == "original"), None)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    arms = sorted({(r.method, r.kv_heads) for r in runs if r.method != "original"})
    for method, k in arms:
        conversion = method.removesuffix("-kd")
        pts = {smollm2_tokens(exp, r): r.test_ppl for r in runs
               if r.kv_heads == k and r.method in (method, conversion)
               and (r.method == method or r.uptrain_steps == 0)}
        if not any(t for t in pts) and method != conversion:
            continue
        share = f"{k / 3:.2g} of the KV bytes" if orig else f"{k:g} KV heads"
        ax.plot(*zip(*sorted(pts.items())), marker="o", color=COLORS.get(method, "tab:olive"),
                label=f"{method} ({share})")
    if orig:
        ax.axhline(orig.test_ppl, color="black", linestyle="--", label="original (3 KV heads)")
        ax.axhline(orig.test_ppl * (1 + SMOLLM2_GOAL), color="black", linestyle=":",
                   label=f"goal: +{SMOLLM2_GOAL:.0%}")
    return _save(fig, ax, path, "uptraining tokens",
                 "SmolLM2-135M: perplexity vs uptraining tokens")


def _save(fig, ax, path: Path, xlabel: str, title: str) -> Path:
    """Log perplexity axis, labels, grid and legend; written and closed."""
    import matplotlib.pyplot as plt
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
