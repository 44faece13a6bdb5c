"""`kvslim serve --data-parallel-size N`: the replicas launched on Ray, and the same FastAPI app
as for one engine (server/app.py) over them. The API server loads no model: it tokenizes (chat
templates, /tokenize, the router's prefix keys) with the model's tokenizer and knows the
replicas' limits from their first answer."""
from __future__ import annotations

import math

from fastapi import FastAPI

from kvslim.device import resolve_device
from kvslim.engine.config import EngineConfig
from kvslim.errors import KvslimError
from kvslim.formats.registry import engine_model_dir
from kvslim.scaleout.options import ScaleOutOptions
from kvslim.scaleout.ray_runtime import import_ray, start_runtime, usable_cores
from kvslim.server.app import app_over
from kvslim.server.context import ServerContext, ServerOptions
from kvslim.server.metrics import ServerMetrics
from kvslim.tokenizer.tokenizer import Tokenizer


def check_supported(options: ScaleOutOptions, server_options: ServerOptions) -> None:
    """What replicas do not do yet, refused in one line before anything starts."""
    if server_options.lora_modules or server_options.allow_runtime_lora_updating:
        raise KvslimError("--lora-modules and --allow-runtime-lora-updating are not served by "
                          "data-parallel replicas yet; run one engine (--data-parallel-size 1 "
                          "without --ray-address)")


def launch_replicas(model: str | None, engine_options: dict, threads: int | None,
                    options: ScaleOutOptions):
    """The ReplicaPool, every replica loaded (Ray started or joined here)."""
    ray = import_ray()                               # a missing extra: one line, first
    from kvslim.scaleout.pool import ReplicaPool, rank_resources
    from kvslim.scaleout.replica import ReplicaSpec
    config = EngineConfig.from_options(**engine_options)
    # Resolved once here: a GGUF model is imported before the replicas look for it, so that
    # replicas on this machine find the import instead of racing to make it.
    tokenizer = Tokenizer.from_dir(engine_model_dir(model, config.dtype))
    device_type = resolve_device(config.device).type
    local = options.ray_address in (None, "local")
    ranks = options.data_parallel_size * config.tensor_parallel_size
    # A local runtime declares this machine's cores, or what --replica-cpus asks for all ranks.
    declared = max(usable_cores(), math.ceil(ranks * (options.replica_cpus or 0)))
    runtime = start_runtime(options.ray_address, declared)
    try:
        total = declared if local else ray.cluster_resources().get("CPU", 1.0)
        cpus, gpus, rank_threads = rank_resources(options, engine_options, threads,
                                                  device_type, total)
        spec = ReplicaSpec(model, engine_options, rank_threads, cpus, gpus)
    except BaseException:
        runtime.shutdown()
        raise
    return ReplicaPool.launch(runtime, spec, options, tokenizer)


def app_over_replicas(pool, model_name: str, api_key: str | None,
                      server_options: ServerOptions) -> FastAPI:
    metrics = ServerMetrics(model_name, engine_series=False)
    metrics.registry.register(pool.metrics)
    facts = pool.facts
    ctx = ServerContext(pool, pool.tokenizer, model_name, facts.max_model_len, metrics,
                        api_key, server_options, hidden_size=facts.hidden_size)
    return app_over(ctx, facts.vocab_size, facts.max_num_seqs)
