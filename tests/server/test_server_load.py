"""Continuous batching through the server: 32 concurrent streams give the same greedy outputs
as one at a time, the engine ran them together, and every KV block comes back."""
from __future__ import annotations

import asyncio

NUM_REQUESTS = 32
MAX_TOKENS = 16
WORDS = "truth universally acknowledged single man possession good fortune want wife".split()


def prompt(i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 5)) + f" {i}"


def multi_sequence_steps(server) -> float:
    """Engine steps that ran more than one sequence, from the batch-size histogram."""
    m = server.metrics()
    return (m["kvslim_running_sequences_per_step_count"]
            - m['kvslim_running_sequences_per_step_bucket{le="1.0"}'])


def test_concurrent_streams_match_one_by_one_and_free_blocks(server, async_client):
    kw = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0,
              extra_body={"ignore_eos": True})

    async def one(c, i: int) -> tuple[str, str | None]:
        stream = await c.completions.create(prompt=prompt(i), stream=True, **kw)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def concurrently():
        async with async_client() as c:
            return await asyncio.gather(*(one(c, i) for i in range(NUM_REQUESTS)))

    async def one_by_one():
        async with async_client() as c:
            return [await one(c, i) for i in range(NUM_REQUESTS)]

    batched_before = multi_sequence_steps(server)
    together = asyncio.run(concurrently())
    batched_after = multi_sequence_steps(server)
    alone = asyncio.run(one_by_one())

    assert all(finish == "length" for _, finish in together)
    assert together == alone
    assert batched_after > batched_before, "no engine step ran more than one sequence"
    assert server.metrics()["kvslim_num_running_peak"] > 1
    server.wait_metric("kvslim_kv_cache_blocks_used", lambda v: v == 0)
    metrics = server.metrics()
    assert metrics["kvslim_num_requests_running"] == 0
    assert metrics["kvslim_num_requests_waiting"] == 0
    assert metrics["kvslim_kv_cache_blocks_total"] > 0
    assert metrics["kvslim_num_demoted_blocks"] == 0          # preempt, the default, demotes none
