"""The engine with a 4- or 2-bit KV cache (attention/lowbit_cache.py): prompt logprobs equal a
dense plain-torch reference of the same arithmetic (keys per channel over each full block,
values per token in groups, a query's own block in float16); greedy output independent of the
batch, of chunking, of preemption and of prefix-cache hits; forks and speculative chains keep
working; more blocks than int8 in the same budget; one-line errors for what is not built."""
import pytest
import torch

from engine_helpers import GREEDY, engine, needs_kernels, prompts_of, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError
from kvslim.formats.loader import load_model
from kvslim.kv_cache.plan import packed_recent_bytes
from kvslim.kernels.lowbit_codes import (RESIDUAL_BLOCKS, dequantize_keys, dequantize_values,
                                         hadamard, quantize_key_blocks, quantize_value_blocks)

pytestmark = needs_kernels
PARAMS = SamplingParams(max_tokens=16, **GREEDY)
BLOCK = 4


class LowBitReference:
    """Dense attention over a [1, T] pass that sees K/V as the packed cache stores them; a
    layer with a sliding window (`windows`, per layer) sees the keys inside it."""
    def __init__(self, bits: int, rotate: bool, windows=None):
        self.bits, self.rotate = bits, rotate
        self.residual = RESIDUAL_BLOCKS[bits]
        self.windows = windows

    def caches_latent(self, layer_idx):
        return False

    def attend(self, layer_idx, q, k, v, scale):
        t, d = q.shape[1], q.shape[-1]
        rot = hadamard(d).double() if self.rotate else torch.eye(d, dtype=torch.float64)
        q, k, v = q[0].double() @ rot, k[0].double() @ rot, v[0].double() @ rot
        k16, v16 = k.half().double(), v.half().double()
        full = t // BLOCK * BLOCK
        blocks = lambda x: x[:full].view(-1, BLOCK, *x.shape[1:])      # noqa: E731
        kq = torch.cat([dequantize_keys(*quantize_key_blocks(blocks(k16), self.bits),
                                        self.bits).flatten(0, 1).double(), k16[full:]])
        vq = torch.cat([dequantize_values(*quantize_value_blocks(blocks(v16), self.bits),
                                          self.bits).flatten(0, 1).double(), v16[full:]])
        pos = torch.arange(t)
        # a query's residual: its own block and the residual - 1 before it, in float16
        first = (pos[:, None] // BLOCK - self.residual + 1).clamp(min=0)
        own = (pos[None, :] // BLOCK >= first)[:, :, None, None]                 # [Tq, Tk]
        g = q.shape[1] // k.shape[1]
        keys = torch.where(own, k16.repeat_interleave(g, 1)[None],
                           kq.repeat_interleave(g, 1)[None])                # [Tq, Tk, H, D]
        values = torch.where(own, v16.repeat_interleave(g, 1)[None],
                             vq.repeat_interleave(g, 1)[None])
        scores = torch.einsum("qhd,qkhd->qhk", q, keys) * scale
        hidden = pos[None, None, :] > pos[:, None, None]
        window = self.windows[layer_idx] if self.windows else None
        if window:
            hidden |= pos[None, None, :] <= pos[:, None, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out = torch.einsum("qhk,qkhd->qhd", scores.softmax(-1), values) @ rot.T
        return out[None].float()


def reference_logprobs(path, prompt, bits, rotate=False):
    model = load_model(path, dtype=torch.float32)
    x = torch.tensor([prompt])
    with torch.no_grad():
        attn = LowBitReference(bits, rotate, model.config.layer_sliding_windows)
        hidden = model(x, torch.arange(len(prompt))[None], attn=attn)
        logp = model.compute_logits(hidden)[0].log_softmax(-1)
    return torch.tensor([logp[i, prompt[i + 1]] for i in range(len(prompt) - 1)])


@pytest.mark.parametrize("variant", ["gqa", "mqa", "gemma3"])
@pytest.mark.parametrize("bits,rotate", [(4, False), (2, False), (4, True)])
def test_prompt_logprobs_equal_the_reference_of_the_same_arithmetic(hf_checkpoints, variant,
                                                                    bits, rotate):
    prompt = prompts_of([37], seed=4)[0]
    eng = engine(hf_checkpoints[variant], kv_cache_dtype=f"int{bits}", kv_hadamard=rotate,
                 block_size=BLOCK, max_num_batched_tokens=6)
    out = run(eng, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY))[0]
    got = torch.tensor([t.logprob for t in out.prompt_logprobs[1:]])
    want = reference_logprobs(hf_checkpoints[variant], prompt, bits, rotate)
    assert (got - want).abs().max() < 2e-4


@pytest.fixture(scope="module", params=["gqa", "mqa", "head_dim"])
def path(request, hf_checkpoints):
    return hf_checkpoints[request.param]


@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_greedy_is_independent_of_batch_chunks_preemption_and_prefix_cache(path, dtype):
    shared = prompts_of([24], seed=9)[0]
    prompts = prompts_of([3, 17, 40, 5, 33]) + prompts_of([4, 11, 7], seed=1, prefix=shared)
    options = dict(kv_cache_dtype=dtype, block_size=BLOCK)
    alone = [tokens(run(engine(path, **options), [p], PARAMS))[0] for p in prompts]
    assert tokens(run(engine(path, **options), prompts, PARAMS)) == alone
    chunked = engine(path, max_num_batched_tokens=7, **options)
    assert tokens(run(chunked, prompts, PARAMS)) == alone
    per_block = chunked.runner.bytes_per_block
    recent = packed_recent_bytes(chunked.model_config, BLOCK, 64,
                                 chunked.runner.kv_caches[0].recent_blocks)
    tight = engine(path, kv_cache_memory=recent + 40 * per_block, **options)
    assert tokens(run(tight, prompts, PARAMS)) == alone
    assert tight.kv_cache_stats().num_preemptions > 0
    cached = engine(path, **options)
    first = run(cached, prompts[-3:-2], PARAMS)
    rest = run(cached, prompts[-2:], PARAMS)
    # int2 keeps a full block in its float16 residual: no prefix cache (block_manager.py)
    hit = 24 if dtype == "int4" else 0
    assert all(o.metrics.num_cached_tokens == hit for o in rest)
    assert tokens(first + rest) == alone[-3:]


@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_forks_and_speculative_chains_decode_as_plain_greedy(hf_checkpoints, dtype):
    path = hf_checkpoints["gqa"]
    prompts = prompts_of([9, 30, 6], seed=5)
    plain = tokens(run(engine(path, kv_cache_dtype=dtype, block_size=BLOCK), prompts, PARAMS))
    forked = run(engine(path, kv_cache_dtype=dtype, block_size=BLOCK), prompts,
                 SamplingParams(max_tokens=16, n=2, **GREEDY))
    assert [[c.token_ids for c in o.outputs] for o in forked] == [[t, t] for t in plain]
    spec = engine(path, kv_cache_dtype=dtype, block_size=8,
                  speculative={"method": "ngram", "num_speculative_tokens": 3})
    assert tokens(run(spec, prompts, PARAMS)) == tokens(run(
        engine(path, kv_cache_dtype=dtype, block_size=8), prompts, PARAMS))


def test_more_token_slots_than_int8_in_the_same_budget(hf_checkpoints):
    """Blocks of 64 tokens by default; the recent rows (one block per sequence row) come out of
    the budget, and the rest is whole blocks whose bytes the planner counts exactly."""
    path = hf_checkpoints["gqa"]
    engines = {d: engine(path, kv_cache_dtype=d, kv_cache_memory="4MiB", max_num_seqs=8)
               for d in ("int8", "int4", "int2")}
    slots = {d: e.runner.num_blocks * e.config.block_size for d, e in engines.items()}
    assert slots["int8"] < slots["int4"] < slots["int2"]
    eng = engines["int4"]
    assert eng.config.block_size == 64 and engines["int8"].config.block_size == 16
    assert eng.kv_cache_stats().bytes_per_token == eng.model_config.kv_cache_bytes_per_token(
        "int4", 64)
    recent = packed_recent_bytes(eng.model_config, 64, 8, 1)
    block = eng.model_config.kv_cache_block_bytes("int4", 64)
    assert eng.runner.num_blocks == (4 * 2**20 - recent) // block
    assert sum(t.numel() * t.element_size() for t in eng.runner.kv_cache) == \
        recent + eng.runner.num_blocks * block


def test_what_is_not_built_is_refused_in_one_line(hf_checkpoints):
    with pytest.raises(KvslimError, match="CPU decode kernel"):
        engine(hf_checkpoints["gqa"], kv_cache_dtype="int4", attention_backend="gather")
    with pytest.raises(KvslimError, match="power-of-two head_dim"):
        engine(hf_checkpoints["head_dim"], kv_cache_dtype="int4", kv_hadamard=True)
    with pytest.raises(KvslimError, match="chains of drafts"):
        engine(hf_checkpoints["gqa"], kv_cache_dtype="int2", block_size=4,
               speculative={"method": "ngram", "num_speculative_tokens": 4})


def test_two_tensor_parallel_ranks_decode_as_one(hf_checkpoints):
    """Each rank packs its own KV heads and keeps its own recent rows."""
    path, prompts = hf_checkpoints["gqa"], prompts_of([5, 13, 30], seed=3)
    one = tokens(run(engine(path, kv_cache_dtype="int4"), prompts, PARAMS))
    two = engine(path, kv_cache_dtype="int4", tensor_parallel_size=2,
                 tensor_parallel_oversubscribe=True)
    try:
        assert tokens(run(two, prompts, PARAMS)) == one
    finally:
        two.shutdown()
