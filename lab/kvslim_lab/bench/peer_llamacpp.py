"""llama.cpp (through llama-cpp-python) as a peer, on the same weights exported to GGUF by
`kvslim export-gguf`. Its Python API serves one sequence at a time, so requests run one by one."""
from __future__ import annotations

import time
from pathlib import Path


def available() -> bool:
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppPeer:
    name = "llamacpp"

    def __init__(self, gguf_path: str | Path, threads: int, n_ctx: int = 2048):
        import llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=512,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        self.label = f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"

    def run(self, prompt: list[int], output_len: int) -> tuple[float, float]:
        """(time to first token, total seconds) for one greedy request of `output_len` tokens."""
        llm = self.llm
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = llm.sample(temp=0.0, top_k=1)
        ttft = time.perf_counter() - start
        for _ in range(output_len - 1):
            llm.eval([token])
            token = llm.sample(temp=0.0, top_k=1)
        return ttft, time.perf_counter() - start

    def generate(self, prompts: list[list[int]], output_len: int) -> float:
        start = time.perf_counter()
        for p in prompts:
            self.run(p, output_len)
        return time.perf_counter() - start

    def latency(self, prompt: list[int], output_len: int) -> tuple[float, float]:
        ttft, total = self.run(prompt, output_len)
        return ttft, (total - ttft) / max(1, output_len - 1)
