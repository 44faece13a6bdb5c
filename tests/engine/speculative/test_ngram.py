import pytest

from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim.engine.speculative.ngram import NgramProposer
from kvslim.errors import KvslimError


def test_longest_suffix_wins_and_latest_occurrence_among_equals():
    proposer = NgramProposer(min_n=1, max_n=3, num_tokens=2)
    # suffix [7, 8] occurs at 0 (followed by 1, 2) and at 4 (followed by 5, 6): latest wins
    assert proposer.propose([7, 8, 1, 2, 7, 8, 5, 6, 9, 7, 8]) == [5, 6]
    # the 3-token suffix [9, 7, 8] occurs earlier once, followed by 3: longer beats later
    assert proposer.propose([9, 7, 8, 3, 4, 7, 8, 5, 1, 9, 7, 8]) == [3, 4]


def test_no_match_and_too_short_propose_nothing():
    proposer = NgramProposer(min_n=2, max_n=3, num_tokens=4)
    assert proposer.propose([1, 2, 3, 4, 5]) == []
    assert proposer.propose([1, 2]) == []
    assert proposer.propose([]) == []


def test_proposals_stop_at_the_end_and_at_max_tokens():
    proposer = NgramProposer(min_n=1, max_n=2, num_tokens=5)
    assert proposer.propose([1, 2, 3, 1]) == [2, 3, 1]          # what followed, up to the end
    assert proposer.propose([1, 2, 3, 1], max_tokens=1) == [2]
    assert proposer.propose([1, 2, 3, 1], max_tokens=0) == []


def test_the_suffix_itself_is_not_a_match():
    assert NgramProposer(1, 1, 3).propose([5, 6, 7]) == []
    assert NgramProposer(1, 1, 3).propose([5, 5]) == [5]


@pytest.mark.parametrize("options, message", [
    ({"method": "hydra"}, "speculative method must be one of ngram, draft, medusa, eagle"),
    ({"method": "medusa"}, "'medusa' needs 'model', the drafter's directory"),
    ({"method": "eagle"}, "'eagle' needs 'model', the drafter's directory"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be between 1 and 16"),
    ({"acceptance": "fast"}, "speculative acceptance must be one of exact, typical"),
    ({"acceptance": "typical", "typical_alpha": 0}, "typical_alpha must be in"),
    ({"method": "draft"}, "needs 'model'"),
    ({"model": "x"}, "'ngram' takes no 'model'"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size must be at least 1"),
    ({"k": 3}, "unknown speculative option"),
])
def test_bad_options_name_the_problem(options, message):
    with pytest.raises(KvslimError, match=message):
        SpeculativeConfig.from_value(options)
