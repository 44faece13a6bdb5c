"""Can LMCache be kvslim's KV offload tier on a CPU-only machine? Run it in a venv of its own
(LMCache pins its own torch and CUDA packages):

    python -m venv /tmp/lmc && /tmp/lmc/bin/pip install lmcache torch==2.13.0
    /tmp/lmc/bin/python benchmarks/lmcache_cpu_probe.py

It builds LMCache's engine with a CPU and a local-disk backend, then the connector that copies
a paged KV cache in and out of it (vLLM's layout, kvslim's too), then stores and retrieves one
prompt's blocks. It prints each step's outcome as JSON lines; docs/kv-tier.md records what it
printed here."""
from __future__ import annotations

import json
import tempfile


def step(name: str, fn):
    try:
        value = fn()
        print(json.dumps({"step": name, "ok": True}))
        return value
    except Exception as e:                                     # the probe reports, not raises
        print(json.dumps({"step": name, "ok": False, "error": f"{type(e).__name__}: {e}"[:300]}))
        return None


def main() -> None:
    import torch
    import lmcache
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    import lmcache.v1.gpu_connector.gpu_connectors as connectors
    print(json.dumps({"lmcache": getattr(lmcache, "__version__", "?"), "torch": torch.__version__,
                      "cuda": torch.cuda.is_available()}))
    disk = tempfile.mkdtemp()
    config = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=True,
                                               max_local_cpu_size=0.1,
                                               local_disk=f"file://{disk}/",
                                               max_local_disk_size=0.1)
    metadata = LMCacheMetadata(model_name="probe", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=torch.float32,
                               kv_shape=(2, 2, 16, 2, 8), chunk_size=16)
    connector = step("connector (VLLMPagedMemGPUConnectorV2 on the CPU)", lambda:
                     connectors.VLLMPagedMemGPUConnectorV2(
                         hidden_dim_size=16, num_layers=2, use_gpu=False, chunk_size=16,
                         dtype=torch.float32, device="cpu"))
    engine = step("engine", lambda: LMCacheEngineBuilder.get_or_create(
        "probe", config, metadata, connector, lambda t, r: None, lambda o, r: o))
    if engine is None:
        return
    caches = [torch.randn(2, 10, 16, 2, 8) for _ in range(2)]
    tokens, slots = torch.arange(32), torch.arange(32)
    step("store", lambda: engine.store(tokens, kvcaches=caches, slot_mapping=slots))


if __name__ == "__main__":
    main()
