"""llama.cpp's own command-line tools as a peer (built by `benchmarks/build_llamacpp.sh`): its
quantizations (`llama-quantize`), batch-1 decode (`llama-bench`), its parallel decoding
(`llama-batched-bench`) and perplexity (`llama-perplexity`) — llama.cpp at its best, not one
request at a time through the Python bindings (`peer_llamacpp.py`)."""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvslim.errors import KvslimError

TOOLS = ("llama-quantize", "llama-bench", "llama-batched-bench", "llama-perplexity")
DEFAULT_BIN = ".cache/llamacpp/build/bin"


@dataclass
class LlamaCppTools:
    bin_dir: Path
    threads: int

    def missing(self) -> str | None:
        """Why the tools cannot run here, or None."""
        absent = [t for t in TOOLS if not (Path(self.bin_dir) / t).is_file()]
        if absent:
            return (f"llama.cpp tools not found in {self.bin_dir} ({', '.join(absent)}); "
                    "build them with `bash benchmarks/build_llamacpp.sh`")
        return None

    def _run(self, tool: str, *args) -> str:
        argv = [str(Path(self.bin_dir) / tool), *map(str, args)]
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise KvslimError(f"{tool} failed (exit {r.returncode}): {tail[0]}")
        return r.stdout + r.stderr

    def quantize(self, src: Path, dst: Path, kind: str) -> Path:
        """`kind` as llama-quantize names it: q8_0, q4_0, q4_1, ..."""
        if not dst.is_file():
            tmp = dst.with_name(dst.name + ".tmp")
            self._run("llama-quantize", src, tmp, kind, self.threads)
            tmp.replace(dst)
        return dst

    def decode_tokens_per_s(self, gguf: Path, input_len: int, output_len: int,
                            repeats: int = 3) -> float:
        """Batch-1 decode of `output_len` tokens after `input_len` tokens already in the cache
        (-d), mean over `repeats` (llama-bench's own warm-up run first)."""
        out = self._run("llama-bench", "-m", gguf, "-p", 0, "-n", output_len, "-d", input_len,
                        "-t", self.threads, "-r", repeats, "-o", "json")
        rows = json.loads(out[out.index("["):out.rindex("]") + 1])
        return float(next(r["avg_ts"] for r in rows if r["n_gen"] == output_len))

    def parallel_decode(self, gguf: Path, input_len: int, output_len: int,
                        parallel: list[int]) -> dict[int, float]:
        """Output tokens/s (prefill time included, as kvslim's offline throughput counts it) of
        N sequences decoded together, for each N in `parallel`."""
        ctx = max(parallel) * (input_len + output_len) + 16
        out = self._run("llama-batched-bench", "-m", gguf, "-c", ctx, "-b", 2048, "-ub", 512,
                        "-npp", input_len, "-ntg", output_len,
                        "-npl", ",".join(map(str, parallel)), "-t", self.threads,
                        "--output-format", "jsonl")
        rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"n_kv_max"')]
        return {int(r["pl"]): round(r["pl"] * r["tg"] / r["t"], 1) for r in rows}

    def perplexity(self, gguf: Path, text: Path, context: int, stride: int,
                   windows: int) -> tuple[float, int]:
        """(perplexity, tokens in the file) over `windows` windows of `context` tokens starting
        every `stride` tokens, each scoring its last `stride` tokens: kvslim's sliding windows
        when stride = context - 1. llama-perplexity's strided mode widens the context it is given
        by stride / 2 and needs a batch no larger than it, hence -c and -b below."""
        if not 0 < stride < context:
            raise KvslimError(f"llama-perplexity needs 0 < stride < context, got {stride}, "
                              f"{context}")
        c = context - stride // 2
        for _ in range(3):
            # One window more than needed: its log is written by a thread that may drop the
            # last values at exit (seen under load), and the running value after `windows`
            # windows is what is wanted.
            out = self._run("llama-perplexity", "-m", gguf, "-f", text, "-c", c, "-b", c,
                            "--ppl-stride", stride, "--chunks", windows + 1, "-t", self.threads)
            have = re.search(r"have (\d+) tokens\. Calculation chunk = (\d+)", out)
            if have is None or int(have.group(2)) != context:
                ran = have.group(2) if have else "no"
                raise KvslimError(f"llama-perplexity ran {ran}-token windows, not {context} "
                                  "(it rounds its context up to a multiple of 256)")
            values = dict(re.findall(r"\[(\d+)\]([0-9.]+),", out))
            if str(windows) in values:
                return float(values[str(windows)]), int(have.group(1))
        raise KvslimError(f"llama-perplexity printed fewer than {windows} windows")
