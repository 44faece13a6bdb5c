"""A model whose layers have different KV head counts (a budgeted GQA conversion) in the paged
engine: one K/V tensor per layer with its own head count, the same block ids in every layer;
greedy output equal to the model's own dense forward, whatever the batch composition, and the
allocation equal to the memory planner's bytes."""
import pytest
import torch

from checkpoints import VOCAB
from engine_helpers import GREEDY, engine, run, tokens
from kvslim.engine.sampling_params import SamplingParams
from kvslim.formats.loader import load_model
from kvslim.models.config import ModelConfig
from kvslim.cli.memory_cmds import resolve_model_config as resolve_spec
from kvslim.plan.memory import plan_memory, storage_bytes
from kvslim.plan.parameters import parameter_counts
from kvslim.surgery.convert import convert_to_gqa

LAYER_HEADS = [4, 1]                       # of the 8-head twin: a GQA layer and an MQA layer
LENGTHS = [3, 17, 40, 5, 33, 1, 20]
NEW = 16
PARAMS = SamplingParams(max_tokens=NEW, **GREEDY)


@pytest.fixture(scope="module")
def nonuniform(hf_checkpoints, tmp_path_factory):
    return convert_to_gqa(hf_checkpoints["mha8"], tmp_path_factory.mktemp("nu") / "m",
                          LAYER_HEADS, "mean", show_progress=False)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def dense_greedy(model_dir, prompts) -> list[list[int]]:
    """Greedy continuations from the model's dense forward (no cache): the ground truth."""
    model = load_model(model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(NEW):
                ids.append(int(model.logits(torch.tensor([ids]))[0, -1].argmax()))
            refs.append(ids[len(p):])
    return refs


@pytest.fixture(scope="module")
def dense_refs(nonuniform, prompts):
    return dense_greedy(nonuniform, prompts)


def test_cache_has_one_tensor_per_layer_with_its_heads(nonuniform):
    eng = engine(nonuniform)
    assert [t.shape[3] for t in eng.runner.kv_cache] == LAYER_HEADS
    assert {t.shape[1] for t in eng.runner.kv_cache} == {eng.runner.num_blocks}
    assert ModelConfig.from_dir(nonuniform).layer_kv_heads == tuple(LAYER_HEADS)


def test_batched_matches_dense_forward(nonuniform, prompts, dense_refs):
    assert tokens(run(engine(nonuniform), prompts, PARAMS)) == dense_refs


def test_every_batch_composition_gives_the_same_tokens(nonuniform, prompts, dense_refs):
    eng = engine(nonuniform)
    assert [tokens(run(eng, [p], PARAMS))[0] for p in prompts] == dense_refs
    chunked = engine(nonuniform, max_num_batched_tokens=8)
    assert tokens(run(chunked, prompts, PARAMS)) == dense_refs
    tight_bytes = engine(nonuniform, kv_cache_memory="64KiB").runner.bytes_per_block
    tight = engine(nonuniform, kv_cache_memory=10 * tight_bytes, block_size=8)
    assert tokens(run(tight, prompts, PARAMS)) == dense_refs
    assert tight.kv_cache_stats().num_preemptions > 0


def test_prefix_cache_hits_and_quantized_cache(nonuniform, prompts, dense_refs):
    shared = [prompts[2] + p for p in prompts[:3]]
    eng = engine(nonuniform, enable_prefix_caching=True, block_size=8)
    refs = dense_greedy(nonuniform, shared)
    assert tokens(run(eng, shared, PARAMS)) == refs
    assert tokens(run(eng, shared, PARAMS)) == refs          # now from the prefix cache
    assert eng.kv_cache_stats().prefix_cache_hit_rate > 0
    int8 = engine(nonuniform, kv_cache_dtype="int8")
    assert [t.shape[3] for t in int8.runner.kv_scales] == LAYER_HEADS
    assert len(tokens(run(int8, prompts, PARAMS))[0]) == NEW


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_allocation_equals_the_planner(nonuniform, kv_dtype):
    budget = 1_000_003
    eng = engine(nonuniform, kv_cache_memory=budget, max_num_seqs=4, kv_cache_dtype=kv_dtype)
    spec = resolve_spec(str(nonuniform))
    weights = storage_bytes(parameter_counts(spec)[0], "fp32")
    plan = plan_memory(spec, context=100, kv_dtype="int8" if kv_dtype == "int8" else "float32",
                       memory_bytes=budget + weights)
    runner = eng.runner
    d = spec.head_dim
    per_token = 2 * sum(LAYER_HEADS) * d * (1 if kv_dtype == "int8" else 4)
    per_token += 2 * sum(LAYER_HEADS) * 2 if kv_dtype == "int8" else 0    # float16 scales
    assert plan.kv_bytes_per_token == runner.kv_slot_bytes == per_token
    assert plan.kv_bytes_per_token == runner.bytes_per_block // runner.block_size
    own = plan.layout(spec.attention_kind).capacity
    assert (own.num_blocks, own.max_tokens) == (runner.num_blocks,
                                                eng.kv_cache_stats().max_tokens)
    assert parameter_counts(spec)[0] == sum(p.numel() for p in load_model(nonuniform).parameters())
