"""Embeddings (engine/embedding.py, LLMEngine.embed): transformers' final normed hidden states
pooled and L2-normalised, the same whether inputs run alone or batched, checked like prompts,
and computed without a KV-cache block, even between the steps of a running request."""
import pytest
import torch
import torch.nn.functional as F

from checkpoints import write_checkpoint
from engine_helpers import GREEDY, engine, prompts_of, run
from kvslim.engine.embedding import length_batches
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import InvalidRequestError

LENGTHS = [7, 1, 23, 12, 40]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint("gqa", tmp_path_factory.mktemp("embed") / "gqa")


@pytest.fixture(scope="module")
def eng(model_dir):
    return engine(model_dir, max_model_len=64, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_embedding(hf, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
        last = hf.model(torch.tensor([ids])).last_hidden_state
    hidden = out.hidden_states[-1][0]
    # transformers' last hidden state is the one after the model's final norm
    torch.testing.assert_close(hidden, last[0], rtol=0, atol=0)
    return F.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_transformers_final_normed_hidden_states(eng, hf, pooling):
    prompts = prompts_of(LENGTHS, seed=1)
    outputs = eng.embed(prompts, pooling)
    assert [o.prompt_token_ids for o in outputs] == prompts
    for out, ids in zip(outputs, prompts):
        got = torch.tensor(out.embedding)
        assert got.shape == (64,) and got.norm().item() == pytest.approx(1.0, abs=1e-6)
        assert F.cosine_similarity(got, hf_embedding(hf, ids, pooling), dim=0) > 0.999


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_batched_equals_alone(eng, pooling):
    prompts = prompts_of(LENGTHS, seed=2)
    batched = eng.embed(prompts, pooling)                  # padded, over several batches
    for out, ids in zip(batched, prompts):
        alone = eng.embed([ids], pooling)[0]
        torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(alone.embedding),
                                   rtol=0, atol=1e-6)


def test_length_batches_fill_the_budget_shortest_first():
    assert length_batches([5, 1, 3, 8], 8) == [[1, 2], [0], [3]]
    assert length_batches([4, 4, 4], 12) == [[0, 1, 2]]
    assert length_batches([20], 8) == [[0]]                # longer than the budget: alone


def test_text_is_tokenized_as_a_prompt(eng):
    text = "In the beginning God created"
    out = eng.embed([text])[0]
    assert out.prompt_token_ids == eng.tokenizer.encode(text)
    assert out.embedding == eng.embed([out.prompt_token_ids])[0].embedding


def test_bad_inputs_are_refused_naming_input(eng):
    assert len(eng.embed([[5] * 64])[0].prompt_token_ids) == 64   # may fill max_model_len
    for bad, message in [([[5] * 65], "input has 65 tokens, but max_model_len is 64"),
                         ([[]], "input must not be empty"), ([""], "input must not be empty"),
                         ([[3, 320]], "token id 320 is outside the vocabulary (0..319)")]:
        with pytest.raises(InvalidRequestError) as e:
            eng.embed([[1, 2]] + bad)
        assert str(e.value) == message and e.value.param == "input"
    with pytest.raises(InvalidRequestError) as e:
        eng.embed([[1, 2]], "max")
    assert e.value.param == "pooling"


def test_no_kv_block_is_used_even_between_steps_of_a_running_request(eng):
    prompt = prompts_of([20], seed=3)[0]
    params = SamplingParams(max_tokens=12, **GREEDY)
    expected = run(eng, [prompt], params)[0].outputs[0].token_ids
    free = eng.kv_cache_stats().num_free_blocks
    request_id = eng.add_request(prompt, params)
    eng.step()
    in_use = eng.kv_cache_stats()
    eng.embed(prompts_of(LENGTHS, seed=4))
    after = eng.kv_cache_stats()
    assert (after.num_used_blocks, after.num_free_blocks) == (in_use.num_used_blocks,
                                                               in_use.num_free_blocks)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert done[request_id].outputs[0].token_ids == expected
    assert eng.kv_cache_stats().num_free_blocks == free
