"""Load generator for an OpenAI-compatible server, in the shape of vLLM's serving benchmark:
requests arrive as a Poisson process (or all at once), optionally capped in concurrency, each
streams its completion; the report gives request and token throughput and TTFT / TPOT / ITL /
end-to-end latency (mean, median, p99), plus failures.

Prompts are synthetic: random words, cut to exactly `input_len` tokens when the server has
`/tokenize` (kvslim and vLLM do), else sent as text of about that length. With `num_prefixes`,
each prompt starts with one of that many shared prefixes of `prefix_len` tokens (chosen at
random per prompt, as vLLM's prefix_repetition dataset does), so that the servers' prefix
caches matter; the report's prefix-cache hit rate is the usage's cached tokens over the prompt
tokens. `ignore_eos` is sent so that every request generates `output_len` tokens; token counts
come from the server's usage."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field, replace

import httpx
import numpy as np
from tqdm import tqdm

from kvslim.errors import KvslimError

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact memory kernel page "
         "cache token model layer block engine").split()


@dataclass
class ServeBenchConfig:
    url: str                                 # http://host:port (a trailing /v1 is accepted)
    num_prompts: int = 100
    request_rate: float = float("inf")       # requests per second; inf = all at once
    max_concurrency: int | None = None
    input_len: int = 128
    output_len: int = 64
    model: str | None = None                 # default: the first model /v1/models lists
    api_key: str | None = None
    seed: int = 0
    timeout: float = 600.0
    num_prefixes: int = 0                    # shared prompt prefixes; 0: every prompt random
    prefix_len: int = 0                      # tokens of each shared prefix

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/").removesuffix("/v1")
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise KvslimError(f"--{name.replace('_', '-')} must be at least 1")
        if self.request_rate <= 0:
            raise KvslimError("--request-rate must be positive (inf = all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise KvslimError("--max-concurrency must be at least 1")
        if self.num_prefixes < 0 or (self.num_prefixes and
                                     not 0 < self.prefix_len < self.input_len):
            raise KvslimError("--num-prefixes needs 0 < --prefix-len < --input-len")


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                        # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    cached_tokens: int = 0                   # prompt tokens the server's prefix cache served


@dataclass
class ServeBenchResult:
    config: dict
    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    latency_ms: dict[str, float]             # {mean,median,p99}_{ttft,tpot,itl,e2el}_ms
    errors: list[str]
    total_cached_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0       # cached / input tokens

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("latency_ms"))
        return d


def run_serve_bench(config: ServeBenchConfig, show_progress: bool = True) -> ServeBenchResult:
    return asyncio.run(_bench(config, show_progress))


async def _bench(config: ServeBenchConfig, show_progress: bool) -> ServeBenchResult:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.max_concurrency or config.num_prompts)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(config.timeout)) as client:
        config = replace(config, model=config.model or await _first_model(client))
        model = config.model
        prompts = await _prompts(client, model, config)
        bar = tqdm(total=config.num_prompts, desc="bench serve", unit="req",
                   disable=not show_progress)
        gate = asyncio.Semaphore(config.max_concurrency or config.num_prompts)

        async def one(prompt) -> RequestResult:
            async with gate:
                result = await _request(client, model, prompt, config)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        rng = np.random.default_rng(config.seed)
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if config.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / config.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(config, results, duration)


async def _first_model(client: httpx.AsyncClient) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise KvslimError(f"cannot list models at {client.base_url}/v1/models ({e}); "
                          f"is the server up? pass --model to skip this") from None


async def _prompts(client: httpx.AsyncClient, model: str, config: ServeBenchConfig) -> list:
    rng = random.Random(config.seed)
    shared, own = config.prefix_len if config.num_prefixes else 0, config.input_len
    own -= shared

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n + 8))

    prefixes = [words(shared) for _ in range(config.num_prefixes)]
    which = [i % max(1, config.num_prefixes) for i in range(config.num_prompts)]
    rng.shuffle(which)
    texts = [words(own) for _ in range(config.num_prompts)]
    try:                                     # exact lengths where the server can tokenize
        prefix_ids = [await _tokens(client, model, text, shared) for text in prefixes]
        # after a prefix, a prompt's own tokens start no text: no BOS of their own
        return [(prefix_ids[w] if prefix_ids else [])
                + await _tokens(client, model, t, own, special=not prefix_ids)
                for w, t in zip(which, texts)]
    except (httpx.HTTPError, KeyError, ValueError):
        cut = [" ".join(t.split()[:own]) for t in texts]
        if not prefixes:
            return cut
        return [" ".join(prefixes[w].split()[:shared]) + " " + t for w, t in zip(which, cut)]


async def _tokens(client: httpx.AsyncClient, model: str, text: str, length: int,
                  special: bool = True) -> list[int]:
    """`text`'s first `length` tokens, by the server's /tokenize."""
    response = await client.post("/tokenize", json={"model": model, "prompt": text,
                                                    "add_special_tokens": special})
    response.raise_for_status()
    tokens = response.json()["tokens"][:length]
    if len(tokens) < length:                 # another /tokenize (llama-server's)
        raise ValueError("short tokenization")
    return tokens


async def _request(client: httpx.AsyncClient, model: str, prompt, config: ServeBenchConfig
                   ) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": config.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    result.success = result.ttft > 0
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error in stream")
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                if chunk.get("choices"):            # a token arrived (its text may be held back)
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        if result.ttft and not result.output_tokens:     # a server that sends no usage
            result.output_tokens = len(result.itl) + 1   # (llama-server): a token a chunk
        if not result.success:
            result.error = "the stream ended without output or [DONE]"
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def summarize(config: ServeBenchConfig, results: list[RequestResult], duration: float
              ) -> ServeBenchResult:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    latency = {}
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot),
                         ("itl", [x for r in ok for x in r.itl]),
                         ("e2el", [r.latency for r in ok])):
        ms = np.asarray(values, dtype=float) * 1000
        latency[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        latency[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        latency[f"p99_{name}_ms"] = float(np.percentile(ms, 99)) if ms.size else 0.0
    settings = asdict(config)
    settings.pop("api_key")
    if settings["request_rate"] == float("inf"):         # JSON has no infinity
        settings["request_rate"] = "inf"
    return ServeBenchResult(
        config=settings, duration=duration, completed=len(ok), failed=len(results) - len(ok),
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration, output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration, latency_ms=latency,
        errors=[r.error for r in results if not r.success][:10],
        total_cached_tokens=cached, prefix_cache_hit_rate=cached / total_in if total_in else 0.0)


def format_result(result: ServeBenchResult) -> str:
    c = result.config
    rows = [("Model", c["model"]), ("Request rate (req/s)", c["request_rate"]),
            ("Max concurrency", c["max_concurrency"] or "none"),
            ("Successful requests", result.completed), ("Failed requests", result.failed),
            ("Benchmark duration (s)", f"{result.duration:.2f}"),
            ("Total input tokens", result.total_input_tokens),
            ("Total generated tokens", result.total_output_tokens),
            ("Request throughput (req/s)", f"{result.request_throughput:.2f}"),
            ("Output token throughput (tok/s)", f"{result.output_throughput:.2f}"),
            ("Total token throughput (tok/s)", f"{result.total_token_throughput:.2f}"),
            ("Prefix-cache hit rate (tokens)", f"{result.prefix_cache_hit_rate:.3f}")]
    lines = [" Serving Benchmark Result ".center(50, "=")]
    lines += [f"{name + ':':<40}{value}" for name, value in rows]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f" {title} ".center(50, "-"))
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):"
            lines.append(f"{label:<40}{result.latency_ms[f'{stat}_{key}_ms']:.2f}")
    lines.append("=" * 50)
    lines += [f"error: {e}" for e in result.errors]
    return "\n".join(lines)
