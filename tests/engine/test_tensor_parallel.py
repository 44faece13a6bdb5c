"""Tensor parallelism through the engine, 2 gloo ranks on the CPU, against one rank of the same
model: the same greedy and seeded tokens and logprobs within 1e-5 (prompt logprobs included)
through the paged engine with chunked prefill, preemption, copy-on-write forks and prefix-cache
hits; each rank's KV cache the planner's; a torchrun-style launch (env://, one process per
rank); the degrees and launches it refuses, in one line.

Both engines of a model get the same number of KV blocks (the one-rank engine a budget as many
times larger as its cache is per token), so they schedule every step alike: preemptions and
prefix hits must match too. Starting the ranks costs seconds, so each model's engines are
shared by the module's tests (every test runs the same requests on both, in the same order)."""
import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from engine_helpers import GREEDY, run
from kvslim import LLM
from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.parallel_executor import check_tensor_parallel
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError
from kvslim.models.config import ModelConfig
from kvslim.parallel.memory import tensor_parallel_memory

TP = 2
BLOCK_SIZE, NUM_BLOCKS = 4, 40                # per rank: 160 tokens, fewer than a batch needs
COMMON = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, max_num_seqs=8,
              max_num_batched_tokens=16,      # prompts longer than 16 tokens are chunked
              tensor_parallel_oversubscribe=True)      # 2 ranks on any machine, 1 core too
TOLERANCE = 1e-5

_gen = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(0, 300, (n,), generator=_gen).tolist() for n in (23, 17, 9, 30, 5, 26)]
# Their first 16 tokens (4 full blocks) again, with new endings: prefix-cache hits
SHARED = [PROMPTS[3][:16] + [7, 8, 9], PROMPTS[0][:16] + [11] * 6, PROMPTS[3][:16] + [5]]


def kv_cache_memory(config: ModelConfig, world_size: int) -> int:
    return NUM_BLOCKS * BLOCK_SIZE * tensor_parallel_memory(config, world_size).kv_bytes_per_token


@pytest.fixture(scope="module", params=["gqa", "mqa", "mha"])
def engines(request, hf_checkpoints):
    """(path, one-rank engine, TP-rank engine) for one model: split KV heads (GQA: 2 -> 1 per
    rank; MHA: 4 -> 2), replicated ones (MQA: each rank holds the single KV head)."""
    path = hf_checkpoints[request.param]
    config = ModelConfig.from_dir(path)
    one = LLMEngine(path, EngineConfig(**COMMON, kv_cache_memory=kv_cache_memory(config, 1)))
    tp = LLMEngine(path, EngineConfig(**COMMON, kv_cache_memory=kv_cache_memory(config, TP),
                                      tensor_parallel_size=TP))
    yield path, one, tp
    tp.shutdown()


def both(engines, prompts, params):
    _, one, tp = engines
    return run(one, prompts, params), run(tp, prompts, params)


def assert_logprobs_close(a, b):
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) <= TOLERANCE
    for x, y in zip(a, b):
        assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_greedy_batch_matches_one_rank(engines):
    """Chunked prefills and preemptions (the batch outgrows the cache), then prefix hits."""
    params = SamplingParams(max_tokens=14, logprobs=2, **GREEDY)
    for prompts in (PROMPTS, SHARED):
        ref, got = both(engines, prompts, params)
        for r, g in zip(ref, got):
            assert g.outputs[0].token_ids == r.outputs[0].token_ids
            assert_logprobs_close(r.outputs[0].logprobs, g.outputs[0].logprobs)
    _, one, tp = engines
    s1, s2 = one.kv_cache_stats(), tp.kv_cache_stats()
    assert s1.num_blocks == s2.num_blocks == NUM_BLOCKS
    assert s2.num_preemptions == s1.num_preemptions > 0
    assert s2.prefix_cache_hits == s1.prefix_cache_hits > 0
    assert got[0].metrics.num_cached_tokens == 16


def test_prompt_logprobs_match_one_rank(engines):
    """The logits of every prompt position, through the engine, within 1e-5 of one rank's."""
    params = SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY)
    ref, got = both(engines, PROMPTS[:4], params)
    for r, g, prompt in zip(ref, got, PROMPTS):
        assert len(g.prompt_logprobs) == len(prompt) and g.prompt_logprobs[0] is None
        assert_logprobs_close(r.prompt_logprobs[1:], g.prompt_logprobs[1:])


def test_seeded_forks_match_one_rank(engines):
    """n = 2 completions forked from one prompt (copy-on-write blocks), seeded sampling: rank 0
    samples from logits equal to one rank's, so the draws are the same."""
    params = SamplingParams(n=2, max_tokens=10, temperature=0.8, top_p=0.9, seed=11,
                            ignore_eos=True)
    ref, got = both(engines, [PROMPTS[1], PROMPTS[2]], params)
    for r, g in zip(ref, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]


def test_each_rank_holds_the_planners_kv_bytes(engines):
    path, one, tp = engines
    config = ModelConfig.from_dir(path)
    stats = tp.rank_kv_stats()
    assert [s.rank for s in stats] == list(range(TP))
    want = tensor_parallel_memory(config, TP).kv_bytes_per_token
    assert {s.kv_bytes_per_token for s in stats} == {s.kv_slot_bytes for s in stats} == {want}
    assert {s.num_blocks for s in stats} == {NUM_BLOCKS}
    assert tp.kv_cache_stats().bytes_per_token == want
    whole = tensor_parallel_memory(config, 1).kv_bytes_per_token
    assert one.rank_kv_stats()[0].kv_bytes_per_token == whole
    # split KV heads shrink a rank's share; a replicated head (MQA) does not
    assert want * (TP if config.num_key_value_heads >= TP else 1) == whole


# ---- refused, in one line ----------------------------------------------------------------------
def test_a_degree_that_cannot_split_the_heads_is_refused_before_loading(hf_checkpoints,
                                                                        monkeypatch):
    import kvslim.engine.parallel_worker as worker
    monkeypatch.setattr(worker, "load_model", lambda *a, **k: pytest.fail("loaded weights"))
    with pytest.raises(KvslimError, match="tensor_parallel_size 3 cannot split 8 query heads"):
        LLMEngine(hf_checkpoints["gqa"], EngineConfig(**COMMON, tensor_parallel_size=3))


def test_more_ranks_than_cores_needs_the_override(hf_checkpoints, monkeypatch):
    import kvslim.engine.parallel_executor as executor
    monkeypatch.setattr(executor, "usable_cores", lambda: 1)
    config = ModelConfig.from_dir(hf_checkpoints["gqa"])
    crowded = EngineConfig(dtype="float32", device="cpu", tensor_parallel_size=2)
    with pytest.raises(KvslimError, match="runs 2 ranks on this machine, which has 1 CPU cores"):
        check_tensor_parallel(config, crowded)
    check_tensor_parallel(config, dataclasses.replace(crowded, tensor_parallel_oversubscribe=True))


def test_speculative_decoding_is_refused():
    with pytest.raises(KvslimError, match="speculative decoding with tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2,
                     speculative={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.parametrize("flag,message", [
    ("3", "tensor_parallel_size 3 cannot split 8 query heads: it must divide"),
    ("0", "tensor_parallel_size must be a positive integer, got 0"),
])
def test_cli_refuses_a_bad_degree_in_one_line(hf_checkpoints, flag, message):
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "generate", "--model",
                        str(hf_checkpoints["gqa"]), "--prompt", "x", "--raw", "--max-tokens", "1",
                        "--tensor-parallel-size", flag], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and message in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---- launched by torchrun (env://) -------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_style_launch_matches_one_rank(hf_checkpoints):
    """What `torchrun --nproc-per-node 2 -m kvslim.cli.main generate ...` starts: two processes
    with RANK/WORLD_SIZE set. Rank 0 runs the command, rank 1 serves it and exits with it."""
    path = str(hf_checkpoints["gqa"])
    engine_flags = ["--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "1MiB"]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "kvslim.cli.main", "generate", "--model", path, "--raw",
           "--prompt", "It is a truth", "--max-tokens", "8", "--json", "--threads", "1",
           "--tensor-parallel-size", "2", "--tensor-parallel-oversubscribe", *engine_flags]
    ranks = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in ranks] == [0, 0], [err for _, err in outs]
    got = json.loads(outs[0][0])
    assert outs[1][0] == ""                         # rank 1 only served rank 0's steps
    with LLM(path, dtype="float32", device="cpu", kv_cache_memory="1MiB") as llm:
        ref = llm.generate("It is a truth", SamplingParams(max_tokens=8, temperature=0.0),
                           use_tqdm=False)[0]
    assert got["token_ids"] == ref.outputs[0].token_ids and got["text"] == ref.outputs[0].text
