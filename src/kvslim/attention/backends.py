"""Which paged-attention backend a step uses, and the one place that builds its context.

- "gather" (`paged.py`, the reference): copies each sequence's context out of the paged cache
  into a dense tensor, every layer and step, and runs SDPA on it (decodes batched, prefill
  chunks one by one).
- "flex" (`flex.py`): one FlexAttention call per layer over the whole pool, reading K/V in place
  through the block tables, decodes and prefill chunks together.
- "kernel" (the CPU): `paged.py` with every token of the step, decodes and prefill chunks,
  through kvslim's own C++ kernel (kernels/paged_attention.py), which reads each KV head's
  blocks in place once for its group of query heads, each query over the keys before its own
  position: batch-invariant, and a prompt's numbers do not depend on its chunking or on a
  prefix-cache hit. float32 models, float32 or int8 caches.
- "auto": gather on CUDA (`CUDA_DEFAULT`, measured on an H200); on the CPU the kernel where it runs (`CPU_DEFAULT`, measured), else
  gather; a model with DeepSeek's latent cache (MLA, `latent_cache.py`) likewise
  (`CPU_DEFAULT_LATENT`): the kernel reads it as one KV head whose value is a view of the key's
  first entries.

The engine resolves the name once (`resolve_attention_backend`) and builds each step's context
with `build_paged_attention`, on the eager path and on the decode-graph path alike."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvslim.attention.kv_cache import KVCacheLayer
from kvslim.attention.metadata import PagedStepLayout, build_layer_metadata
from kvslim.attention.paged import PagedAttention
from kvslim.errors import KvslimError
from kvslim.kernels import paged_attention

if TYPE_CHECKING:
    from kvslim.attention.flex import FlexPagedAttention

ATTENTION_BACKENDS = ("auto", "gather", "flex", "kernel")

# The CPU default, measured by `python benchmarks/paged_attention_choice.py --backends
# gather,flex,kernel --threads 2 --json --out docs/paged_attention_choice.json` (2-core AMD
# EPYC, torch 2.13 CPU, float32, SmolLM2-135M's attention: 9 query heads over 3 KV heads,
# head_dim 64, blocks of 16; ms per layer, the step's metadata amortised over 30 layers; the
# pool exactly the step's blocks, shuffled):
#   step                                gather    flex (eager)   kernel
#   decode, batch 1, context 256          0.11     17.9            0.04
#   decode, batch 8, context 256          0.44     29.2            0.23
#   decode, batch 32, context 256         2.27     54.3            1.86
#   decode, batch 1, context 1024         0.36     19.6            0.16
#   decode, batch 8, context 1024         2.96     35.1            1.99
#   decode, batch 32, context 1024       29.8     254              9.67
#   prefill 256 after 768 cached          9.17     43.1           27.9
# (a busy shared machine: cells move by up to 2x between runs, docs/paged_attention_choice.json
# holds this one). Eager FlexAttention scores every pool slot (repeating K/V per query head
# inside), and each call costs milliseconds of Python machinery (pytree flattening, vmap over
# the mask) before any arithmetic. kvslim's kernel (a work item per sequence, KV head and 64
# keys) is the fastest at every decode step, and the only one of the three that is
# batch-invariant: torch's SDPA over the gathered context runs other arithmetic for one
# sequence than for two or more on two threads of this machine (a greedy server answer's
# logprobs changed when a second request joined: benchmarks/stream_invariance.py), and over
# a prefill chunk its numbers depend on where the chunk starts. The kernel runs prefill
# queries one by one, 3-5x slower than SDPA's matrix products there: the CPU still takes it
# (invariance first; offline 64 x 128/128 measured level, README), and `gather` prefills long
# prompts faster. Where the kernel cannot run (no extension, a bfloat16 model, an fp8 cache)
# the CPU gathers.
CPU_DEFAULT = "kernel"
# CUDA's default, measured on an H200 (docs/cuda_decode_check.json, 2026-12-04: `python
# benchmarks/cuda_decode_check.py`; contexts of 128-256 tokens, greedy tokens identical):
#                                 batch-1 decode tok/s      offline 64 x 128/128 tok/s
#                                 gather+graphs  flex+graphs  gather+graphs  flex+graphs
#   SmolLM2-135M shape, float32       275           —             6531          3462
#   Llama 1B shape, bfloat16          376          345            9919          6169
# Gathering these short contexts costs less than FlexAttention's block-mask machinery and its
# per-shape kernels (each new step shape compiles one: start-up pays for every graph size).
# Long contexts, where reading K/V in place should pay, are not measured yet.
CUDA_DEFAULT = "gather"
# A latent (MLA) cache's CPU default, measured by `python benchmarks/mla_decode_backend.py`:
# `... runs/mla/ref-k2-mla runs/mla/ref-k1-mla runs/mla/smollm2-r64-mla --json` (kvslim convert
# --to-mla of ref-mha at ranks 64 and 32 and of SmolLM2 at 64; docs/mla_decode_backend.json,
# 2 threads, 128 tokens in, 64 out): the kernel 1.16-1.19x gather at batch 1, 0.93-1.02x at
# batch 32. It is also the batch-invariant one, as for CPU_DEFAULT: it takes the latent cache.
CPU_DEFAULT_LATENT = "kernel"


def check_attention_backend(name: str) -> None:
    if name not in ATTENTION_BACKENDS:
        raise KvslimError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                          f"got {name!r}")


def resolve_attention_backend(name: str, device: torch.device, kv_quantized: bool,
                              block_size: int, kernel_usable: bool = False,
                              latent: bool = False, sinks: bool = False) -> str:
    """"gather", "flex" or "kernel" for a cache on `device`; `kernel_usable`: the decode
    kernel is built and takes this model's dtype and cache dtype (`decode_kernel_usable`);
    `latent`: the cache holds MLA's latent rows (latent_cache.py); "auto" gathers them on CUDA
    (flex reads them too, not measured there yet). `sinks`: a layer keeps attention sinks
    (kv_cache/window.py), which flex's mask does not build."""
    check_attention_backend(name)
    if sinks and name == "flex":
        raise KvslimError("kv_sink_tokens is not built for attention_backend=flex; use gather "
                          "or kernel")
    if sinks and name == "auto" and device.type == "cuda":
        name = "gather"
    on_cuda = device.type == "cuda"
    if latent and name == "auto":
        # the kernel where it runs (CPU_DEFAULT_LATENT, measured), else gather: flex's eager
        # calls cost milliseconds on the CPU, and on CUDA it is not measured yet
        usable = not on_cuda and kernel_usable
        return CPU_DEFAULT_LATENT if usable and CPU_DEFAULT_LATENT == "kernel" else "gather"
    if name == "kernel":
        if not kernel_usable:
            raise KvslimError("attention_backend=kernel needs the CPU, a float32 model, a "
                              "float32 or int8 KV cache and kvslim's C++ kernels (built on "
                              "first use; KVSLIM_NO_EXTENSION unset)")
        return name
    if name == "auto" and not on_cuda:
        return "kernel" if CPU_DEFAULT == "kernel" and kernel_usable else "gather"
    if kv_quantized:
        # FlexAttention reads the pool's elements as stored; an int8/fp8 cache needs each
        # token's scale on K before the scores and on V before the weighted sum. A score_mod
        # could rescale the scores, but nothing in the kernel rescales V: quantized caches
        # keep the gather path, which dequantizes what it gathers.
        return "gather"
    if name == "auto":
        return "flex" if CUDA_DEFAULT == "flex" and block_size % 16 == 0 else "gather"
    if name == "flex" and on_cuda and block_size % 16:
        raise KvslimError(f"attention_backend=flex on CUDA needs a block_size that is a "
                          f"multiple of 16 (the kernel's tile), got {block_size}")
    return name


def decode_kernel_usable(device: torch.device, dtype: torch.dtype,
                         kv_dtype: torch.dtype) -> bool:
    return paged_attention.supports(kv_dtype, dtype, device) and paged_attention.available()


def build_paged_attention(backend: str, kv_caches: list[KVCacheLayer],
                          layouts: PagedStepLayout | list[PagedStepLayout],
                          layer_windows: list[int | None], layer_group: list[int] | None = None,
                          layer_sinks: list[int] | None = None
                          ) -> PagedAttention | FlexPagedAttention:
    """The step's attention context (backend: a resolved name), its metadata built once here
    for every layer. layer_sinks: each layer's sink tokens (kv_cache/window.py; flex takes
    none, EngineConfig refuses them there)."""
    block_size = kv_caches[0].block_size
    if backend == "flex":
        from kvslim.attention.flex import FlexPagedAttention
        from kvslim.attention.flex_metadata import build_flex_layer_metadata
        metas = build_flex_layer_metadata(layouts, block_size, kv_caches[0].num_blocks,
                                          layer_windows, layer_group)
        return FlexPagedAttention(kv_caches, metas)
    # "kernel" comes resolved (resolve_attention_backend checked that the extension is built):
    # this runs inside the compiled decode step, which cannot trace that check.
    metas = build_layer_metadata(layouts, block_size, layer_windows, layer_group, layer_sinks)
    return PagedAttention(kv_caches, metas, kernel=backend == "kernel")
