"""`kvslim serve`: the OpenAI-compatible server (FastAPI + uvicorn) over one engine, or over
engine replicas on Ray (--data-parallel-size, kvslim.scaleout)."""
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
    """One flag per ServerOptions field (server/context.py) and per ScaleOutOptions field
    (scaleout/options.py), where each is declared."""
    from kvslim.scaleout.options import ScaleOutOptions
    from kvslim.server.context import ServerOptions
    add_dataclass_flags(p, ServerOptions)
    add_dataclass_flags(p.add_argument_group("scale-out (Ray replicas, docs/scale-out.md)"),
                        ScaleOutOptions)


def add_dataclass_flags(p, options_class) -> None:
    import types
    import typing
    from dataclasses import fields

    hints = typing.get_type_hints(options_class)
    for f in fields(options_class):
        kind, flag = hints[f.name], "--" + f.name.replace("_", "-")
        if kind is bool:                          # a switch, off by default
            assert f.default is False, flag
            p.add_argument(flag, action="store_true", help=f.metadata["help"])
            continue
        union = typing.get_origin(kind) in (typing.Union, types.UnionType)      # X | None
        kinds = [t for t in (typing.get_args(kind) if union else (kind,)) if t is not type(None)]
        listed = len(kinds) == 1 and typing.get_origin(kinds[0]) is list   # one or more values
        number = kinds[0] if len(kinds) == 1 and kinds[0] in (int, float) else None
        p.add_argument(flag, default=f.default, nargs="+" if listed else None, type=number,
                       choices=f.metadata["choices"], metavar=f.metadata.get("metavar"),
                       help=f.metadata["help"])


def options_from_args(args, options_class):
    from dataclasses import fields
    return options_class(**{f.name: getattr(args, f.name) for f in fields(options_class)})


def run_serve(args) -> int:
    import uvicorn

    from kvslim.formats.registry import DEFAULT_MODEL_NAME
    from kvslim.scaleout.options import ScaleOutOptions
    from kvslim.server.context import ServerOptions

    scale = options_from_args(args, ScaleOutOptions)
    scale.check()
    options = options_from_args(args, ServerOptions)
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    if name == "default":
        name = DEFAULT_MODEL_NAME
    server, crashed = None, []

    def engine_crashed() -> None:                # every open request has its error already
        crashed.append(True)
        server.should_exit = True

    if scale.uses_ray:
        engine, app = _replicated(args, name, options, scale)
    else:
        engine, app = _one_engine(args, name, options, engine_crashed)
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
        engine.shutdown()                        # tensor-parallel ranks, Ray replicas, if any
    # Drained: a repeated SIGTERM while the interpreter shuts down (when Python has put the
    # default handler back) would turn this clean exit into a kill.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Exit promptly after the drain: the interpreter's last garbage collections would walk every
    # object torch, pydantic and FastAPI made (seconds); frozen objects are skipped.
    gc.freeze()
    # Non-zero when the engine died: a supervisor restarts the server instead of keeping a
    # process that answers 503 forever.
    return 0 if server.started and not crashed else 1


def _one_engine(args, name: str, options, engine_crashed):
    """The LLM (whose `shutdown` ends its ranks) and the app over it, its limits printed."""
    from kvslim.server.app import build_app
    llm = llm_from_args(args)                    # bad model or flags: one-line error, exit 2
    try:                                         # bad --lora-modules: one-line error
        app = build_app(llm.engine, name, args.api_key, on_engine_crash=engine_crashed,
                        options=options)
    except BaseException:
        llm.shutdown()
        raise
    stats = llm.engine.kv_cache_stats()
    _announce(args, name, f"{stats.num_blocks} KV blocks of {stats.block_size} tokens",
              stats.max_tokens, llm.engine.max_model_len)
    return llm, app


def _replicated(args, name: str, options, scale):
    """The replica pool (whose `shutdown` ends the replicas and a local Ray) and the app."""
    from kvslim.cli.engine_args import check_args, engine_options_from_args
    from kvslim.scaleout.app import app_over_replicas, check_supported, launch_replicas
    check_supported(scale, options)
    check_args(args)                             # every flag, before Ray starts
    pool = launch_replicas(args.model, engine_options_from_args(args), args.threads, scale)
    try:
        app = app_over_replicas(pool, name, args.api_key, options)
    except BaseException:
        pool.shutdown()
        raise
    facts = pool.facts
    replicas = f"{scale.data_parallel_size} replica{'s' * (scale.data_parallel_size > 1)}"
    _announce(args, name, f"{replicas} on Ray routed by {scale.routing}, each "
              f"{facts.num_blocks} KV blocks of {facts.block_size} tokens",
              facts.max_tokens, facts.max_model_len)
    return pool, app


def _announce(args, name: str, what: str, max_tokens: int, max_model_len: int) -> None:
    print(f"kvslim serve: {name} on http://{args.host}:{args.port} ({what}, max_model_len "
          f"{max_model_len})", file=sys.stderr, flush=True)
    if max_tokens < max_model_len:
        # The engine rejects a request whose prompt + max_tokens exceeds the whole cache, and a
        # chat request without max_tokens asks for up to max_model_len.
        print(f"kvslim serve: warning: the KV cache holds {max_tokens} tokens, fewer than "
              f"max_model_len; requests without max_tokens will be refused. Raise "
              f"--kv-cache-memory or lower --max-model-len to {max_tokens}.",
              file=sys.stderr, flush=True)
