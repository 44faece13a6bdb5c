"""A client that goes away mid-request gets its engine request aborted and its KV blocks freed,
streaming or not (asserted through /metrics), and the server keeps serving."""
from __future__ import annotations

import json
import socket

import httpx

LONG = {"model": "tiny", "prompt": "It is a truth universally acknowledged", "max_tokens": 480,
        "temperature": 0, "ignore_eos": True}


def aborted(server) -> float:
    return server.metrics().get("kvslim_requests_aborted_total", 0.0)


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = aborted(server)
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    chunks += 1
                    if chunks == 2:                # generating: it holds blocks now
                        assert server.metrics()["kvslim_kv_cache_blocks_used"] > 0
                    if chunks == 3:
                        break                      # closing the stream drops the connection
    server.wait_metric("kvslim_requests_aborted_total", lambda v: v == before + 1)
    server.wait_metric("kvslim_kv_cache_blocks_used", lambda v: v == 0)
    assert server.metrics()["kvslim_num_requests_running"] == 0


def test_non_stream_disconnect_aborts_and_frees_blocks(server):
    """The client hangs up once the server reports the request running (16 completions of 480
    tokens each: far from done), whatever the machine's speed."""
    before = aborted(server)
    body = json.dumps({**LONG, "n": 16}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        headers = "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
        conn.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{headers}"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        server.wait_metric("kvslim_kv_cache_blocks_used", lambda v: v > 0)
    server.wait_metric("kvslim_requests_aborted_total", lambda v: v == before + 1)
    server.wait_metric("kvslim_kv_cache_blocks_used", lambda v: v == 0)


def test_serves_normally_after_disconnects(client):
    response = client.completions.create(model="tiny", prompt="In the beginning", max_tokens=5,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5
