"""Per-sequence back-off: low acceptance over a window pauses proposals, the pause doubles
while acceptance stays low, and a good window resets it."""
from kvslim.engine.sampling_params import SamplingParams
from kvslim.engine.sequence import Sequence
from kvslim.engine.speculative.config import SpeculativeConfig
from kvslim.engine.speculative.decoder import SpeculativeDecoder


def _generating() -> Sequence:
    seq = Sequence("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=1000),
                   block_size=4)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def proposed(dec: SpeculativeDecoder, seq: Sequence) -> list[int]:
    """The tokens last proposed for `seq` (left for the scheduler to take)."""
    return dec.proposals[seq.seq_id][0]


def _steps_until_proposal(dec: SpeculativeDecoder, seq: Sequence) -> int:
    """Steps without drafts before the next proposal."""
    for paused in range(1000):
        dec.propose([seq])
        if dec.proposals.get(seq.seq_id, ([], None))[0]:
            return paused
    raise AssertionError("never proposed again")


def test_pauses_double_while_acceptance_stays_low_and_reset_after_a_good_window():
    dec = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=2, backoff_acceptance=0.5,
                                               backoff_window=2, backoff_steps=3))
    seq = _generating()
    assert _steps_until_proposal(dec, seq) == 0
    pauses = []
    for _ in range(3):                               # three windows with nothing accepted
        dec.record(seq, proposed(dec, seq), ["target's own token"])
        pauses.append(_steps_until_proposal(dec, seq))
    assert pauses == [3, 6, 12]
    dec.record(seq, proposed(dec, seq), ["draft", "draft", "own"])   # all accepted
    assert _steps_until_proposal(dec, seq) == 0
    dec.record(seq, proposed(dec, seq), ["own"])
    assert _steps_until_proposal(dec, seq) == 3      # back to the first pause
    assert dec.stats.num_draft_tokens == 10 and dec.stats.num_accepted_tokens == 2


def test_no_back_off_when_the_threshold_is_zero():
    dec = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=2, backoff_window=2))
    seq = _generating()
    for _ in range(4):
        assert _steps_until_proposal(dec, seq) == 0
        dec.record(seq, proposed(dec, seq), ["own"])


def test_new_sequences_inherit_the_engine_wide_back_off():
    dec = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=2, backoff_acceptance=0.5,
                                               backoff_window=2, backoff_steps=3))
    first = _generating()
    assert _steps_until_proposal(dec, first) == 0
    dec.record(first, proposed(dec, first), ["own"])          # a window with nothing accepted
    late = _generating()
    assert _steps_until_proposal(dec, late) == 3               # waits without probing first
    dec.record(late, proposed(dec, late), ["draft", "draft", "own"])   # engine-wide recovers
    fresh = _generating()
    assert _steps_until_proposal(dec, fresh) == 0
