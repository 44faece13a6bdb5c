"""Does a served greedy answer depend on what else the server is doing? N chat requests are
streamed to one `kvslim serve` at once, every `--disconnect-every`-th client hanging up after a
few chunks; then each request that completed is sent again alone. An answer counts as
invariant when its text and its tokens' logprobs are the same both times.

    python benchmarks/stream_invariance.py [--streams 64] [--tokens 48] [--disconnect-every 3] \
        [--threads 2] [--json] [-- SERVE_ARGS...]

SERVE_ARGS go to `kvslim serve` (default model: the shipped Q4_1 blocks), e.g.
`-- --linear-activations int8` or `-- --model DIR`. With `-- --attention-backend gather` (torch's
SDPA) answers differ; with the CPU's default (kvslim's kernel, prefill chunks too) none should. After the run the server's metrics must show
no running request and the aborted count equal to the disconnects."""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
from pathlib import Path

import httpx

from batch_invariance import prompts
from kvslim_lab.bench.peers.serving import Server


def serve_argv(threads: int, streams: int, extra: list[str]):
    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "kvslim.cli.main", "serve", "--port", str(port),
                "--threads", str(threads), "--max-num-seqs", str(streams),
                "--log-level", "warning", *extra]
    return argv


async def stream_one(client: httpx.AsyncClient, body: dict, hang_up_after: int | None):
    """(text, logprobs) of a streamed answer, or None when this client hung up."""
    text, logprobs, chunks = [], [], 0
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["delta"].get("content") or "")
            logprobs += [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []]
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return None                     # leaving the block closes the connection
    return "".join(text), logprobs


async def together_then_alone(url: str, bodies: list[dict], disconnect_every: int):
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        together = await asyncio.gather(*[
            stream_one(client, b, 4 if disconnect_every and i % disconnect_every == 0 else None)
            for i, b in enumerate(bodies)])
        alone = [await stream_one(client, b, None) if t is not None else None
                 for b, t in zip(bodies, together)]
        metrics = (await client.get("/metrics")).text
    return together, alone, metrics


def metric(text: str, name: str) -> float:
    values = re.findall(rf"^kvslim_{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--disconnect-every", type=int, default=3, help="0: nobody hangs up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("serve_args", nargs="*", help="after --: kvslim serve's own options")
    args = ap.parse_args()
    server = Server("kvslim", "kvslim serve", serve_argv(args.threads, args.streams,
                                                          args.serve_args),
                    tempfile.mkdtemp(prefix="stream-invariance-"))
    server.start(timeout=900)
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        bodies = [{"model": model, "messages": chat, "max_tokens": args.tokens,
                   "temperature": 0, "logprobs": True, "ignore_eos": True}
                  for chat in prompts(args.streams)]
        together, alone, metrics = asyncio.run(
            together_then_alone(server.url, bodies, args.disconnect_every))
    finally:
        server.stop()
    completed = [i for i, t in enumerate(together) if t is not None]
    differ = [i for i in completed if together[i] != alone[i]]
    row = dict(command="python benchmarks/stream_invariance.py " + " ".join(sys.argv[1:]),
               streams=args.streams, tokens=args.tokens, serve_args=args.serve_args,
               disconnected=args.streams - len(completed), completed=len(completed),
               same_as_alone=len(completed) - len(differ), differing=differ,
               running_after=metric(metrics, "num_requests_running"),
               aborted=metric(metrics, "requests_aborted"))
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=2) + "\n")
    if args.json:
        print(json.dumps(row, indent=2))
    else:
        print(f"{row['completed']} of {args.streams} streams completed ({row['disconnected']} hung "
              f"up, {row['aborted']:.0f} aborted by the server, {row['running_after']:.0f} still "
              f"running after); {row['same_as_alone']} of {row['completed']} answers equal the "
              f"same request served alone" + (f"; differing: {differ}" if differ else ""))
    return 0 if not differ and row["running_after"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
