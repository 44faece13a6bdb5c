"""llama.cpp at its best, through its own tools (bench/llamacpp_tools.py): batch-1 decode with
`llama-bench` (the prompt already in the cache, then the new tokens), offline throughput with
`llama-batched-bench` at each number of parallel sequences, on one GGUF file per type made by
`llama-quantize` from the model's float32 export. Both tools draw their own token ids; for a
dense model the ids do not change the time, only the counts do."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvslim_lab.bench.llamacpp_tools import LlamaCppTools
from kvslim_lab.bench.peers.suite import Unavailable

KINDS = ("q4_0", "q4_1", "q8_0", "f32")
PARALLEL = (4, 16, 64)


def gguf_file(tools: LlamaCppTools, kind: str, f32: Path, work_dir: Path) -> Path:
    """llama.cpp's file of `kind`: the float32 export itself, or llama-quantize's of it."""
    if kind == "f32":
        return f32
    work_dir.mkdir(parents=True, exist_ok=True)
    return tools.quantize(f32, work_dir / f"{f32.stem}-{kind}.gguf", kind)


class LlamaCppEngine:
    def __init__(self, kind: str, label: str, tools: LlamaCppTools,
                 f32_gguf: Callable[[], Path], work_dir: Path, parallel=PARALLEL):
        self.name, self.label = f"llamacpp-{kind}", label
        self.kind, self.tools, self.parallel = kind, tools, tuple(parallel)
        self._f32, self._work, self.gguf = f32_gguf, Path(work_dir), None

    def start(self) -> None:
        missing = self.tools.missing()
        if missing:
            raise Unavailable(missing)
        self.gguf = gguf_file(self.tools, self.kind, self._f32(), self._work)

    def decode(self, prompt: list[int], output_len: int) -> float:
        return 1 / self.tools.decode_tokens_per_s(self.gguf, len(prompt), output_len, repeats=1)

    def offline(self, prompts: list[list[int]], output_len: int) -> dict[str, float]:
        npl = [n for n in self.parallel if n <= len(prompts)] or [len(prompts)]
        speeds = self.tools.parallel_decode(self.gguf, len(prompts[0]), output_len, npl)
        return {f"-npl {n}": v for n, v in speeds.items()}

    def close(self) -> None:
        pass
