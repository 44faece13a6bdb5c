"""`EngineConfig`: everything that shapes the engine, validated once.

Each engine option is declared once, as one field of `EngineConfig` carrying its type, default,
choices and help (`option`), as vLLM's `EngineArgs` does: the CLI's flags are generated from
the fields (`cli/engine_args.py`), `LLM(model, **options)` passes its keywords here
(`from_options`), and `__post_init__` is the one place they are checked."""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from kvslim.attention.backends import ATTENTION_BACKENDS
from kvslim.dtypes import KV_CACHE_DTYPES, PACKED_KV_BITS, QUANTIZED_KV_DTYPES
from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim.errors import KvslimError
from kvslim.kernels.activations import LINEAR_ACTIVATIONS
from kvslim.kv_cache.plan import DEFAULT_BLOCK_SIZE, PACKED_BLOCK_SIZE
from kvslim.kv_cache.window import KVWindow

KV_PRESSURES = ("preempt", "demote")       # kv_pressure's (engine/kv_demotion.py)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12,
          "tb": 10**12}


def parse_bytes(value: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5GB', 1048576 -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise KvslimError(f"cannot parse memory size {value!r}; use e.g. 512MiB, 2GiB or 1.5GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def speculative_from_json(text: str) -> dict:
    """--speculative-config's text: a JSON object of `SpeculativeConfig`'s options."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise KvslimError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise KvslimError("--speculative-config must be a JSON object, e.g. "
                          '\'{"method": "ngram", "num_speculative_tokens": 3}\'')
    return value


def option(default: Any, help: str, *, flag: str | None = "", choices: tuple | None = None,
           metavar: str | None = None, parse: Callable[[str], Any] | None = None) -> Any:
    """An engine option: a field of EngineConfig with what its CLI flag needs. `flag`: "" for
    --<name-with-dashes>, None for an option without a flag; a bool option that defaults to
    True is turned off by its flag, named --no-...; `parse`: the flag's text -> the value, for
    an option that is not a plain str, int or float (its type comes from the annotation).
    `help` may say %(default)s: a command that sets its own default shows that one."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices,
                                            "metavar": metavar, "parse": parse})


@dataclass
class EngineConfig:
    dtype: str = option("auto", "float32, bfloat16, float16 or auto (float32 on CPU; the default "
                                "model and .gguf files run their quantized import, any other "
                                "value their float one)")
    device: str = option("auto", "cpu, cuda or auto")
    kv_cache_dtype: str = option(
        "auto", "KV-cache storage: auto (the model's dtype), " + " or ".join(QUANTIZED_KV_DTYPES)
        + " (a float16 scale per token and KV head), " + " or ".join(PACKED_KV_BITS)
        + " (keys per channel over each block, values per token in groups, the block being "
          "filled kept in float16; kvslim's CPU kernel) (default auto)", choices=KV_CACHE_DTYPES)
    # Bytes for K and V of all layers (per tensor-parallel rank); a size text is parsed.
    kv_cache_memory: int | str = option(
        "1GiB", "KV-cache budget per tensor-parallel rank, e.g. 512MiB, 2GiB (default "
                "%(default)s)")
    # None: DEFAULT_BLOCK_SIZE, or PACKED_BLOCK_SIZE for a packed cache (kv_cache/plan.py).
    block_size: int | None = option(
        None, f"tokens per KV-cache block (default {DEFAULT_BLOCK_SIZE}; {PACKED_BLOCK_SIZE} for "
              f"the packed KV caches, whose keys share a scale per block and channel)")
    max_num_seqs: int = option(64, "most sequences running at once (default %(default)s)")
    max_num_batched_tokens: int = option(
        1024, "tokens computed per step, prefill chunks included (default %(default)s)")
    max_model_len: int | None = option(
        None, "longest prompt + output in tokens (default: the model's context, capped by what "
              "the KV cache holds for one sequence)")
    enable_prefix_caching: bool = option(
        True, "do not reuse the KV blocks of prompt prefixes computed before",
        flag="--no-prefix-caching")
    enable_chunked_prefill: bool = option(
        True, "prefill long prompts in chunks within max_num_batched_tokens", flag=None)
    seed: int = option(0, "for requests that sample without their own seed", flag=None)
    enforce_eager: bool = option(False, "run decode steps eagerly: without CUDA graphs on CUDA, "
                                        "never compiled on the CPU")
    # Off by default: the first start compiles for minutes on a small CPU, and the native
    # decoder layers run quantized models faster than the compiled step (engine/cpu_compile.py;
    # README, measured by benchmarks/compiled_decode.py).
    compile_decode: bool = option(
        False, "run decode steps as one compiled program (torch.compile: Inductor's C++ on "
               "the CPU; on CUDA its Triton kernels, recorded in the CUDA graphs): compiled at "
               "start-up (minutes the first time, cached on disk for the next start); on the "
               "CPU slower than the native layers that quantized models with int8 "
               "activations run eagerly (README)", flag="--compile")
    # "auto" picks per device in attention/backends.py; a quantized KV cache always gathers.
    attention_backend: str = option(
        "auto", "paged attention: gather (copies each context out, the reference), flex "
                "(FlexAttention reading the cache in place), kernel (the CPU: decodes through "
                "kvslim's C++ kernel, reading the cache in place; float32 models, float32 or "
                "int8 caches) or auto (what measured faster: gather on CUDA, the kernel on the "
                "CPU where it runs; flex never takes a quantized KV cache)",
        choices=ATTENTION_BACKENDS)
# kernels/activations.py: int8 is llama.cpp's arithmetic and the faster one at every M
    # (benchmarks/decode_gemm_stream.py); float32 is the exact reference of the dequantized weight.
    linear_activations: str = option(
        "int8", "what the CPU's group-quantized layers (GGUF blocks, GPTQ/AWQ 4-bit, int8 "
                "per channel) do with their inputs: int8 (default: quantized per block of 32 "
                "and multiplied in integers, as llama.cpp does) or float32 (the exact "
                "reference of the dequantized weight)",
        choices=LINEAR_ACTIVATIONS)
    # The mask-only path, for comparison: sliding-window layers release nothing.
    keep_out_of_window_blocks: bool = option(
        False, "sliding-window layers keep every KV block (their window only masks) instead of "
               "releasing the blocks that fell out of it")
    # kv_cache/window.py: any model's cache bounded at serve time (StreamingLLM's sinks).
    kv_window: int | None = option(
        None, "attend to the last W tokens only (plus the sink tokens) and free the KV blocks "
              "behind the window: a sequence of any length holds the blocks of sinks + W tokens "
              "(a layer's own narrower window is kept)", metavar="W")
    kv_sink_tokens: int = option(
        0, "with --kv-window, the first S tokens every query also attends to (attention sinks; "
           "default 0)", metavar="S")
    # kv_cache/layer_plan.py: `kvslim plan-kv`'s choice, one pool per precision.
    kv_plan: str | None = option(
        None, "a per-layer KV plan (plan.json from `kvslim plan-kv`): each layer's KV precision "
              "and window, the budget split between the precisions as the plan's sequences use "
              "them", metavar="PLAN_JSON")
    # engine/kv_demotion.py; preempt stays the default (batch invariance): `kvslim bench
    # kv-demotion` measures both (docs/kv-budget.md).
    kv_pressure: str = option(
        "preempt", "when the KV pool runs out: preempt (free the newest sequence and recompute "
                   "it later) or demote (first re-quantize the oldest blocks of the longest-"
                   "running sequences to int8 in place, four in the bytes of one float32 "
                   "block; a float32 cache on the CPU kernel)", choices=KV_PRESSURES)
    kv_hadamard: bool = option(
        False, "with a packed --kv-cache-dtype, rotate K and V by a Hadamard matrix before "
               "quantizing (QuaRot): outlier channels spread over all of them")
    # A SpeculativeConfig or a dict of its options; None: off.
    speculative: SpeculativeConfig | dict | None = option(
        None, 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
              'or \'{"method": "draft", "model": DIR, "num_speculative_tokens": 4}\' (options: '
              'docs/speculative.md)',
        flag="--speculative-config", metavar="JSON", parse=speculative_from_json)
    # layers/cuda_sparse24.py: opt-in until benchmarks/cuda_decode_check.py --sparse24 says
    # where the sparse kernels win.
    cuda_sparse_24: bool = option(
        False, "on CUDA, run the linears of a 2:4-pruned float16/bfloat16 model as PyTorch "
               "semi-structured sparse tensors (sparse tensor cores, compute capability 8.0+)",
        flag="--cuda-sparse-24")
    # A second tier for full prefix blocks (kv_cache/tier.py): host memory and/or disk.
    kv_offload_dir: str | None = option(
        None, "keep full prefix blocks on disk in DIR when the pool evicts them (and across "
              "restarts); a prompt's blocks that miss the pool are read back from there",
        metavar="DIR")
    kv_offload_memory: int | str | None = option(
        None, "the same tier in host memory (in front of --kv-offload-dir if given), e.g. 2GiB",
        metavar="SIZE")
    kv_offload_max_bytes: int | str | None = option(
        None, "bound the disk tier, least recently used blocks removed first (default: no "
              "bound)", metavar="SIZE")
    kv_offload_write_through: bool = option(
        False, "write each full prefix block to the tier as soon as it fills, not only when "
               "the pool evicts it (what a restart finds)")
    # LoRA adapters per request (lora/): slots beside every attention and MLP linear.
    enable_lora: bool = option(
        False, "serve peft LoRA adapters per request (LoRARequest; kvslim serve --lora-modules)")
    max_loras: int = option(1, "adapters in one batch: the slots beside each linear (default "
                               "%(default)s)")
    max_lora_rank: int = option(16, "the largest adapter rank accepted (default %(default)s)")
    max_cpu_loras: int | None = option(
        None, "adapters kept loaded on the host, least recently used dropped first (default: "
              "max_loras)")
    # Tensor parallelism (`engine/parallel_executor.py`): ranks that each hold a slice of the
    # model and its own share of the KV cache (kv_cache_memory is per rank).
    tensor_parallel_size: int = option(
        1, "split the model over N ranks, each with its own KV-cache share (--kv-cache-memory "
           "is per rank); ranks run as local processes, or one per torchrun process "
           "(RANK/WORLD_SIZE set) across machines", metavar="N")
    # More ranks than CPU cores make each compete for a core, which only tests and experiments
    # want (CUDA ranks always need a device each).
    tensor_parallel_oversubscribe: bool = option(
        False, "allow more tensor-parallel ranks on this machine than CPU cores")
    # A rank that hangs fails the engine instead of stalling it forever; also the rendezvous'
    # limit.
    distributed_timeout: float = option(
        60.0, "a rank that does not answer a collective within this fails the engine "
              "(default 60)", metavar="SECONDS")

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """The config of keyword options (`LLM(model, **options)`); an unknown name is a
        one-line error that names the options it is close to."""
        names = [f.name for f in fields(cls)]
        for name in options:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=3)
                hint = (f"; did you mean {' or '.join(close)}?" if close
                        else f" (options: {', '.join(names)})")
                raise KvslimError(f"unknown engine option {name!r}{hint}")
        return cls(**options)

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.layer_plan = self._layer_plan()
        if self.block_size is None and self.layer_plan is not None:
            self.block_size = self.layer_plan.block_size
        if self.block_size is None:
            self.block_size = (PACKED_BLOCK_SIZE if self.kv_cache_dtype in PACKED_KV_BITS
                               else DEFAULT_BLOCK_SIZE)
        self.speculative = SpeculativeConfig.from_value(self.speculative)
        for name in ("kv_cache_memory", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise KvslimError(f"{name} must be positive, got {getattr(self, name)}")
        for f in fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices is not None and value not in choices:
                raise KvslimError(f"{f.name} must be one of {', '.join(choices)}, "
                                  f"got {value!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise KvslimError(f"max_model_len must be positive, got {self.max_model_len}")
        self.window = KVWindow.of(self.kv_window, self.kv_sink_tokens)
        self._check_parallel()
        self._check_lora()
        self._check_offload()
        self._check_demotion()

    def _layer_plan(self):
        """The per-layer KV plan in kv_plan (None without one); what it cannot run with is
        refused in one line."""
        if self.kv_plan is None:
            return None
        from kvslim.kv_cache.layer_plan import KVLayerPlan
        clashes = {"kv_cache_dtype": self.kv_cache_dtype != "auto",
                   "kv_window": self.kv_window is not None, "speculative": bool(self.speculative),
                   "tensor_parallel_size > 1": self.tensor_parallel_size > 1,
                   "keep_out_of_window_blocks": self.keep_out_of_window_blocks,
                   "the KV offload tier": self.offloads}
        named = [name for name, clash in clashes.items() if clash]
        if named:
            raise KvslimError(f"kv_plan sets each layer's precision and window itself: it "
                              f"does not run with {', '.join(named)}")
        return KVLayerPlan.load(self.kv_plan)

    def _check_demotion(self) -> None:
        """What demotion runs with (one float32 pool, no other reader of its tables), or a
        one-line error; the runner checks the device and backend."""
        if self.kv_pressure != "demote":
            return
        clashes = {"kv_cache_dtype": self.kv_cache_dtype != "auto",
                   "kv_window": self.kv_window is not None, "kv_plan": self.kv_plan is not None,
                   "speculative": bool(self.speculative), "compile_decode": self.compile_decode,
                   "tensor_parallel_size > 1": self.tensor_parallel_size > 1,
                   "the KV offload tier": self.offloads}
        named = [name for name, clash in clashes.items() if clash]
        if named:
            raise KvslimError(f"kv_pressure=demote quantizes float32 blocks in place: it does "
                              f"not run with {', '.join(named)}")

    def _check_offload(self) -> None:
        for name in ("kv_offload_memory", "kv_offload_max_bytes"):
            if getattr(self, name) is not None:
                setattr(self, name, parse_bytes(getattr(self, name)))
        if self.offloads and not self.enable_prefix_caching:
            raise KvslimError("the KV offload tier keeps prefix-cache blocks: it needs prefix "
                              "caching on")
        if self.offloads and self.tensor_parallel_size > 1:
            raise KvslimError("the KV offload tier with tensor_parallel_size > 1 is not "
                              "supported")

    @property
    def offloads(self) -> bool:
        """Whether a KV offload tier is asked for (a directory or host memory)."""
        return self.kv_offload_dir is not None or bool(self.kv_offload_memory)

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) <= 0:
                raise KvslimError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise KvslimError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least "
                              f"max_loras ({self.max_loras})")
        if self.enable_lora and self.speculative is not None:
            raise KvslimError("LoRA adapters with speculative decoding are not supported")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise KvslimError("LoRA adapters with tensor_parallel_size > 1 are not supported")

    def _check_parallel(self) -> None:
        from kvslim.parallel.sharding import check_world_size
        check_world_size(self.tensor_parallel_size)
        if not self.distributed_timeout > 0:
            raise KvslimError(f"distributed_timeout must be positive seconds, got "
                              f"{self.distributed_timeout!r}")
        if self.tensor_parallel_size > 1 and self.speculative is not None:
            raise KvslimError("speculative decoding with tensor_parallel_size > 1 is not "
                              "supported yet")

