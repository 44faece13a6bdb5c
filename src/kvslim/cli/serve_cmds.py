"""`kvslim serve`: the OpenAI-compatible server (FastAPI + uvicorn) over one engine."""
from __future__ import annotations

import gc
import os
import signal
import sys

from kvslim.cli.engine_args import add_engine_args, llm_from_args


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    p.add_argument("model", metavar="MODEL", nargs="?", default=None,
                   help="model directory, .gguf file or 'default' (the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: MODEL as given)")
    p.add_argument("--api-key", default=os.environ.get("KVSLIM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /tokenize routes "
                        "(default: $KVSLIM_API_KEY; none = open)")
    p.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="seconds to let in-flight requests finish after SIGTERM")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_server_options(p)
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def add_server_options(p) -> None:
    """One flag per ServerOptions field (server/context.py), where each is declared."""
    import typing
    from dataclasses import fields

    from kvslim.server.context import ServerOptions
    hints = typing.get_type_hints(ServerOptions)
    for f in fields(ServerOptions):
        kind, flag = hints[f.name], "--" + f.name.replace("_", "-")
        if kind is bool:                          # a switch, off by default
            assert f.default is False, flag
            p.add_argument(flag, action="store_true", help=f.metadata["help"])
            continue
        kinds = [t for t in typing.get_args(kind) if t is not type(None)]
        listed = len(kinds) == 1 and typing.get_origin(kinds[0]) is list   # one or more values
        p.add_argument(flag, default=f.default, nargs="+" if listed else None,
                       type=kind if kind in (int, float) else None,
                       choices=f.metadata["choices"], metavar=f.metadata.get("metavar"),
                       help=f.metadata["help"])


def run_serve(args) -> int:
    import uvicorn

    from kvslim.formats.registry import DEFAULT_MODEL_NAME
    from dataclasses import fields

    from kvslim.server.app import build_app
    from kvslim.server.context import ServerOptions

    llm = llm_from_args(args)                    # bad model or flags: one-line error, exit 2
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    if name == "default":
        name = DEFAULT_MODEL_NAME
    server, crashed = None, []

    def engine_crashed() -> None:                # every open request has its error already
        crashed.append(True)
        server.should_exit = True

    options = ServerOptions(**{f.name: getattr(args, f.name) for f in fields(ServerOptions)})
    try:                                         # bad --lora-modules: one-line error
        app = build_app(llm.engine, name, args.api_key, on_engine_crash=engine_crashed,
                        options=options)
    except BaseException:
        llm.shutdown()
        raise
    stats = llm.engine.kv_cache_stats()
    print(f"kvslim serve: {name} on http://{args.host}:{args.port} "
          f"({stats.num_blocks} KV blocks of {stats.block_size} tokens, "
          f"max_model_len {llm.engine.max_model_len})", file=sys.stderr, flush=True)
    if stats.max_tokens < llm.engine.max_model_len:
        # The engine rejects a request whose prompt + max_tokens exceeds the whole cache, and a
        # chat request without max_tokens asks for up to max_model_len.
        print(f"kvslim serve: warning: the KV cache holds {stats.max_tokens} tokens, fewer than "
              f"max_model_len; requests without max_tokens will be refused. Raise "
              f"--kv-cache-memory or lower --max-model-len to {stats.max_tokens}.",
              file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on")
    server = uvicorn.Server(config)
    # uvicorn drains on SIGTERM, then re-raises the signal with the handler it found. This one
    # makes that re-raise harmless (exit 0 after the drain) and still stops a server that gets
    # SIGTERM before uvicorn has installed its own handler.
    signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, "should_exit", True))
    try:
        server.run()
    finally:
        llm.shutdown()                           # the tensor-parallel ranks, if any
    # Drained: a repeated SIGTERM while the interpreter shuts down (when Python has put the
    # default handler back) would turn this clean exit into a kill.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Exit promptly after the drain: the interpreter's last garbage collections would walk every
    # object torch, pydantic and FastAPI made (seconds); frozen objects are skipped.
    gc.freeze()
    # Non-zero when the engine died: a supervisor restarts the server instead of keeping a
    # process that answers 503 forever.
    return 0 if server.started and not crashed else 1
