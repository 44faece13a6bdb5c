"""The serving part of `kvslim bench peers`: a server started, waited for and loaded by the
streaming client (a stand-in OpenAI server, so that the test is fast: `kvslim bench serve`'s own
tests load a real `kvslim serve`), and servers that cannot start (no binary, or one that exits)
reported with their reason. No timing is asserted."""
import sys
import textwrap

from kvslim_lab.bench.peers.catalog import PeerOptions
from kvslim_lab.bench.peers.serving import (Server, ServingPlan, build_servers, run_serving,
                                        time_to_first_answer)
from kvslim_lab.bench.peers.suite import Unavailable


# /v1/models, and /v1/completions streaming max_tokens chunks, without usage (as llama-server).
FAKE_SERVER = textwrap.dedent("""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self._send(json.dumps({"data": [{"id": "fake"}]}).encode())

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                self.send_response(404); self.end_headers(); return
            chunks = [{"choices": [{"text": "x", "index": 0}]}] * body["max_tokens"]
            self._send(b"".join(b"data: " + json.dumps(c).encode() + b"\\n\\n"
                                for c in chunks) + b"data: [DONE]\\n\\n")

        def _send(self, data):
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_servers_run_in_turn_and_the_absent_ones_say_why(tmp_path):
    def kvslim(port):
        return [sys.executable, "-c", FAKE_SERVER, str(port)]

    def absent(port):
        raise Unavailable("llama-server not built")

    servers = [Server("kvslim-q4_1", "kvslim serve", kvslim, tmp_path),
               Server("llamacpp-q4_0", "llama-server", absent, tmp_path),
               Server("vllm-bf16", "vllm serve", lambda port: [sys.executable, "-c",
                                                               "print('no model'); exit(3)"],
                      tmp_path)]
    plan = ServingPlan(num_prompts=4, request_rate=100.0, input_len=8, output_len=4,
                       start_timeout=120)
    own, llama, vllm = run_serving(servers, plan, show_progress=False)
    assert own["status"] == "ran", own
    assert own["completed"] == 4 and own["failed"] == 0
    assert set(own["ttft_ms"]) == set(own["tpot_ms"]) == {"p50", "p99"}
    assert llama == {"engine": "llamacpp-q4_0", "label": "llama-server", "status": "skipped",
                     "reason": "llama-server not built"}
    assert vllm["status"] == "skipped" and "exited (3): no model" in vllm["reason"]
    assert all(s.proc is None for s in servers)


def test_the_servers_are_those_of_the_engines_chosen(tmp_path):
    opts = PeerOptions(1, tmp_path / "no-bin", None, work_dir=tmp_path)
    names = [s.name for s in build_servers(["kvslim-q4_1", "vllm-bf16", "hf-f32"], opts, 4, 64)]
    assert names == ["kvslim-q4_1", "vllm-bf16"]
    (vllm,) = build_servers(["vllm-bf16"], opts, 4, 64)
    (entry,) = run_serving([vllm], ServingPlan(), show_progress=False)
    assert entry["reason"] == "no vLLM venv given (--vllm-python PATH, its bin/python)"


def test_a_start_is_timed_to_the_first_answer_and_a_failed_one_says_why(tmp_path):
    server = Server("kvslim-q4_1", "kvslim serve",
                    lambda port: [sys.executable, "-c", FAKE_SERVER, str(port)], tmp_path)
    row = time_to_first_answer(server, timeout=120)
    assert row["status"] == "ran" and 0 < row["ready_s"] <= row["first_answer_s"]
    assert server.proc is None                       # stopped after its answer
    dead = Server("x", "x", lambda port: [sys.executable, "-c", "exit(4)"], tmp_path)
    row = time_to_first_answer(dead, timeout=120)
    assert row["status"] == "skipped" and "exited (4)" in row["reason"]
