"""Chaos: 64 concurrent streaming requests, some with n > 1, a third of them cut off by their
client at a random (seeded) point, some cancelled before the first event. Afterwards every KV
block is free, and every answer that completed is the one the same request gets served alone
(greedy, ignore_eos: the batch it shared must not change it)."""
from __future__ import annotations

import asyncio
import json
import random

import httpx

from inproc_server import serve_in_thread, wait_until
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.server.app import build_app

NUM_REQUESTS = 64
PROMPTS = ["It is a truth", "In the beginning", "The kernel schedules", "memory is managed",
           "a single man in possession", "God created the heaven", "pages of 4096 bytes",
           "must be in want of"]


def plan(seed: int = 0) -> list[dict]:
    """Each request: its route and body, and what its client does ("read" to the end, "cut"
    after some events, "cancel" after a short delay, maybe before anything arrived)."""
    rng = random.Random(seed)
    requests = []
    for i in range(NUM_REQUESTS):
        body = {"max_tokens": rng.randint(4, 12), "temperature": 0, "ignore_eos": True,
                "stream": True, "n": rng.choice([1, 1, 2, 3])}
        if i % 4 == 3:
            route = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        else:
            route = "/v1/completions"
            body["prompt"] = rng.choice(PROMPTS)
        action = "read" if i % 3 else rng.choice(["cut", "cut", "cancel"])
        requests.append({"route": route, "body": body, "action": action,
                         "cut_after": rng.randint(1, 4), "cancel_after": rng.uniform(0, 0.3)})
    return requests


async def stream(http: httpx.AsyncClient, route: str, body: dict, cut_after: int | None = None):
    """{choice index: (text, finish_reason)}, or None if cut off after `cut_after` events."""
    texts, reasons, events = {}, {}, 0
    async with http.stream("POST", route, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            events += 1
            if cut_after is not None and events >= cut_after:
                return None                              # leaving the block closes the stream
            for choice in event["choices"]:
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + text
                if choice.get("finish_reason"):
                    reasons[choice["index"]] = choice["finish_reason"]
    return {i: (texts.get(i, ""), reasons.get(i)) for i in range(body["n"])}


async def client(http: httpx.AsyncClient, request: dict):
    if request["action"] == "cut":
        return await stream(http, request["route"], request["body"], request["cut_after"])
    task = asyncio.ensure_future(stream(http, request["route"], request["body"]))
    if request["action"] == "read":
        return await task
    await asyncio.sleep(request["cancel_after"])
    task.cancel()                                        # the connection closes with it
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def run_all(url: str, requests: list[dict], concurrently: bool) -> list:
    limits = httpx.Limits(max_connections=NUM_REQUESTS)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        if concurrently:
            return await asyncio.wait_for(
                asyncio.gather(*(client(http, r) for r in requests)), timeout=120)
        return [await asyncio.wait_for(stream(http, r["route"], r["body"]), timeout=60)
                for r in requests]


def test_chaos_of_disconnects_leaves_no_blocks_and_changes_no_answer(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(kv_cache_memory="4MiB", dtype="float32",
                                                device="cpu", max_num_seqs=64))
    requests = plan(seed=0)
    with serve_in_thread(build_app(engine, "tiny")) as url:
        answers = asyncio.run(run_all(url, requests, concurrently=True))
        wait_until(lambda: not engine.has_unfinished_requests()
                   and engine.kv_cache_stats().num_used_blocks == 0, what="every block free")
        completed = [(r, a) for r, a in zip(requests, answers) if a is not None]
        assert len(completed) >= NUM_REQUESTS // 2
        assert sum(r["action"] != "read" for r in requests) >= NUM_REQUESTS // 4
        assert any(r["body"]["n"] > 1 for r, _ in completed)
        alone = asyncio.run(run_all(url, [r for r, _ in completed], concurrently=False))
    for (request, answer), reference in zip(completed, alone):
        assert answer == reference, request["body"]
        assert all(reason == "length" for _, reason in answer.values())
