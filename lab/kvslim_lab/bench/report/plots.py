"""The page's PNGs, from the report's JSON: the peers (bench/peers/render.py's plot), compiled
against eager at each batch, and the capacity check. Each only when its part was measured."""
from __future__ import annotations

from pathlib import Path


def plot_all(d: dict, img_dir: Path) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvslim_lab.bench.peers.render import plot as plot_peers
    img_dir.mkdir(parents=True, exist_ok=True)
    out = {"peers": plot_peers(d["peers"], img_dir / "bench-peers.png")}
    if d.get("compiled_decode"):
        out["compiled"] = _compiled(plt, d["compiled_decode"], img_dir / "bench-compiled.png")
    if d.get("capacity") and d["capacity"]["entries"]:
        out["capacity"] = _capacity(plt, d["capacity"]["entries"], img_dir / "bench-capacity.png")
    return out


def _compiled(plt, rows: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    batches = [str(r["batch"]) for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["eager_tok_s"] for r in rows], 0.4, label="eager",
           color="tab:gray")
    ax.bar([i + 0.2 for i in x], [r["compiled_tok_s"] for r in rows], 0.4, label="compiled",
           color="tab:blue")
    ax.set_xticks(list(x), batches)
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Compiled vs eager decode step, shipped Q4_1 blocks (higher is better)")
    ax.legend()
    return _save(plt, fig, path)


def _capacity(plt, entries: list[dict], path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = [f"{e['kv_heads']} KV heads" for e in entries]
    axes[0].bar(names, [e["max_sequences"] for e in entries], color="tab:purple", label="fit")
    axes[0].plot(names, [e["peak_running"] for e in entries], "ko", label="measured peak")
    axes[0].set_title("Concurrent sequences")
    axes[0].legend()
    axes[1].bar(names, [e["output_tokens_per_s"] for e in entries], color="tab:orange")
    axes[1].set_title("Sustained output tokens/s")
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
