"""The engine running a per-layer KV plan (kv_plan=, kv_cache/layer_plan.py): each layer
stores and attends as the dense reference with the same per-layer settings does
(eval/kv_sensitivity.py's DegradedAttention), greedy tokens equal; a sequence's tokens do not
depend on the batch; every pool's blocks come back; the capacity `kvslim plan-kv` writes is the
engine's; what a plan cannot run with is refused in one line."""
import json

import pytest
import torch

from kvslim import LLM, SamplingParams
from kvslim.cli.main import main
from kvslim.errors import KvslimError
from kvslim.eval.kv_sensitivity import DegradedAttention
from kvslim.formats.loader import load_model
from kvslim.kv_cache.budget import KVSetting

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5 + i for i in range(40)], [7, 8, 9] * 12, [11, 3] * 9]


def _write_plan(tmp_path, layers, sinks=4, context=128, name="plan.json"):
    path = tmp_path / name
    path.write_text(json.dumps({
        "layers": [{"precision": p, "window": w} for p, w in layers], "sinks": sinks,
        "context": context, "concurrency": 2, "block_size": 16}))
    return str(path)


def _dense_greedy(model, prompt, settings, sinks, n):
    """Greedy decoding with every layer at its setting, the whole sequence recomputed."""
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor([ids])
        attn = DegradedAttention(len(ids), x.device, settings, sinks, 16,
                                 model.config.layer_sliding_windows)
        hidden = model(x, positions=torch.arange(len(ids))[None], attn=attn)
        ids.append(int(model.compute_logits(hidden[:, -1]).argmax(-1)))
    return ids[len(prompt):]


@pytest.mark.parametrize("variant,layers", [
    ("gqa", [("int8", None), ("auto", 24)]),
    ("mqa", [("auto", 20), ("int8", 20)]),
    ("gemma3", [("int8", 24), ("auto", None), ("int8", None)]),     # beside its own window 7
])
def test_a_plan_decodes_as_its_dense_reference(hf_checkpoints, tmp_path, variant, layers):
    path = _write_plan(tmp_path, layers)
    llm = LLM(str(hf_checkpoints[variant]), kv_plan=path, kv_cache_memory="2MiB",
              max_num_seqs=4)
    outs = llm.generate(PROMPTS[:2], GREEDY)
    model = load_model(hf_checkpoints[variant], dtype="float32", device="cpu")
    settings = [KVSetting(p, w) for p, w in layers]
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == _dense_greedy(model, prompt, settings, 4, 24)


@pytest.mark.parametrize("layers", [[("int8", None), ("int4", 24)],
                                    [("int2", None), ("auto", None)]])
def test_batch_equals_alone_and_every_pool_gets_its_blocks_back(hf_checkpoints, tmp_path,
                                                                  layers):
    llm = LLM(str(hf_checkpoints["gqa"]), kv_plan=_write_plan(tmp_path, layers),
              kv_cache_memory="2MiB", max_num_seqs=4)
    batched = llm.generate(PROMPTS, GREEDY)
    alone = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in alone]
    bm = llm.engine.block_manager
    assert bm.num_used_blocks == 0 and len(bm.free_queues) == len({p for p, _ in layers})
    assert [len(q) for q in bm.free_queues] == [n for _, n in bm.pool_ranges]
    stats = llm.engine.kv_cache_stats()
    assert stats.kv_cache_dtype == "+".join(
        dict.fromkeys("float32" if p == "auto" else p for p, _ in layers))


def test_plan_kv_writes_the_capacity_the_engine_reports(hf_checkpoints, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "plan.json"
    assert main(["plan-kv", str(hf_checkpoints["gqa"]), "--kv-memory", "256KiB",
                 "--context", "96", "--concurrency", "3", "--windows", "16,32",
                 "--calibration", str(text), "--tokens", "64", "--batches", "1",
                 "--out", str(out), "--json"]) == 0
    plan = json.loads(out.read_text())
    llm = LLM(str(hf_checkpoints["gqa"]), kv_plan=str(out), **plan["engine_options"])
    assert llm.engine.kv_cache_stats().max_tokens == plan["max_tokens"] > 0
    assert plan["max_tokens"] >= 96        # the budget holds at least one planned sequence


def test_what_a_plan_cannot_run_with_is_refused(hf_checkpoints, tmp_path):
    path = _write_plan(tmp_path, [("int8", None), ("auto", 24)])
    with pytest.raises(KvslimError, match="^kv_plan sets each layer's .* kv_cache_dtype, "
                                          "kv_window$"):
        LLM(str(hf_checkpoints["gqa"]), kv_plan=path, kv_cache_dtype="int8", kv_window=8)
    with pytest.raises(KvslimError, match="^kv_plan has 1 layers, the model 2"):
        LLM(str(hf_checkpoints["gqa"]), kv_plan=_write_plan(tmp_path, [("int8", None)],
                                                            name="one.json"))
    with pytest.raises(KvslimError, match="^kv_plan: layer 0's precision 'int3' is not one"):
        LLM(str(hf_checkpoints["gqa"]), kv_plan=_write_plan(
            tmp_path, [("int3", None), ("auto", None)], name="bad.json"))
    with pytest.raises(KvslimError, match="^kv_plan: no such file"):
        LLM(str(hf_checkpoints["gqa"]), kv_plan=str(tmp_path / "missing.json"))
