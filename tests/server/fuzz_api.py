"""Fuzz the HTTP API from its own OpenAPI schema with schemathesis: every operation, valid and
invalid inputs. The server must never answer 5xx or hang, and afterwards the engine must still
be alive (/health 200) with every KV block free.

    python tests/server/fuzz_api.py [MODEL] [--max-examples N | --short] [--seed S] [--json]

The app runs in this process behind uvicorn on 127.0.0.1 (so the engine's block counts can be
read directly), with a small max_model_len so that the largest max_tokens the schema allows is
cheap to generate. Exit 1 if anything failed; each failure is printed with a curl command."""
from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

CALL_TIMEOUT = 30.0            # seconds for one request: longer is a hang
SHORT_EXAMPLES = 20            # per operation and generation mode


@dataclass
class Failure:
    operation: str
    mode: str
    problem: str               # "5xx", "hang", "error"
    detail: str
    curl: str = ""


@dataclass
class FuzzReport:
    num_cases: int = 0
    num_operations: int = 0
    failures: list[Failure] = field(default_factory=list)
    status_counts: dict[str, int] = field(default_factory=dict)    # "POST /path 400": count
    health_after: int | None = None
    used_blocks_after: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures and self.health_after == 200 and self.used_blocks_after == 0


def build_engine(model: str, max_model_len: int):
    from kvslim.engine.llm import LLM
    llm = LLM(model, dtype="float32", device="cpu", kv_cache_memory="4MiB",
              max_model_len=max_model_len, max_num_seqs=16)
    return llm.engine


def serve_in_thread(app) -> tuple[object, threading.Thread, str]:
    import uvicorn
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="critical", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def fuzz_operation(op, mode, url: str, max_examples: int, seed: int, report: FuzzReport) -> None:
    """Up to `max_examples` cases of one operation. Every distinct fault is recorded once, with
    the curl command of its first case (not shrunk: the cases are small)."""
    import requests
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from hypothesis import seed as hypothesis_seed

    @hypothesis_seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(op.as_strategy(generation_mode=mode))
    def run(case) -> None:
        report.num_cases += 1
        curl = case.as_curl_command(base_url=url)
        try:
            response = case.call(base_url=url, timeout=CALL_TIMEOUT)
        except requests.Timeout:
            return fault("hang", f"no answer within {CALL_TIMEOUT} s", curl)
        key = f"{op.label} {response.status_code}"
        report.status_counts[key] = report.status_counts.get(key, 0) + 1
        if response.status_code >= 500:
            fault("5xx", f"{response.status_code}: {response.text[:300]}", curl)

    seen: set[tuple[str, str]] = set()

    def fault(problem: str, detail: str, curl: str) -> None:
        if (problem, detail) not in seen:
            seen.add((problem, detail))
            report.failures.append(Failure(op.label, mode.value, problem, detail, curl))

    try:
        run()
    except Unsatisfiable:              # no invalid input exists (an operation without inputs)
        pass
    except Exception as e:                                   # noqa: BLE001 - reported
        fault("error", f"{type(e).__name__}: {e}", "")


def wait_idle(engine, timeout: float = 60.0) -> int:
    """Used KV blocks once the engine has no request left (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.kv_cache_stats().num_used_blocks


def run_fuzz(model: str, max_examples: int, seed: int = 0, max_model_len: int = 32) -> FuzzReport:
    import httpx
    import schemathesis
    from schemathesis import GenerationMode

    from kvslim.server.app import build_app

    engine = build_engine(model, max_model_len)
    server, thread, url = serve_in_thread(build_app(engine, "tiny"))
    report, start = FuzzReport(), time.monotonic()
    try:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        for result in schema.get_all_operations():
            op = result.ok()
            report.num_operations += 1
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                fuzz_operation(op, mode, url, max_examples, seed, report)
        report.used_blocks_after = wait_idle(engine)
        report.health_after = httpx.get(f"{url}/health", timeout=10).status_code
    finally:
        server.should_exit = True
        thread.join(30)
    report.seconds = round(time.monotonic() - start, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="default",
                    help="model directory or 'default' (the embedded model)")
    ap.add_argument("--max-examples", type=int, default=200,
                    help="cases per operation and generation mode (default 200)")
    ap.add_argument("--short", action="store_true",
                    help=f"{SHORT_EXAMPLES} cases per operation and mode (a test's budget)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    examples = SHORT_EXAMPLES if args.short else args.max_examples
    report = run_fuzz(args.model, examples, args.seed, args.max_model_len)
    if args.json:
        print(json.dumps(asdict(report) | {"ok": report.ok}))
    else:
        print(f"{report.num_cases} cases on {report.num_operations} operations in "
              f"{report.seconds} s; /health after: {report.health_after}; KV blocks used "
              f"after: {report.used_blocks_after}")
        for key, count in sorted(report.status_counts.items()):
            print(f"  {key}: {count}")
        for f in report.failures:
            print(f"FAIL {f.operation} ({f.mode}) {f.problem}: {f.detail}\n  {f.curl}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
