"""Scale-out: engine replicas on Ray behind one OpenAI-compatible API server (`kvslim serve
--data-parallel-size N [--ray-address ADDR]`, docs/scale-out.md).

    options.py         the --data-parallel-size, --ray-address, --routing, --replica-cpus flags
    router.py          which replica a request goes to: prefix index, least loaded, round robin
    ray_runtime.py     Ray imported (an optional extra), a local runtime started and stopped
    replica.py         one replica: a Ray actor around an LLMEngine and its AsyncEngine
    ranks.py           a replica's tensor-parallel ranks as Ray actors in its placement group
    pool.py            the replicas: start, health, restarts; the app's engine client
    stream.py          one HTTP request's outputs from its replica, retried once if it died
    replica_metrics.py the replicas' engine series under vLLM's engine="N" label
    app.py             the replicas launched, and server/app.py's app over them

Only options.py and router.py are imported without Ray; `import ray` happens when a pool
starts, so `from kvslim import LLM` and a single-engine server never load it."""
