"""Speculative steps planned ahead (``core.ahead``): the grows a step sends before its
drafts are verified report only the tokens the pool can be sure of, hold slots for the worst
case, leave every decode its token before any draft, and are cut to the drafts made."""

from __future__ import annotations

from collections import Counter

from services.common.sampling_params import SamplingParams
from services.executor.core.ahead import next_grows, with_drafts
from services.executor.core.config import SchedulerConfig
from services.executor.core.plan import ScheduledBatch, ScheduledChunk
from services.executor.core.sequence import RequestKey, SeqStatus, Sequence

BS = 4


def _decoding(seq_id: int, computed: int, *, drafts: int = 0, unreported: int = 0) -> Sequence:
    """A running sequence whose chunk in this step computes its last token and ``drafts``
    drafts: ``computed`` tokens in the cache, blocks for every slot it writes now."""
    seq = Sequence(
        seq_id=seq_id,
        req_id=RequestKey(0, f"r{seq_id}"),
        index=0,
        token_ids=list(range(3, 3 + computed + 1)),
        prompt_len=computed,
        params=SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
        priority=0,
        arrival=seq_id,
        status=SeqStatus.RUNNING,
        num_computed_tokens=computed,
    )
    slots = computed + 1 + drafts
    seq.tables = [[100 * seq_id + i for i in range(-(-slots // BS))]]
    seq.num_scheduled_drafts, seq.num_unreported = drafts, unreported
    return seq


def _plan(seqs: list[Sequence], budget: int, k: int = 4, cap: int = 0):
    batch = ScheduledBatch([ScheduledChunk(s, 1 + s.num_scheduled_drafts, True) for s in seqs], [])
    refs = Counter(b for s in seqs for b in s.tables[0])
    config = SchedulerConfig(
        block_size=BS,
        max_num_batched_tokens=budget,
        speculative=True,
        num_speculative_tokens=k,
        spec_disable_by_batch_size=cap,
    )
    ahead = next_grows(batch, seqs, [], refs, config)
    assert ahead is not None
    return ahead


def test_a_grow_planned_ahead_reports_only_tokens_the_pool_is_sure_of():
    """This step verifies 2 drafts, 1 accepted draft is still unreported: the grow reports
    that one and the token after this step's first (whichever is accepted), and holds slots
    for both drafts accepted plus k more."""
    seq = _decoding(1, 10, drafts=2, unreported=1)
    ahead = _plan([seq], budget=64)
    assert ahead.grows == [(seq, 1 + 4)]
    assert ahead.counts == [(1 + 1, 2 + 4, 1)]  # (verified, lookahead, reported)
    assert ahead.held == [10 + 1 - 1]  # the pool's tokens once this step's grow is applied
    # Slots 0..10+1+2 are held; the worst case writes up to 10+1+2+1+4.
    assert ahead.grow_blocks == [-(-(10 + 1 + 2 + 1 + 4) // BS) - len(seq.tables[0])]


def test_every_decode_gets_its_token_before_any_draft_is_planned():
    seqs = [_decoding(i, 8) for i in range(1, 7)]
    ahead = _plan(seqs, budget=10)
    assert [k for _, k in ahead.grows] == [5, 1, 1, 1, 1, 1]
    assert ahead.budget == 0


def test_no_room_is_held_for_drafts_a_sequence_may_not_output_or_a_large_batch_skips():
    near_end = _decoding(1, 8)
    near_end.params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # 1 output, 2 after this step: its next step outputs 2 more at most, one a draft
    assert [k for _, k in _plan([near_end, _decoding(2, 8)], budget=64).grows] == [2, 5]
    seqs = [_decoding(i, 8, drafts=2, unreported=1) for i in range(1, 4)]
    off = _plan(seqs, budget=64, cap=3)
    assert [k for _, k in off.grows] == [1, 1, 1]
    assert off.counts == [(1 + 1, 2, 1)] * 3  # still reports, and holds this step's drafts
    assert [k for _, k in _plan(seqs, budget=64, cap=4).grows] == [5, 5, 5]


def test_a_sequence_whose_drafts_may_all_be_rejected_is_not_counted_as_finishing():
    """``max_tokens`` 5, 3 outputs, 3 drafts verified now: it reaches 5 only if a draft is
    accepted, so it still gets a grow and keeps its seat; with 5 outputs at least after
    this step, whatever is accepted, it leaves its seat to an admission."""
    seq = _decoding(1, 10, drafts=3)
    seq.params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    seq.prompt_len = 8  # 3 outputs: 4 after this step at least, 7 at most
    ahead = _plan([seq], budget=64)
    assert len(ahead.grows) == 1 and ahead.num_finishing == 0
    seq.prompt_len = 7  # 4 outputs: 5 after this step at least
    ahead = _plan([seq], budget=64)
    assert ahead.grows == [] and ahead.num_finishing == 1


def test_chunks_granted_ahead_are_cut_to_the_drafts_made():
    made, none, prompt = _decoding(1, 8), _decoding(2, 8), _decoding(3, 8)
    made.num_planned_drafts, none.num_planned_drafts = 2, 0
    prompt.token_ids += [7, 7, 7]  # a prefill chunk of 3 is left as granted
    chunks = [ScheduledChunk(made, 5, True), ScheduledChunk(none, 5, True)]
    chunks.append(ScheduledChunk(prompt, 3, False))
    got = with_drafts(chunks)
    assert [(c.num_new_tokens, c.need_logits) for c in got] == [(3, True), (1, True), (3, False)]
    assert (made.num_scheduled_drafts, none.num_scheduled_drafts) == (2, 0)
