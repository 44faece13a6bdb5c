"""Which 4- and 2-bit KV-cache scheme keeps a model's perplexity: a probe run before building one
into the engine (the KV cache at 4 and 2 bits). Every layer's K and V are quantized and read
back (fake quantization) inside the dense perplexity pass, then attended as usual, so each
scheme's loss of quality is measured on the same windows with nothing else changed:

- `token-gN`: per token and KV head, symmetric, one float16 scale per N channels (the engine's
  int8 cache today is `int8 token-g<head_dim>`);
- `kivi-gN`: KIVI (arXiv 2402.02750): keys per channel over runs of N tokens, values per token
  in groups of N channels, both asymmetric (scale and minimum);
- `+rot`: K and V rotated by a normalized Hadamard matrix along head_dim before quantizing and
  back after (QuaRot/TurboQuant-style), which spreads outlier channels.

    python benchmarks/kv_lowbit_probe.py [--model DIR] [--data ../shared/corpus/test.txt]
        [--max-tokens 8192] [--json] [--out docs/kv_lowbit_probe.json]

The default model is the embedded SmolLM2 (its Q4_1 weights dequantized per call); windows of
512 tokens, stride 256, as the README's perplexity table."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kvslim.attention.dense import DenseAttention
from kvslim.eval.perplexity import perplexity
from kvslim.formats.loader import load_model
from kvslim.formats.registry import resolve_model
from kvslim.tokenizer.tokenizer import Tokenizer
from kvslim.train.data import tokenize_file

SCHEMES = ["float", "int8 token-g64", "int4 token-g32", "int4 token-g32+rot", "int4 kivi-g32",
           "int4 kivi-g32+rot", "int2 token-g32+rot", "int2 kivi-g32", "int2 kivi-g32+rot"]


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def symmetric(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    scale = (x.abs().amax(dim, keepdim=True) / qmax).clamp_min(1e-8).half().float()
    return (x / scale).round().clamp(-qmax - 1, qmax) * scale


def asymmetric(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    top = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / top).clamp_min(1e-8).half().float()
    lo = lo.half().float()
    return ((x - lo) / scale).round().clamp(0, top) * scale + lo


def per_channel_groups(x: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """KIVI's keys: x [B, T, KVH, D], one scale and minimum per channel over runs of n tokens."""
    b, t, h, d = x.shape
    pad = -t % n
    padded = torch.cat([x, x[:, -1:].expand(b, pad, h, d)], 1) if pad else x
    runs = padded.view(b, -1, n, h, d)
    return asymmetric(runs, bits, 2).view(b, -1, h, d)[:, :t]


def per_token_groups(x: torch.Tensor, bits: int, n: int, sym: bool) -> torch.Tensor:
    shape = x.shape
    groups = x.reshape(*shape[:-1], shape[-1] // n, n)
    out = symmetric(groups, bits, -1) if sym else asymmetric(groups, bits, -1)
    return out.reshape(shape)


def fake_quantize(scheme: str, k: torch.Tensor, v: torch.Tensor):
    if scheme == "float":
        return k, v
    bits_name, layout = scheme.split()
    bits, rotate = int(bits_name.removeprefix("int")), layout.endswith("+rot")
    kind, group = layout.removesuffix("+rot").split("-g")
    n = int(group)
    rot = hadamard(k.shape[-1]).to(k) if rotate else None
    if rot is not None:
        k, v = k @ rot, v @ rot
    if kind == "token":
        k, v = (per_token_groups(x.float(), bits, n, sym=True).to(x) for x in (k, v))
    else:
        k = per_channel_groups(k.float(), bits, n).to(k)
        v = per_token_groups(v.float(), bits, n, sym=False).to(v)
    if rot is not None:
        k, v = k @ rot.T, v @ rot.T
    return k, v


def measure(model, tokens, schemes: list[str], bos: int | None) -> dict:
    original = DenseAttention.attend
    results = {}
    for scheme in schemes:
        def attend(self, layer_idx, q, k, v, scale, scheme=scheme):
            k, v = fake_quantize(scheme, k, v)
            return original(self, layer_idx, q, k, v, scale)
        DenseAttention.attend = attend
        try:
            r = perplexity(model, tokens, 512, 256, show_progress=False, bos_token_id=bos)
        finally:
            DenseAttention.attend = original
        results[scheme] = {"perplexity": r.perplexity, "num_tokens": r.num_tokens}
        print(f"{scheme:>20}: perplexity {r.perplexity:.4f}", flush=True)
    base = results["float"]["perplexity"] if "float" in results else None
    for r in results.values():
        r["vs_float"] = r["perplexity"] / base - 1 if base else None
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--data", default="../shared/corpus/test.txt")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model_dir = resolve_model(args.model, quantized=True)
    model = load_model(model_dir, dtype="float32")
    tokenizer = Tokenizer.from_dir(model_dir)
    tokens = tokenize_file(args.data, tokenizer, False)[:args.max_tokens]
    with torch.inference_mode():
        results = measure(model, tokens, args.schemes.split(","), tokenizer.prepended_bos_id)
    out = {"model": args.model, "data": args.data, "max_tokens": args.max_tokens,
           "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
