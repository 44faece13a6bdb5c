"""Quantized checkpoints built by hand from a tiny float one: every decoder projection's weight
is replaced by random quantized tensors in some tool's layout (packed by the test, from the
layout's published rules, never by kvslim), and a float twin holds the weights they encode."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (out, in, generator) -> (the layer's stored tensors by leaf name, the float weight they encode)
MakeLayer = Callable[[int, int, torch.Generator], tuple[dict[str, torch.Tensor], torch.Tensor]]


def write_quantized_checkpoint(src: Path, dst: Path, quantization_config: dict,
                               make_layer: MakeLayer, seed: int = 0
                               ) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """dst: src with each decoder projection stored by `make_layer`; dst + "_float": the same
    model with those projections' encoded weights in float32. Returns both directories and the
    encoded weights by HF name."""
    gen = torch.Generator().manual_seed(seed)
    float_dir = dst.parent / (dst.name + "_float")
    for d in (dst, float_dir):
        shutil.copytree(src, d)
    tensors = load_file(src / "model.safetensors")
    quant, floats, expected = {}, dict(tensors), {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.rpartition(".")[2] in PROJ and leaf == "weight":
            stored, weight = make_layer(*t.shape, gen)
            quant.update({f"{prefix}.{k}": v for k, v in stored.items()})
            floats[name] = expected[name] = weight
        else:
            quant[name] = t
    save_file(quant, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, float_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, float_dir, expected


def layer_weights(model, expected: dict[str, torch.Tensor]):
    """(HF name, the loaded layer's dequantized weight for it, the expected weight)."""
    for name, ref in expected.items():
        parent, _, proj = name.rpartition(".")[0].rpartition(".")
        part, shard = model.packed_modules_mapping.get(proj, (proj, None))
        layer = model.get_submodule(f"{parent}.{part}")
        yield name, layer.dequantized_weight()[layer._shard(shard)[1]], ref


def rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
            ) -> None:
    """Replace the checkpoint's tensors with edit(tensors)."""
    tensors = load_file(path / "model.safetensors")
    save_file(edit(tensors), path / "model.safetensors", metadata={"format": "pt"})


def max_logit_error(path: Path, float_dir: Path) -> float:
    """Largest |logit| difference between kvslim's load of the quantized checkpoint and HF
    transformers' float twin, on a fixed batch of token ids."""
    from transformers import AutoModelForCausalLM

    from kvslim.formats.loader import load_model
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(1))
    hf = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids).logits
        got = load_model(path, dtype=torch.float32).logits(ids)
    return (got - ref).abs().max().item()


def greedy_matches_float_model(path: Path, float_dir: Path, prompt: list[int],
                               max_tokens: int = 12, rtol: float = 3e-2) -> list[int]:
    """Generate greedily through the engine (LLM) and check every token against the float
    model with the encoded weights, fed the same tokens: it must be that model's argmax up to
    the engine's kernels' rounding (bfloat16 activations: `rtol` of the largest logit), which
    can flip a near tie but not pick a token a wrongly loaded weight would. Returns the
    tokens."""
    from transformers import AutoModelForCausalLM

    from kvslim import LLM, SamplingParams
    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_memory="4MiB")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    hf = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    gap = logits.max(-1).values - logits.gather(1, torch.tensor(tokens).unsqueeze(1))[:, 0]
    assert len(tokens) == max_tokens
    assert float(gap.max()) <= rtol * float(logits.abs().max()), gap.tolist()
    return tokens


# ---- AWQ GEMM (AutoAWQ's layout), packed from AutoAWQ's rules ------------------------------
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]          # AutoAWQ gemm.py: order_map


def hand_pack_awq(values: np.ndarray) -> torch.Tensor:
    """AutoAWQ's loop: word c of a row gets column 8c + ORDER[k] in bits 4k … 4k + 3."""
    v = values.astype(np.uint32)
    words = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for c in range(words.shape[1]):
        for k in range(8):
            words[:, c] |= v[:, 8 * c + ORDER[k]] << np.uint32(4 * k)
    return torch.from_numpy(words.view(np.int32))


def awq_layer(group):
    def make(out, n, gen):
        groups = n // group
        q = torch.randint(0, 16, (n, out), generator=gen)
        zeros = torch.randint(0, 16, (groups, out), generator=gen)
        scales = ((torch.rand(groups, out, generator=gen) + 0.5) * (0.2 / 16)).half()
        g = torch.arange(n) // group
        weight = ((q - zeros[g]).float() * scales[g].float()).t().contiguous()
        return {"qweight": hand_pack_awq(q.numpy()), "qzeros": hand_pack_awq(zeros.numpy()),
                "scales": scales}, weight
    return make


def awq_config(group=32, **extra):
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None, **extra}


def write_awq(src, dst, group=32, **extra):
    return write_quantized_checkpoint(src, dst, awq_config(group, **extra), awq_layer(group))
