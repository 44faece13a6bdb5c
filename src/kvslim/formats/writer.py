"""Write an HF-format model directory that `transformers.from_pretrained` and kvslim both load."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvslim.models.config import ModelConfig
from kvslim.dtypes import dtype_name
from kvslim.models.families import family_of

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def save_model(state_dict: dict[str, torch.Tensor], config: ModelConfig, out_dir: str | Path,
               dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 1024**3,
               tokenizer_from: str | Path | None = None) -> Path:
    """Save weights (sharded above `max_shard_bytes`, with an index like save_pretrained) and
    config.json; copy the tokenizer files from `tokenizer_from` if given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in family_of(config).to_checkpoint(state_dict, config).items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().to("cpu")
        tensors[name] = (t.to(dtype) if dtype is not None else t).contiguous()
    stored = dtype or next(iter(tensors.values())).dtype
    cfg = config.replace(torch_dtype=dtype_name(stored)).to_hf_dict()
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    _write_shards(tensors, out, max_shard_bytes)
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, out)
    return out


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> None:
    for stale in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        stale.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
