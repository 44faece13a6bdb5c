"""The engines that run in this process: kvslim's `LLM` on one of its model directories (the
shipped GGUF blocks, its W8A8 checkpoint, the float32 import) and HF transformers at its best
static batch."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from kvslim.engine.sampling_params import SamplingParams

HF_BATCH_SIZES = (8, 16, 32, 64)


class KvslimEngine:
    """`model_dir`: a callable that prepares the directory (an import, a quantization) when the
    engine starts, so that building it is part of starting, not of the catalog."""

    def __init__(self, name: str, label: str, model_dir: Callable[[], Path],
                 kv_cache_memory: str = "1GiB", max_num_seqs: int = 64,
                 compile_decode: bool = False, linear_activations: str | None = None):
        self.name, self.label = name, label
        self._model_dir, self._kv, self._seqs = model_dir, kv_cache_memory, max_num_seqs
        self._compile, self._activations = compile_decode, linear_activations
        self.llm, self._warm = None, set()

    def start(self) -> None:
        """Once: a caller that started the engine early (`kvslim bench report`, to measure more
        with the same engine) hands it to the rounds started."""
        if self.llm is not None:
            return
        from kvslim_lab.bench.runners import kvslim_llm
        self.llm = kvslim_llm(self._model_dir(), self._kv, max_num_seqs=self._seqs,
                              compile_decode=self._compile,
                              linear_activations=self._activations)
        self._generate([[1, 2, 3, 4]], 4)                                      # warm-up

    def _generate(self, prompts, output_len: int):
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
        return outs

    def _warm_up(self, part: str, prompts) -> None:
        """A short run of the first measurement's own shapes (prompt length, batch) first."""
        if part not in self._warm:
            self._warm.add(part)
            self._generate(prompts, 4)

    def decode(self, prompt: list[int], output_len: int) -> float:
        self._warm_up("decode", [prompt])
        return self._generate([prompt], output_len)[0].metrics.time_per_output_token

    def offline(self, prompts: list[list[int]], output_len: int) -> dict[str, float]:
        self._warm_up("offline", prompts[:2])
        t = time.perf_counter()
        self._generate(prompts, output_len)
        return {"continuous batching": len(prompts) * output_len / (time.perf_counter() - t)}

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


class HFEngine:
    """HF transformers' `generate` on left-padded static batches. The first offline run tries
    every batch size in `batch_sizes` (up to the number of prompts); later rounds run the best."""

    def __init__(self, label: str, model_dir: Callable[[], Path], batch_sizes=HF_BATCH_SIZES):
        self.name, self.label = "hf-f32", label
        self._model_dir, self.batch_sizes = model_dir, tuple(batch_sizes)
        self.peer, self._best = None, None

    def start(self) -> None:
        import torch

        from kvslim_lab.bench.peer_hf import HFPeer
        self.peer = HFPeer(self._model_dir(), torch.float32)
        self.label = f"{self.peer.label} float32"      # its version beside the name
        self.peer.generate([[1, 2, 3, 4]], 2, 1)                               # warm-up

    def decode(self, prompt: list[int], output_len: int) -> float:
        self.peer.generate([prompt], 2, 1)                                     # warm-up
        return self.peer.latency([prompt], output_len)[1]

    def offline(self, prompts: list[list[int]], output_len: int) -> dict[str, float]:
        sizes = [b for b in self.batch_sizes if b <= len(prompts)] or [len(prompts)]
        out = {}
        for b in ([self._best] if self._best else sizes):
            out[f"batch {b}"] = len(prompts) * output_len / self.peer.generate(
                prompts, output_len, b)
        if self._best is None:
            self._best = int(max(out, key=out.get).split()[1])
        return out

    def close(self) -> None:
        self.peer = None
