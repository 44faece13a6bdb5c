"""A fault in one request's own work (detokenizing, stop strings, building its output) ends that
request with an error and frees its blocks while the rest of the batch goes on; a fault in the
batch's forward pass makes the engine raise `EngineFailedError`."""
from __future__ import annotations

import pytest

from engine_helpers import GREEDY, engine, run, tokens
from kvslim.engine.output_processor import OutputProcessor
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import EngineFailedError

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]


def _poison_detokenizer(eng, request_id: str, after_calls: int) -> None:
    """Make the detokenizer(s) of `request_id` raise from their `after_calls`-th token on."""
    state = eng.requests[request_id]
    for detok in state.detokenizers.values():
        calls = {"n": 0}
        real = detok.add_tokens

        def add_tokens(ids, *args, _real=real, _calls=calls):
            _calls["n"] += 1
            if _calls["n"] >= after_calls:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated fault")
            return _real(ids, *args)

        detok.add_tokens = add_tokens


@pytest.mark.parametrize("n", [1, 2])
def test_a_failing_request_ends_with_an_error_and_the_others_are_unaffected(hf_checkpoints, n):
    eng = engine(hf_checkpoints["gqa"])
    params = SamplingParams(max_tokens=6, **GREEDY)
    alone = tokens(run(eng, PROMPTS, params))
    ids = [eng.add_request(p, SamplingParams(max_tokens=6, n=n if i == 1 else 1, **GREEDY))
           for i, p in enumerate(PROMPTS)]
    _poison_detokenizer(eng, ids[1], after_calls=3)
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id not in finals, "output after the final one"
            if out.finished:
                finals[out.request_id] = out
    bad = finals[ids[1]]
    assert "UnicodeDecodeError" in bad.error and "simulated fault" in bad.error
    assert all(c.finish_reason == "abort" for c in bad.outputs)
    assert [finals[ids[0]].outputs[0].token_ids, finals[ids[2]].outputs[0].token_ids] \
        == [alone[0], alone[2]]
    assert finals[ids[0]].error is None and finals[ids[2]].error is None
    assert eng.kv_cache_stats().num_used_blocks == 0
    assert eng.runner.sampler.penalties == {} and eng.runner.sampler.generators == {}
    assert tokens(run(eng, PROMPTS, params)) == alone           # still serving, same answers


def test_a_failing_output_build_is_contained(hf_checkpoints, monkeypatch):
    eng = engine(hf_checkpoints["gqa"])
    good = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, **GREEDY))
    bad = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=4, **GREEDY))
    real = OutputProcessor._completion

    def completion(state, seq):
        if state.request_id == bad:
            raise KeyError("simulated fault")
        return real(state, seq)

    monkeypatch.setattr(OutputProcessor, "_completion", staticmethod(completion))
    outputs = eng.step()
    by_id = {o.request_id: o for o in outputs}
    assert by_id[bad].finished and "KeyError" in by_id[bad].error
    assert not by_id[good].finished and by_id[good].error is None
    monkeypatch.undo()
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.kv_cache_stats().num_used_blocks == 0


def test_a_failing_forward_pass_raises_engine_failed(hf_checkpoints, monkeypatch):
    eng = engine(hf_checkpoints["gqa"])
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, **GREEDY))

    def execute(out, *args):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(eng.runner, "execute", execute)
    with pytest.raises(EngineFailedError, match="simulated device fault"):
        eng.step()

