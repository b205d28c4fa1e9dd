"""Scheduler tests over the real ``Engine`` with fake workers (tests/engine_harness.py): greedy
equivalence with plain decoding, continuous batching, KV pressure and preemption, stop
conditions, metrics, several workers of each kind, and workers dying mid-run."""

from __future__ import annotations

import random

import pytest
from engine_harness import (  # noqa: F401
    MIXED,
    FakeWorker,
    Harness,
    V,
    add_requests,
    assert_matches_reference,
    build,
    default_wrong,
    expected_limit,
    make_seq,
    prompt_for,
    reference,
    roundtrip,
    true_logprob,
    true_next,
)

from specray.scheduler.block_manager import BlockManager
from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.scheduler.messages import StepResult
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.scheduler import Scheduler
from specray.scheduler.sequence import Sequence
from specray.scheduler.step import StepOutcome, Verdict, verdicts
from specray.scheduler.token_logprob import TokenLogprob

# -- (a) greedy equivalence ----------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 2, 4, 7])
def test_outputs_equal_plain_greedy_decoding(k):
    eng = build(k=k)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    c, st = eng.counts, eng.sched.stats
    if k:
        assert 0 < c.accepted < c.drafted     # both acceptances and rejections happened
        assert st.num_steps < sum(len(t) for t, _ in ref.values())
    else:
        assert c.drafted == 0 and c.draft_calls == 0
    assert st.num_preemptions == 0


def test_no_proposer_plain_decoding():
    eng = build(k=4, use_proposer=False, draft_blocks=None)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.num_speculative_tokens == 0 and eng.counts.draft_calls == 0
    assert eng.sched.stats.num_emitted_tokens == eng.sched.stats.num_seq_steps
    assert sum(len(t) for t, _ in ref.values()) == eng.sched.stats.num_emitted_tokens


def test_proposer_without_draft_pool_ngram_style():
    eng = build(k=3, draft_blocks=None)
    assert eng.sched.draft_pools == [] and eng.sched.num_draft_ranks == 1
    ref = add_requests(eng, MIXED[:10])
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.counts.accepted > 0


@pytest.mark.parametrize("with_pool", [True, False])
def test_proposer_may_propose_fewer_than_planned(with_pool):
    eng = build(k=4, draft_blocks=1000 if with_pool else None)
    eng.shorten = lambda sid, pos, k_i: (sid + pos) % (k_i + 1)
    ref = add_requests(eng, MIXED)
    eng.run()
    assert_matches_reference(eng, ref)
    st, c = eng.sched.stats, eng.counts
    assert st.num_draft_tokens == c.drafted and st.num_accepted_tokens == c.accepted > 0


def test_a_perfect_draft_emits_k_plus_one_per_step():
    eng = build(k=4)
    eng.draft_wrong = lambda sid, pos: False
    ref = add_requests(eng, [(1, 5, 21)])
    eng.run()
    assert_matches_reference(eng, ref)
    st = eng.sched.stats
    # 21 tokens = 4 steps of 5 plus one step where k_i = remaining - 1 = 0
    assert st.num_steps == 5 and st.num_emitted_tokens == 21
    assert st.num_draft_tokens == 16 == st.num_accepted_tokens


# -- (b) continuous batching ---------------------------------------------------------------

def test_requests_added_between_steps_join_running_ones():
    eng = build(k=3)
    eng.keep_steps = True
    ref = add_requests(eng, [(1, 4, 40), (2, 9, 40), (3, 2, 40)])
    joined = []
    next_id = 4
    while eng.sched.has_work:
        assert eng.step()
        if next_id <= 12 and len(eng.steps) % 2 == 1:
            ref |= add_requests(eng, [(next_id, 1 + next_id % 6, 5 + 3 * next_id)])
            joined.append((next_id, len(eng.steps)))
            next_id += 1
    assert_matches_reference(eng, ref)
    for sid, after in joined:
        nxt = eng.steps[after]             # the very next step
        t = nxt.target_plans[0]
        ids = t.seq_ids
        assert ids[-1] == sid              # joins at the end of the batch ...
        assert len(ids) > 1                # ... next to sequences already running
        assert t.num_computed[-1] == 0 and t.num_new[-1] == len(prompt_for(sid, 1 + sid % 6))
    assert max(len(s.seqs) for s in eng.steps) >= 5


def test_max_num_seqs_and_token_budget_limit_admission():
    eng = build(k=2, max_num_seqs=3, max_num_batched_tokens=20)
    eng.keep_steps = True
    ref = add_requests(eng, [(i, 8, 6) for i in range(1, 9)])
    eng.run()
    assert_matches_reference(eng, ref)
    assert max(len(s.seqs) for s in eng.steps) == 3
    # first step: two 8-token prompts fit the 20-token budget, a third gets the 4 left (a chunk)
    assert eng.steps[0].target_plans[0].seq_ids == [1, 2, 3]
    assert eng.steps[0].target_plans[0].num_new == [8, 8, 4]
    for s in eng.steps:
        assert sum(s.target_plans[0].num_new) <= 20


def test_a_prompt_over_the_token_budget_runs_whole_alone_and_in_chunks_beside_others():
    eng = build(k=2, max_num_batched_tokens=4)
    eng.keep_steps = True
    ref = add_requests(eng, [(1, 10, 30), (2, 10, 3)])
    eng.run()
    assert_matches_reference(eng, ref)
    plans = [s.target_plans[0] for s in eng.steps]
    assert (plans[0].seq_ids, plans[0].num_new) == ([1], [10])         # alone: nothing to keep decoding
    # beside sequence 1, which decodes every step, sequence 2 is fed what the budget leaves
    fed_2 = [(p.num_new[1], p.proposal_lens[1]) for p in plans[1:] if p.seq_ids[:2] == [1, 2]]
    assert sum(n for n, _ in fed_2) >= 10 and all(n <= 3 for n, _ in fed_2)
    assert [x for _, x in fed_2[:3]] == [0, 0, 0]                     # chunks propose nothing
    assert all(sum(p.num_new) <= 4 for p in plans[1:])
    assert eng.num_chunks >= 3


# -- (c) KV exhaustion -------------------------------------------------------------------------

KV_SPECS = [(i, 5 + (3 * i) % 16, 20 + (7 * i) % 11) for i in range(1, 11)]


def run_kv(**kw) -> Harness:
    eng = build(k=4, max_model_len=64, **kw)
    ref = add_requests(eng, KV_SPECS)
    eng.run()
    assert_matches_reference(eng, ref)
    return eng


def test_tiny_target_pool_preempts_and_still_matches():
    ample = run_kv()
    assert ample.sched.stats.num_preemptions == 0
    tiny = run_kv(target_blocks=18)      # one sequence at full length needs 16
    st = tiny.sched.stats
    assert st.num_preemptions > 0
    assert sum(s.num_preemptions for s in tiny.finished.values()) == st.num_preemptions
    assert {s: q.output_tokens for s, q in tiny.finished.items()} == \
        {s: q.output_tokens for s, q in ample.finished.items()}
    assert st.num_steps > ample.sched.stats.num_steps


def test_tiny_draft_pool_lowers_k_without_preempting():
    ample = run_kv()
    tiny = run_kv(draft_blocks=6)
    assert tiny.sched.stats.num_preemptions == 0
    assert 0 < tiny.counts.drafted < ample.counts.drafted
    assert tiny.sched.stats.num_draft_tokens == tiny.counts.drafted


def test_tiny_pools_on_both_sides():
    eng = run_kv(target_blocks=17, draft_blocks=5)
    assert eng.sched.stats.num_preemptions > 0


@pytest.mark.parametrize("block_size,blocks", [(1, 64), (2, 33), (8, 9), (16, 5)])
def test_exhaustion_across_block_sizes(block_size, blocks):
    eng = build(k=3, max_model_len=64, block_size=block_size, target_blocks=blocks, draft_blocks=blocks)
    ref = add_requests(eng, KV_SPECS)
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.stats.num_preemptions > 0


def test_preempted_sequences_requeue_oldest_first():
    eng = build(k=2, max_model_len=64, target_blocks=18)
    ref = add_requests(eng, KV_SPECS)
    preempt_steps = 0

    def check(step):
        nonlocal preempt_steps
        preempted = [s for s in eng.sched.waiting if s.num_tokens > s.prompt_len]
        # a preempted sequence (it has output) waits ahead of never-run ones, oldest first
        assert [s.seq_id for s in list(eng.sched.waiting)[:len(preempted)]] == sorted(s.seq_id for s in preempted)
        if eng.sched.stats.num_preemptions > before[0]:
            # a step that had to preempt admits nobody
            preempt_steps += 1
            assert all(s.seq_id in running_before for s in step.seqs)
    before = [0]
    running_before: set[int] = set()
    eng.on_plan = check
    orig_step = eng.step

    def step():
        before[0] = eng.sched.stats.num_preemptions
        running_before.clear()
        running_before.update(s.seq_id for s in eng.sched.running)
        return orig_step()
    eng.step = step
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.stats.num_preemptions > 0 and preempt_steps > 0


def test_pool_too_small_for_one_request_raises():
    eng = build(k=2, max_model_len=64, target_blocks=2)
    add_requests(eng, [(1, 9, 4)])
    with pytest.raises(RuntimeError, match="KV pool too small"):
        eng.sched.schedule()


# -- (d) proposal lengths and max lengths ---------------------------------------------------------

def k_checker(eng: Harness):
    sched, k = eng.sched, eng.sched.num_speculative_tokens
    seen = []

    def check(step):
        for s in step.seqs:
            n = s.num_tokens
            assert s.proposal_len == expected_limit(sched, k, n, s.remaining), (s.seq_id, n, s.remaining)
            assert s.proposal_len <= s.remaining - 1 or s.proposal_len == 0
            assert n + s.proposal_len + 1 <= sched.max_model_len
            if s.proposal_len and sched.draft_max_model_len is not None:
                assert n + s.proposal_len <= sched.draft_max_model_len
            seen.append((n, s.remaining, s.proposal_len))
    eng.on_plan = check
    return seen


def test_proposal_length_rule_with_ample_pools():
    eng = build(k=5, max_model_len=80)
    seen = k_checker(eng)
    ref = add_requests(eng, [(i, 1 + (5 * i) % 70, 1 + (13 * i) % 30) for i in range(1, 30)])
    eng.run()
    assert_matches_reference(eng, ref)
    ks = {k for _, _, k in seen}
    assert ks == {0, 1, 2, 3, 4, 5}
    assert any(r == 1 and k == 0 for _, r, k in seen)   # the last token is never speculated


@pytest.mark.parametrize("proposer", ["draft", "ngram", "draft+suffix"])
def test_requests_with_speculation_off_propose_nothing_and_match(proposer):
    """``SamplingParams.speculation=False``: limit 0 every step, so the request is in no
    draft plan (nor suffix decoding's), verifies nothing, and decodes as plain greedy."""
    eng = build(k=4, draft_blocks=None if proposer == "ngram" else 1000,
                suffix_wrong=(lambda sid, pos: (sid + pos) % 3 == 0) if "suffix" in proposer else None)
    eng.keep_steps = True
    ref = {}
    for sid, plen, mt in MIXED:
        seq = make_seq(sid, prompt_for(sid, plen), mt, speculation=sid % 2 == 0)
        eng.sched.add(seq)
        ref[sid] = reference(seq.tokens, mt, (), eng.sched.max_model_len)
    plain = {sid for sid, _, _ in MIXED if sid % 2}
    eng.run()
    assert_matches_reference(eng, ref)
    assert all(eng.finished[sid].num_draft_tokens == 0 for sid in plain)
    assert any(eng.finished[sid].num_draft_tokens for sid in set(ref) - plain)
    for step in eng.steps:
        assert all(s.proposal_len == 0 for s in step.seqs if s.seq_id in plain)
        for d in step.draft_plans:
            assert d is None or not plain & set(d.seq_ids)
    for vs in eng.verdicts:
        assert all(v.proposed == 0 for v in vs if v.seq_id in plain)


def test_draft_max_len_turns_speculation_off():
    eng = build(k=4, max_model_len=64, draft_max_model_len=24)
    eng.keep_steps = True
    seen = k_checker(eng)
    ref = add_requests(eng, [(1, 10, 40), (2, 3, 45), (3, 20, 30), (4, 23, 5), (5, 24, 5)])
    eng.run()
    assert_matches_reference(eng, ref)
    assert any(k > 0 for _, _, k in seen)
    assert all(k == 0 for n, _, k in seen if n + 1 > 24)
    assert all(k == 0 for n, _, k in seen if n >= 21)   # n + 4 > 24 (remaining is large)
    for s in eng.steps:
        for d in s.draft_plans:
            if d is not None:
                assert all(slots <= 24 - 1 for slots in d.num_slots)   # n + k_i - 1


def test_target_max_len_caps_and_finishes_with_length():
    tml = 32
    eng = build(k=4, max_model_len=tml)
    seen = k_checker(eng)
    specs = [(1, 31, 100), (2, 30, 100), (3, 29, 100), (4, 27, 100), (5, 20, 100), (6, 1, 100)]
    ref = add_requests(eng, specs)
    eng.run()
    assert_matches_reference(eng, ref)
    for sid, _, _ in specs:
        seq = eng.finished[sid]
        assert seq.num_tokens <= tml
        if seq.finish_reason == "length":
            assert seq.num_tokens == tml
    assert eng.finished[1].output_tokens == [true_next(prompt_for(1, 31))]
    assert any(k for n, _, k in seen if n == tml - 2) and all(k <= 1 for n, _, k in seen if n == tml - 2)
    assert all(k == 0 for n, _, k in seen if n == tml - 1)


@pytest.mark.parametrize("plen", [32, 33, 100])
def test_prompt_without_room_is_rejected(plen):
    eng = build(k=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.sched.add(make_seq(1, prompt_for(1, plen), 10))
    assert not eng.sched.has_work


# -- (e) stop tokens -----------------------------------------------------------------------------

def find_seq_with_fresh_token_at(index: int, plen: int = 4, length: int = 12):
    for sid in range(1, 500):
        out, _ = reference(prompt_for(sid, plen), length)
        if out[index] not in out[:index] and out[index] not in prompt_for(sid, plen):
            return sid, out
    raise AssertionError("no such sequence")


@pytest.mark.parametrize("index", [0, 2, 4, 7])
def test_stop_token_mid_step_discards_the_rest(index):
    sid, out = find_seq_with_fresh_token_at(index)
    stop = out[index]
    eng = build(k=4)
    eng.draft_wrong = lambda s, p: False         # every step emits k + 1 = 5 tokens
    eng.keep_steps = True
    eng.sched.add(make_seq(sid, prompt_for(sid, 4), 50, stop_ids=[stop]))
    eng.sched.add(make_seq(sid + 1000, prompt_for(sid + 1000, 4), 30))
    eng.run()
    seq = eng.finished[sid]
    assert seq.finish_reason == "stop"
    assert seq.output_tokens == out[:index + 1]
    assert seq.tokens[-1] == stop
    stop_step = index // 5                       # steps emit 5 tokens each
    assert eng.counts.emitted == eng.sched.stats.num_emitted_tokens
    # the step where it stopped had emitted all 5, the sequence kept index % 5 + 1
    [verdict] = [v for v in eng.verdicts[stop_step] if v.seq_id == sid]
    emitted = list(verdict.tokens)
    assert len(emitted) == 5 and emitted == out[5 * stop_step:5 * stop_step + 5]
    assert seq.output_tokens == out[:5 * stop_step] + emitted[:index % 5 + 1]
    # from the next step on it is gone, and the workers were told to free it
    later = eng.steps[stop_step + 1]
    assert sid not in later.target_plans[0].seq_ids
    assert sid in later.target_plans[0].free_seq_ids
    assert later.draft_plans[0] is not None and sid in later.draft_plans[0].free_seq_ids
    assert sid not in eng.target.cache and sid not in eng.draft.cache
    assert not eng.sched.target_pools[0].has(sid) and not eng.sched.draft_pools[0].has(sid)


@pytest.mark.parametrize("target_blocks", [1000, 26])
def test_logprobs_follow_the_tokens_through_stops_and_preemption(target_blocks):
    """A sequence that asked keeps one logprob per output token: the one its emitting
    position had, whether a stop cut the step short or a preemption recomputed it; the
    others keep none and the plans ask for none where nobody asked."""
    eng = build(k=4, target_blocks=target_blocks)
    eng.keep_steps = True
    stop = 17
    ref = {}
    for sid, plen, mt in MIXED:
        prompt = prompt_for(sid, plen)
        asked = {0: None, 1: 0, 2: 3}[sid % 3]
        eng.sched.add(make_seq(sid, prompt, mt, stop_ids=[stop], logprobs=asked))
        ref[sid] = (reference(prompt, mt, [stop], eng.sched.max_model_len), asked)
    eng.run()
    assert_matches_reference(eng, {sid: r for sid, (r, _) in ref.items()})
    if target_blocks < 1000:
        assert eng.sched.stats.num_preemptions > 0
    assert any(r == "stop" for (_, r), _ in ref.values())
    for sid, ((tokens, _), asked) in ref.items():
        seq = eng.finished[sid]
        if asked is None:
            assert seq.logprobs is None
            continue
        assert seq.logprobs == [true_logprob(seq.tokens[:seq.prompt_len + j], asked) for j in range(len(tokens))]
    for step in eng.steps:
        plan = step.target_plans[0]
        want = [-1 if s.params.logprobs is None else s.params.logprobs for s in step.target_seqs[0]]
        assert plan.logprobs == (want if any(x >= 0 for x in want) else [])


def test_verdicts_carry_logprobs_and_refuse_a_result_that_ignores_the_plan():
    eng = build(k=2)
    eng.sched.add(make_seq(1, prompt_for(1, 3), 10, logprobs=1))
    eng.sched.add(make_seq(2, prompt_for(2, 3), 10))
    plan = eng.sched.schedule().target_plans[0]
    assert plan.logprobs == [1, -1]
    ok = dict(step_id=plan.step_id, seq_ids=[1, 2], proposed=[2, 0], num_emitted=[2, 1], token_ids=[5, 6, 7])
    v1, v2 = verdicts(plan, StepResult(**ok, num_top=[1, -1], logprobs=[-0.5, -1.0], top_ids=[5, 8],
                                       top_logprobs=[-0.5, -0.25]))
    assert v1.logprobs == (TokenLogprob(5, -0.5, [(5, -0.5)]), TokenLogprob(6, -1.0, [(8, -0.25)]))
    assert v2.logprobs is None
    with pytest.raises(ValueError, match="asked for 1 logprobs, the result gives -1"):
        verdicts(plan, StepResult(**ok))
    with pytest.raises(ValueError, match="asked for -1 logprobs, the result gives 0"):
        verdicts(plan, StepResult(**ok, num_top=[1, 0], logprobs=[-0.5, -1.0, -2.0], top_ids=[5, 8],
                                  top_logprobs=[-0.5, -0.25]))
    with pytest.raises(ValueError, match="asked for 1 logprobs, the result gives 2"):
        verdicts(plan, StepResult(**ok, num_top=[2, -1], logprobs=[-0.5, -1.0], top_ids=[5, 8, 1, 2],
                                  top_logprobs=[-0.5, -0.25, -1.0, -1.0]))


def test_update_returns_only_tokens_up_to_the_stop():
    sid, out = find_seq_with_fresh_token_at(1)
    eng = build(k=4)
    eng.draft_wrong = lambda s, p: False
    eng.sched.add(make_seq(sid, prompt_for(sid, 4), 50, stop_ids=[out[1]]))
    step = eng.sched.schedule()
    outcome = eng.run_step(step)
    [verdict] = outcome.verdicts
    assert (verdict.proposed, verdict.accepted, len(verdict.tokens)) == (4, 4, 5)
    [(seq, appended)] = eng.sched.update(outcome)
    assert appended == out[:2] and seq.finished and seq.finish_reason == "stop"
    assert eng.sched.stats.num_emitted_tokens == 5 and eng.sched.stats.num_accepted_tokens == 4
    assert not eng.sched.has_work


def test_stop_ids_in_the_prompt_do_not_stop_and_late_stops_do_not_matter():
    prompt = prompt_for(3, 6)
    out, _ = reference(prompt, 8)
    never = [t for t in range(V) if t not in out][:3]
    eng = build(k=3)
    eng.sched.add(make_seq(3, prompt, 8, stop_ids=[t for t in prompt if t not in out] + never))
    eng.run()
    assert eng.finished[3].output_tokens == out and eng.finished[3].finish_reason == "length"


def test_stop_token_wins_over_length_on_the_last_token():
    sid, out = find_seq_with_fresh_token_at(5)
    eng = build(k=4)
    eng.sched.add(make_seq(sid, prompt_for(sid, 4), 6, stop_ids=[out[5]]))
    eng.run()
    assert eng.finished[sid].finish_reason == "stop" and eng.finished[sid].output_tokens == out[:6]


# -- (f) metrics -------------------------------------------------------------------------------

def test_stats_match_independent_counts_and_design_definitions():
    eng = build(k=4, max_model_len=64, target_blocks=20)
    ref = add_requests(eng, KV_SPECS, stop_ids=[5, 17])
    eng.run()
    assert_matches_reference(eng, ref)
    st, c = eng.sched.stats, eng.counts
    assert st.num_draft_tokens == c.drafted
    assert st.num_accepted_tokens == c.accepted
    assert st.num_emitted_tokens == c.emitted
    assert st.num_seq_steps == c.seq_steps
    assert st.num_steps == c.steps
    assert c.emitted == c.accepted + c.seq_steps
    assert sum(s.num_draft_tokens for s in eng.finished.values()) == c.drafted
    assert sum(s.num_accepted_tokens for s in eng.finished.values()) == c.accepted
    d = st.as_dict()
    assert d["acceptance_rate"] == pytest.approx(c.accepted / c.drafted)
    assert d["mean_accepted_length"] == pytest.approx(c.emitted / c.seq_steps)
    assert d["system_efficiency"] == pytest.approx(c.emitted / (c.seq_steps * (4 + 1)))
    assert 0 < d["acceptance_rate"] < 1 and 1 < d["mean_accepted_length"] < 5
    for key in ("num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "num_steps",
                "num_seq_steps", "num_preemptions", "num_requests_finished"):
        assert d[key] == getattr(st, key)
    assert d["num_requests_finished"] == len(ref)


def test_stats_when_nothing_ran():
    d = build(k=3).sched.stats.as_dict()
    assert d["acceptance_rate"] == d["mean_accepted_length"] == d["system_efficiency"] == 0.0
    assert d["tokens_per_s"] == 0.0


def test_verdicts_refuse_a_result_for_another_batch_or_too_many_accepts():
    eng = build(k=2)
    add_requests(eng, [(1, 3, 10), (2, 3, 10)])
    step = eng.sched.schedule()
    plan = step.target_plans[0]
    assert plan.proposal_lens == [2, 2]

    def result(seq_ids, proposed, emitted):
        return StepResult(step_id=step.step_id, seq_ids=seq_ids, proposed=proposed, num_emitted=emitted,
                          token_ids=[0] * sum(emitted))

    with pytest.raises(ValueError, match="answers sequences"):
        verdicts(plan, result([2, 1], [0, 0], [1, 1]))
    with pytest.raises(ValueError, match="answers sequences"):
        verdicts(plan, result([1], [0], [1]))
    # 2 proposed: 4 emitted is too many (3 = 2 accepted + the target's own token is not)
    with pytest.raises(ValueError, match="num_emitted"):
        verdicts(plan, result([1, 2], [2, 2], [3, 4]))
    with pytest.raises(ValueError, match="verified 3 proposals, 2 were sent"):
        verdicts(plan, result([1, 2], [3, 2], [1, 1]))
    assert verdicts(plan, StepResult(step_id=step.step_id, seq_ids=[1, 2], proposed=[2, 1], num_emitted=[3, 1],
                                     token_ids=[5, 6, 7, 8])) == [Verdict(1, 2, 2, (5, 6, 7)), Verdict(2, 1, 0, (8,))]


def test_update_refuses_verdicts_for_other_sequences_or_missing_ones():
    eng = build(k=2)
    add_requests(eng, [(1, 3, 10), (2, 3, 10)])
    step = eng.sched.schedule()
    with pytest.raises(ValueError, match="not in step"):
        eng.sched.update(StepOutcome(step, [Verdict(7, 0, 0, (1,))]))
    with pytest.raises(ValueError, match="not in step"):
        eng.sched.update(StepOutcome(step, [Verdict(1, 0, 0, (1,)), Verdict(1, 0, 0, (1,))]))
    step = eng.sched.schedule()
    with pytest.raises(ValueError, match="no verdict for sequences"):
        eng.sched.update(StepOutcome(step, [Verdict(1, 0, 0, (1,))]))


# -- (g) randomized property test -----------------------------------------------------------------

@pytest.mark.parametrize("scenario", range(40))
def test_random_scenarios(scenario):
    rng = random.Random(1000 + scenario)
    k = rng.choice([0, 1, 2, 3, 4, 6])
    block_size = rng.choice([1, 2, 3, 4, 8])
    tml = rng.randrange(8, 72)
    dml = rng.choice([None, None, rng.randrange(4, tml + 8)])
    need = -(-(tml - 1) // block_size)                    # one sequence at full length
    target_blocks = rng.choice([need, need + 1, need + rng.randrange(0, 3 * need), 10 * need])
    draft_blocks = rng.choice([None, 1, rng.randrange(1, 2 * need + 2), 10 * need])
    eng = build(k=k, max_model_len=tml, draft_max_model_len=dml, block_size=block_size, target_blocks=target_blocks,
                draft_blocks=draft_blocks, max_num_seqs=rng.randrange(1, 8),
                max_num_batched_tokens=rng.randrange(1, 120))
    wrong_mod = rng.randrange(1, 6)
    eng.draft_wrong = lambda sid, pos: (sid * 5 + pos * 3) % 7 < wrong_mod - 1
    if rng.random() < 0.3:
        eng.shorten = lambda sid, pos, k_i: (3 * sid + pos) % (k_i + 1)
    stop_ids = rng.sample(range(V), rng.randrange(0, 4))
    max_seqs = eng.sched.cache.max_num_seqs
    max_batched = eng.sched.cache.max_num_batched_tokens

    total = rng.randrange(1, 16)
    ref: dict[int, tuple[list[int], str]] = {}
    params: dict[int, int] = {}
    next_id = 1

    admitted_now: set[int] = set()

    def check(step):
        assert len(step.seqs) <= max_seqs
        # fed tokens respect the budget once more than a lone first request is admitted
        admitted = [i for i, s in enumerate(step.seqs) if s.seq_id in admitted_now]
        if admitted and (admitted[0] > 0 or len(admitted) > 1):
            assert sum(sum(p.num_new) for p in step.target_plans if p is not None) <= max_batched
        for i, s in enumerate(step.seqs):
            assert (i in admitted) == (i >= len(step.seqs) - len(admitted))   # newcomers come last
            # a short pool only ever turns speculation off, never changes the rule otherwise
            assert s.proposal_len in (0, expected_limit(eng.sched, k, s.num_tokens, s.remaining))
    eng.on_plan = check

    steps = 0
    while next_id <= total or eng.sched.has_work:
        while next_id <= total and (not eng.sched.has_work or rng.random() < 0.3):
            plen = rng.randrange(1, tml)
            mt = rng.randrange(1, 40)
            ref |= add_requests(eng, [(next_id, plen, mt)], stop_ids)
            params[next_id] = mt
            next_id += 1
        admitted_now = {s.seq_id for s in eng.sched.waiting}
        assert eng.step()
        steps += 1
        assert steps < 5000
        for s in eng.sched.running:
            assert s.output_len <= params[s.seq_id] and s.num_tokens <= tml
    assert_matches_reference(eng, ref)
    for sid, seq in eng.finished.items():
        assert 1 <= seq.output_len <= params[sid]
        assert seq.num_tokens <= tml
    assert len(eng.finished) == total


# -- smaller pieces ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make,field_name", [
    (lambda: SpeculationConfig(num_speculative_tokens=-1), "num_speculative_tokens"),
    (lambda: SpeculationConfig(num_speculative_tokens=0), "num_speculative_tokens"),
    (lambda: Scheduler(CacheConfig(), SpeculationConfig(), 1, BlockManager(4, 4)), "max_model_len"),
    (lambda: CacheConfig(max_num_seqs=0), "max_num_seqs"),
    (lambda: CacheConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
])
def test_scheduler_configs_validate(make, field_name):
    with pytest.raises(ValueError, match=field_name):
        make()


def test_no_proposer_means_no_speculative_tokens():
    spec = SpeculationConfig(proposer="none", num_speculative_tokens=4, overlap=True)
    assert spec.num_speculative_tokens == 0 and not spec.overlap
    assert not SpeculationConfig(proposer="ngram", overlap=True).overlap


@pytest.mark.parametrize("n,remaining,dml,expect", [
    (10, 100, None, 4),
    (10, 5, None, 4),
    (10, 4, None, 3),      # the bonus token must fit in max_tokens
    (10, 1, None, 0),
    (58, 100, None, 4),    # 58 + 4 + 1 = 63 <= 64
    (60, 100, None, 3),    # capped by max_model_len
    (62, 100, None, 1),
    (63, 100, None, 0),
    (20, 100, 24, 4),      # 20 + 4 = 24: the draft still sees every position
    (21, 100, 24, 0),      # 21 + 4 > 24: off, not shortened
    (22, 2, 24, 1),        # 22 + 1 <= 24
    (23, 2, 24, 1),
    (24, 2, 24, 0),
])
def test_proposal_limit_table(n, remaining, dml, expect):
    eng = build(k=4, max_model_len=64, draft_max_model_len=dml)
    seq = make_seq(1, prompt_for(1, n), remaining)
    assert eng.sched.proposal_limit(seq) == expect == expected_limit(eng.sched, 4, n, remaining)


def test_plans_carry_sampling_knobs_and_seeds():
    eng = build(k=2)
    seq = Sequence(seq_id=9, request_id="r", prompt_len=3, tokens=[1, 2, 3], seed=2**63 - 1,
                   params=SamplingParams(max_tokens=5, temperature=0.8, top_k=7, top_p=0.5))
    eng.sched.add(seq)
    eng.sched.add(make_seq(10, [4, 5], 5))
    step = eng.sched.schedule()
    target, draft = step.target_plans[0], step.draft_plans[0]
    for plan in (target, draft):
        plan = roundtrip(plan)
        assert plan.seq_ids == [9, 10]
        assert plan.temperature == [0.8, 0.0] and plan.top_k == [7, 0] and plan.top_p == [0.5, 1.0]
        assert plan.seeds == [2**63 - 1, 10]
    assert target.token_ids == [1, 2, 3, 4, 5] and target.num_new == [3, 2]
    assert target.num_slots == [5, 4] and draft.num_slots == [4, 3]


def test_abort_all_releases_everything():
    eng = build(k=3, max_model_len=64, target_blocks=18)
    add_requests(eng, KV_SPECS)
    for _ in range(3):
        eng.step()
    running = [s.seq_id for s in eng.sched.running]
    assert running and eng.sched.waiting
    failed = eng.sched.abort_all("error")
    assert sorted(s.seq_id for s in failed) == sorted(set(sid for sid, _, _ in KV_SPECS) - set(eng.finished))
    assert all(s.finished and s.finish_reason == "error" for s in failed)
    assert not eng.sched.has_work and eng.sched.schedule() is None
    for pool in eng.sched.target_pools + eng.sched.draft_pools:
        assert pool.num_free_blocks == pool.num_blocks
    assert [sorted(f) for f in eng.sched._target_frees] == [sorted(running)]
    eng.sched.check_integrity()


# -- (h) several target and draft workers ----------------------------------------------------------

MANY = [(i, 1 + (7 * i) % 37, 1 + (11 * i) % 41) for i in range(1, 41)]
KV_MANY = [(i, 5 + (3 * i) % 16, 20 + (7 * i) % 11) for i in range(1, 25)]


def assert_every_rank_worked(eng: Harness) -> None:
    assert all(w.num_seq_plans > 0 for w in eng.targets), [w.num_seq_plans for w in eng.targets]
    if eng.sched.num_draft_ranks:
        assert all(w.num_seq_plans > 0 for w in eng.drafts), [w.num_seq_plans for w in eng.drafts]
    assert {t for _, t, _ in eng.placements} == set(range(len(eng.targets)))
    assert {d for _, _, d in eng.placements} == set(range(max(eng.sched.num_draft_ranks, 1)))


def test_scheduler_takes_one_pool_or_a_list():
    cache, spec = CacheConfig(block_size=4), SpeculationConfig(num_speculative_tokens=3)
    one = BlockManager(10, 4)
    s = Scheduler(cache, spec, 64, one, BlockManager(10, 4))
    assert s.target_pools == [one] and len(s.draft_pools) == 1 and s.num_draft_ranks == 1
    pools = [BlockManager(10, 4) for _ in range(3)]
    s = Scheduler(cache, spec, 64, pools, (BlockManager(10, 4), BlockManager(10, 4)))
    assert s.target_pools == pools and len(s.draft_pools) == 2 and s.num_draft_ranks == 2
    s = Scheduler(cache, spec, 64, pools, None, num_proposers=3)       # n-gram proposers: no draft KV
    assert s.draft_pools == [] and s.num_draft_ranks == 3
    s = Scheduler(cache, SpeculationConfig(proposer="none"), 64, pools, [BlockManager(10, 4)])
    assert s.num_speculative_tokens == 0 and s.num_draft_ranks == 0
    with pytest.raises(ValueError, match="target pool"):
        Scheduler(cache, spec, 64, [])


@pytest.mark.parametrize("T,D,k", [(2, 3, 4), (3, 2, 2), (3, 3, 3), (2, 2, 0)])
def test_several_workers_equal_plain_greedy_decoding(T, D, k):
    eng = build(k=k, target_ranks=T, draft_ranks=D)
    eng.probs = True
    eng.check_balance = True           # ample pools: every newcomer goes to the least loaded ranks
    ref = add_requests(eng, MANY[:20])
    steps = 0
    while eng.sched.has_work:          # the rest join while the first ones run
        assert eng.step()
        steps += 1
        if steps % 2 and len(ref) < len(MANY):
            ref |= add_requests(eng, [MANY[len(ref)]])
    assert_matches_reference(eng, ref)
    assert_every_rank_worked(eng)
    c = eng.counts
    assert eng.sched.stats.num_preemptions == 0
    if k:
        assert 0 < c.accepted < c.drafted
    else:
        assert c.drafted == 0 and c.draft_calls == 0 and eng.sched.num_draft_ranks == 0


def test_several_ngram_proposers_without_draft_pools():
    eng = build(k=3, draft_blocks=None, target_ranks=2, draft_ranks=3)
    assert eng.sched.draft_pools == [] and eng.sched.num_draft_ranks == 3
    eng.shorten = lambda sid, pos, k_i: (sid + pos) % (k_i + 1)
    ref = add_requests(eng, MANY[:18])
    eng.run()
    assert_matches_reference(eng, ref)
    assert_every_rank_worked(eng)
    assert eng.counts.accepted > 0


@pytest.mark.parametrize("T,D,tblocks,dblocks,bs", [
    (2, 3, 18, 1000, 4),               # one sequence at full length needs 16 blocks
    (3, 2, 17, 6, 4),
    (2, 2, 17, 5, 4),
    (3, 3, [17, 20, 40], [5, 8, 1000], 4),
    (2, 3, 64, 64, 1),
    (3, 2, 9, 9, 8),
])
def test_several_workers_under_kv_pressure_preempt_and_still_match(T, D, tblocks, dblocks, bs):
    eng = build(k=4, max_model_len=64, block_size=bs, target_ranks=T, draft_ranks=D,
                target_blocks=tblocks, draft_blocks=dblocks)
    eng.probs = True
    ref = add_requests(eng, KV_MANY, stop_ids=[5])
    eng.run()                          # check_integrity and the per-rank mirror checks run every step
    assert_matches_reference(eng, ref)
    st = eng.sched.stats
    assert st.num_preemptions > 0 and len(eng.preemptions) == st.num_preemptions
    assert sum(s.num_preemptions for s in eng.finished.values()) == st.num_preemptions
    assert_every_rank_worked(eng)


def test_running_sequences_never_change_rank_and_preempted_ones_may():
    eng = build(k=3, max_model_len=64, target_ranks=3, draft_ranks=2, target_blocks=18, draft_blocks=12)
    seen: dict[int, list[tuple[int, int, int]]] = {}     # seq -> (step, target, draft) per step it ran

    def record(step):
        for s in step.seqs:
            seen.setdefault(s.seq_id, []).append((step.step_id, s.target_rank, s.draft_rank))
    eng.on_plan = record
    ref = add_requests(eng, KV_MANY)
    eng.run()
    assert_matches_reference(eng, ref)
    preempted_at = {}
    for p in eng.preemptions:
        preempted_at.setdefault(p.seq_id, []).append(p.step_id)
    moved = 0
    for sid, runs in seen.items():
        for (s0, t0, d0), (s1, t1, d1) in zip(runs, runs[1:]):
            if any(s0 < p <= s1 for p in preempted_at.get(sid, [])):
                moved += (t0, d0) != (t1, d1)
            else:
                assert (t0, d0) == (t1, d1), f"running seq {sid} moved between steps {s0} and {s1}"
                assert s1 == s0 + 1, f"running seq {sid} skipped a step"
    assert preempted_at and moved > 0      # re-admission places a preempted sequence afresh


@pytest.mark.parametrize("T,D,n,length", [(2, 2, 8, 6), (3, 2, 7, 5), (2, 3, 9, 11), (3, 3, 3, 4), (3, 3, 10, 1)])
def test_equal_requests_spread_evenly_over_empty_ranks(T, D, n, length):
    eng = build(k=2, target_ranks=T, draft_ranks=D)
    add_requests(eng, [(i, length, 5) for i in range(1, n + 1)])
    step = eng.sched.schedule()
    assert len(step.seqs) == n
    t_load = [sum(s.num_tokens for s in seqs) for seqs in step.target_seqs]
    d_load = [sum(s.num_tokens for s in step.seqs if s.draft_rank == d) for d in range(D)]
    assert max(t_load) - min(t_load) <= length and max(d_load) - min(d_load) <= length
    assert sum(t_load) == sum(d_load) == n * length
    if n >= max(T, D):
        assert all(step.target_plans) and all(step.draft_plans)
    # round robin, since every load ties or trails by one request
    assert [s.target_rank for s in step.seqs] == [i % T for i in range(n)]
    assert [s.draft_rank for s in step.seqs] == [i % D for i in range(n)]


def test_placement_follows_token_load_not_request_count():
    eng = build(k=2, target_ranks=2, draft_ranks=2)
    eng.check_balance = True
    add_requests(eng, [(1, 30, 50), (2, 4, 50), (3, 4, 50), (4, 4, 50), (5, 4, 50)])
    eng.step()
    # 30 tokens on rank 0 outweigh four 4-token requests on rank 1
    assert [s.target_rank for s in eng.sched.running] == [0, 1, 1, 1, 1]
    assert [s.draft_rank for s in eng.sched.running] == [0, 1, 1, 1, 1]
    add_requests(eng, [(6, 4, 50)])
    eng.step()
    assert (eng.sched.running[-1].target_rank, eng.sched.running[-1].draft_rank) == (1, 1)   # 31 vs 20 tokens


def test_placement_prefers_a_target_pool_the_request_fits_in():
    eng = build(k=0, max_model_len=64, target_ranks=2, target_blocks=[3, 1000], draft_blocks=None)
    add_requests(eng, [(1, 20, 2)])       # 5 blocks: only rank 1 can hold it, though rank 0 is idle
    step = eng.sched.schedule()
    assert [s.target_rank for s in step.seqs] == [1] and step.target_plans[0] is None
    eng.sched.abort_all("test")
    eng = build(k=0, max_model_len=64, target_ranks=2, target_blocks=[3, 1000], draft_blocks=None)
    add_requests(eng, [(1, 8, 2)])        # 2 blocks: fits the least loaded rank 0
    assert [s.target_rank for s in eng.sched.schedule().seqs] == [0]


def test_preemption_under_pressure_on_one_rank_takes_only_that_ranks_sequences():
    # rank 0 is tight (one sequence at full length needs 16 blocks), rank 1 is ample
    eng = build(k=2, max_model_len=64, target_ranks=2, draft_ranks=2, target_blocks=[18, 1000])
    ref = add_requests(eng, KV_MANY)
    eng.run()        # the engine checks every step that each rank's victims are its newest sequences
    assert_matches_reference(eng, ref)
    assert eng.preemptions and all(p.target_rank == 0 for p in eng.preemptions)
    # the victims were not the newest running sequences overall: newer ones on rank 1 kept running
    assert any(p.newer_elsewhere for p in eng.preemptions)
    assert_every_rank_worked(eng)


def test_preemption_victim_is_the_newest_unscheduled_sequence_of_the_same_rank():
    # 4 blocks of 4 tokens per target rank; four 4-token requests, two per rank, all growing
    eng = build(k=0, max_model_len=64, target_ranks=2, target_blocks=4, draft_blocks=None)
    add_requests(eng, [(1, 4, 30), (2, 4, 30), (3, 4, 30), (4, 4, 30)])
    while not eng.preemptions:
        assert eng.step()
    assert not eng.finished
    # rank 0 holds 1 and 3, rank 1 holds 2 and 4: each rank gives up its own newest
    assert sorted((p.seq_id, p.target_rank) for p in eng.preemptions) == [(3, 0), (4, 1)]
    assert [(s.seq_id, s.target_rank) for s in eng.sched.running] == [(1, 0), (2, 1)]


def test_frees_reach_the_ranks_that_held_the_sequence():
    eng = build(k=2, max_model_len=128, target_ranks=3, draft_ranks=2)
    eng.keep_steps = True
    finished_in: list[list[Sequence]] = []

    def record(step):                       # runs after update: these finished in this very step
        finished_in.append([s for s in step.seqs if s.finished])
    eng.on_step = record
    ref = add_requests(eng, [(i, 3 + i % 5, 2 + (5 * i) % 23) for i in range(1, 19)])
    eng.run()
    assert_matches_reference(eng, ref)
    assert sum(map(len, finished_in)) == len(ref)
    free_only = 0
    for i in range(len(eng.steps) - 1):
        nxt = eng.steps[i + 1]
        for s in finished_in[i]:
            for r, plan in enumerate(nxt.target_plans):
                frees = plan.free_seq_ids if plan is not None else []
                assert (s.seq_id in frees) == (r == s.target_rank), (s.seq_id, r)
            for d, plan in enumerate(nxt.draft_plans):
                frees = plan.free_seq_ids if plan is not None else []
                assert (s.seq_id in frees) == (d == s.draft_rank), (s.seq_id, d)
        for plan in nxt.target_plans + nxt.draft_plans:
            if plan is not None and not plan.seq_ids:
                assert plan.free_seq_ids
                free_only += 1
    assert free_only > 0


def test_a_plan_may_carry_only_frees():
    eng = build(k=2, target_ranks=2, draft_ranks=2)
    eng.keep_steps = True
    add_requests(eng, [(1, 4, 30), (2, 4, 6)])     # 1 on ranks (0, 0), 2 on ranks (1, 1)
    eng.step()
    assert [(s.target_rank, s.draft_rank) for s in eng.steps[0].seqs] == [(0, 0), (1, 1)]
    while 2 not in eng.finished:
        eng.step()
    # the driver's mirror let go at once; the worker still holds it until its next plan
    assert not eng.sched.target_pools[1].has(2) and not eng.sched.draft_pools[1].has(2)
    assert 2 in eng.targets[1].cache and eng.targets[1].blocks.has(2) and eng.drafts[1].blocks.has(2)
    eng.step()
    step = eng.steps[-1]
    t1, d1 = step.target_plans[1], step.draft_plans[1]
    assert t1.seq_ids == [] and t1.free_seq_ids == [2] and step.target_seqs[1] == []
    assert d1.seq_ids == [] and d1.free_seq_ids == [2] and step.draft_seqs[1] == []
    assert step.target_plans[0].free_seq_ids == [] and step.draft_plans[0].free_seq_ids == []
    assert [v.seq_id for v in eng.verdicts[-1]] == [s.seq_id for s in step.seqs]
    # the workers applied them: rank 1 holds nothing, like its mirrors
    assert eng.targets[1].cache == {} and eng.drafts[1].cache == {}
    for w in (eng.targets[1], eng.drafts[1]):
        assert w.blocks.num_free_blocks == w.blocks.num_blocks
    # nothing left to free: the next step has no plan at all for rank 1
    eng.step()
    assert eng.steps[-1].target_plans[1] is None and eng.steps[-1].draft_plans[1] is None
    eng.run()


def test_update_takes_none_for_a_plan_without_sequences():
    eng = build(k=0, target_ranks=2, draft_blocks=None)
    add_requests(eng, [(1, 4, 30), (2, 4, 1)])
    eng.step()
    assert 2 in eng.finished and eng.finished[2].target_rank == 1
    step = eng.sched.schedule()
    assert step.target_plans[1].seq_ids == [] and step.target_plans[1].free_seq_ids == [2]
    out = eng.sched.update(eng.run_step(step))
    assert [s.seq_id for s, _ in out] == [1]


def test_frees_of_a_preempted_sequence_go_to_its_old_ranks():
    eng = build(k=0, max_model_len=64, target_ranks=2, target_blocks=4, draft_blocks=None)
    eng.keep_steps = True
    add_requests(eng, [(1, 4, 30), (2, 4, 30), (3, 4, 30), (4, 4, 30)])
    while not eng.preemptions:
        eng.step()
    step = eng.steps[-1]
    assert step.target_plans[0].free_seq_ids == [3] and step.target_plans[1].free_seq_ids == [4]
    assert 3 not in eng.targets[0].cache and 4 not in eng.targets[1].cache


def test_a_bad_result_fails_the_step_before_anything_is_applied():
    eng = build(k=2, target_ranks=2, draft_ranks=2)
    add_requests(eng, [(1, 3, 10), (2, 3, 10), (3, 3, 10)])
    step = eng.sched.schedule()
    assert [p.seq_ids for p in step.target_plans] == [[1, 3], [2]]
    snapshot = [(s.seq_id, list(s.tokens), s.target_computed, s.draft_computed, s.num_draft_tokens)
                for s in step.seqs]
    verify = eng.verify
    # Target rank 1 answers for a sequence it was not sent: the engine refuses the step.
    eng.verify = lambda r, plan, probs: (StepResult(step_id=plan.step_id, seq_ids=[3], proposed=[0],
                                                    num_emitted=[1], token_ids=[0]) if r == 1
                                         else verify(r, plan, probs))
    with pytest.raises(ValueError, match="answers sequences"):
        eng.run_step(step)
    assert [(s.seq_id, list(s.tokens), s.target_computed, s.draft_computed, s.num_draft_tokens)
            for s in step.seqs] == snapshot
    assert eng.sched.stats.num_steps == 0 and eng.sched.stats.num_emitted_tokens == 0


def test_pool_too_small_for_one_request_raises_with_several_ranks():
    eng = build(k=2, max_model_len=64, target_ranks=2, target_blocks=2)
    add_requests(eng, [(1, 9, 4)])
    with pytest.raises(RuntimeError, match="KV pool too small"):
        eng.sched.schedule()


def test_abort_all_frees_go_to_each_ranks_queue():
    eng = build(k=3, max_model_len=64, target_ranks=2, draft_ranks=3, target_blocks=18)
    add_requests(eng, KV_MANY)
    for _ in range(3):
        eng.step()
    running = [(s.seq_id, s.target_rank, s.draft_rank) for s in eng.sched.running]
    owed_t = [set(f) for f in eng._frees_t]
    owed_d = [set(f) for f in eng._frees_d]
    failed = eng.sched.abort_all("error")
    assert len(failed) == len(KV_MANY) - len(eng.finished)
    for pool in eng.sched.target_pools + eng.sched.draft_pools:
        assert pool.num_free_blocks == pool.num_blocks
    assert [sorted(f) for f in eng.sched._target_frees] == \
        [sorted(owed_t[r] | {sid for sid, t, _ in running if t == r}) for r in range(2)]
    assert [sorted(f) for f in eng.sched._draft_frees] == \
        [sorted(owed_d[d] | {sid for sid, _, dr in running if dr == d}) for d in range(3)]


def random_engine(rng: random.Random, ks: list[int]):
    """A fake engine over 1-3 target and draft ranks with random limits, pool sizes (from
    one sequence's worth to plenty), draft errors, shard counts and probabilities.
    Returns (engine, k, max_model_len)."""
    T, D = rng.randrange(1, 4), rng.randrange(1, 4)
    k = rng.choice(ks)
    block_size = rng.choice([1, 2, 4, 8])
    tml = rng.randrange(8, 64)
    dml = rng.choice([None, None, rng.randrange(4, tml + 8)])
    need = -(-(tml - 1) // block_size)                    # one sequence at full length
    tblocks = [rng.choice([need, need + 1, need + rng.randrange(0, 2 * need), 10 * need]) for _ in range(T)]
    dblocks = rng.choice([None, [rng.choice([1, rng.randrange(1, 2 * need + 2), 10 * need]) for _ in range(D)]])
    eng = build(k=k, max_model_len=tml, draft_max_model_len=dml, block_size=block_size, target_ranks=T, draft_ranks=D,
                target_blocks=tblocks, draft_blocks=dblocks, max_num_seqs=rng.randrange(1, 10),
                max_num_batched_tokens=rng.randrange(1, 150))
    wrong_mod = rng.randrange(1, 6)
    eng.draft_wrong = lambda sid, pos: (sid * 5 + pos * 3) % 7 < wrong_mod - 1
    eng.probs = rng.random() < 0.5
    return eng, k, tml


@pytest.mark.parametrize("scenario", range(30))
def test_random_scenarios_with_several_workers(scenario):
    rng = random.Random(5000 + scenario)
    eng, k, tml = random_engine(rng, [0, 1, 2, 3, 4])
    if rng.random() < 0.3:
        eng.shorten = lambda sid, pos, k_i: (3 * sid + pos) % (k_i + 1)
    stop_ids = rng.sample(range(V), rng.randrange(0, 4))
    max_seqs = eng.sched.cache.max_num_seqs
    max_batched = eng.sched.cache.max_num_batched_tokens
    admitted_now: set[int] = set()

    def check(step):
        assert len(step.seqs) <= max_seqs
        admitted = [i for i, s in enumerate(step.seqs) if s.seq_id in admitted_now]
        if admitted and (admitted[0] > 0 or len(admitted) > 1):
            assert sum(sum(p.num_new) for p in step.target_plans if p is not None) <= max_batched
        for s in step.seqs:
            assert s.proposal_len in (0, expected_limit(eng.sched, k, s.num_tokens, s.remaining))
    eng.on_plan = check

    total = rng.randrange(1, 25)
    ref: dict[int, tuple[list[int], str]] = {}
    next_id = 1
    steps = 0
    while next_id <= total or eng.sched.has_work:
        while next_id <= total and (not eng.sched.has_work or rng.random() < 0.4):
            ref |= add_requests(eng, [(next_id, rng.randrange(1, tml), rng.randrange(1, 40))], stop_ids)
            next_id += 1
        admitted_now = {s.seq_id for s in eng.sched.waiting}
        assert eng.step()
        steps += 1
        assert steps < 5000
    assert_matches_reference(eng, ref)
    assert len(eng.finished) == total


@pytest.mark.parametrize("scenario", range(30))
def test_random_scenarios_with_worker_deaths(scenario):
    """Random arrivals, finishes and preemptions while draft and target workers die -- between
    steps or during their call, as Engine.step sees it -- and come back empty some steps later;
    now and then every target worker is down at once. A restarted fake worker holds nothing, so
    any plan that still trusts its old KV fails the num_computed check, and greedy outputs must
    not change at all."""
    rng = random.Random(9000 + scenario)
    eng, k, tml = random_engine(rng, [0, 1, 2, 3, 4, 4])
    sched = eng.sched
    T = len(sched.target_pools)
    stop_ids = rng.sample(range(V), rng.randrange(0, 4))
    p_kill = rng.uniform(0.03, 0.12)

    def went_down(kind: str, rank: int, for_ticks: int) -> None:
        # it answers the engine's polls again from that tick on
        eng.back_at[(kind, rank)] = eng.tick + for_ticks

    def plan_faults(step):
        assert all(s.proposal_len in (0, expected_limit(sched, k, s.num_tokens, s.remaining)) for s in step.seqs)
        # a rank known to be down gets no call at all: no sequences, no frees
        assert all(step.target_plans[r] is None for r in sched.targets_down)
        assert all(step.draft_plans[d] is None for d in sched.drafts_down)
        assert all(s.proposal_len == 0 for s in step.seqs if s.draft_rank in sched.drafts_down)
        # only a worker that is called can fail during the call
        for d, plan in enumerate(step.draft_plans):
            if plan is not None and rng.random() < p_kill:
                eng.fail_drafts.add(d)
                went_down("draft", d, rng.randrange(0, 6))
        for r, plan in enumerate(step.target_plans):
            if plan is not None and rng.random() < p_kill:
                eng.fail_targets.add(r)
                went_down("target", r, rng.randrange(0, 6))
    eng.on_plan = plan_faults

    def up(kind: str, rank: int) -> bool:
        return (kind, rank) not in eng.dead and rank not in (sched.drafts_down if kind == "draft"
                                                             else sched.targets_down)

    total = rng.randrange(3, 25)
    ref: dict[int, tuple[list[int], str]] = {}
    next_id = 1
    while next_id <= total or sched.has_work:
        eng.tick += 1
        assert eng.tick < 5000
        while next_id <= total and (not sched.has_work or rng.random() < 0.4):
            ref |= add_requests(eng, [(next_id, rng.randrange(1, tml), rng.randrange(1, 40))], stop_ids)
            next_id += 1
        # Between steps: the engine hears of these at their next call.
        for d in range(sched.num_draft_ranks):
            if up("draft", d) and rng.random() < p_kill / 2:
                eng.kill_draft(d)
                went_down("draft", d, rng.randrange(0, 6))
        if rng.random() < 0.04:
            # an outage of every target worker for a few steps
            for r in range(T):
                if up("target", r):
                    eng.kill_target(r)
                    went_down("target", r, rng.randrange(1, 5))
        for r in range(T):
            if up("target", r) and rng.random() < p_kill / 2:
                eng.kill_target(r)
                went_down("target", r, rng.randrange(0, 6))
        sched.check_integrity()
        if len(sched.targets_down) == T and not any(eng.engine.verifiers[r].alive() for r in range(T)):
            # the Engine waits for a target worker; meanwhile nothing is planned and nothing dropped
            waiting = list(sched.waiting)
            assert not eng.step()
            assert not sched.running and list(sched.waiting) == waiting
            continue
        assert eng.step()
        eng.fail_drafts.clear()
        eng.fail_targets.clear()
        for w in eng.targets + eng.drafts:
            w.blocks.check_integrity()
        # a requeued sequence keeps every token it emitted
        for s in sched.waiting:
            assert eng.outputs.get(s.seq_id, []) == s.output_tokens
    assert_matches_reference(eng, ref)
    assert len(eng.finished) == total
    assert len({s.request_id for s in eng.finished.values()}) == total
    # every failed call is one failure, counted once
    assert sched.stats.num_draft_worker_failures == eng.losses["draft"]
    assert sched.stats.num_target_worker_failures == eng.losses["target"]


# -- bugs found while writing these tests ---------------------------------------------------------------

def test_self_preemption_on_a_small_pool_moves_to_a_pool_that_fits():
    # rank 0 holds 8 slots, rank 1 plenty: the request starts on the idle rank 0 (it fits) and outgrows it
    eng = build(k=0, max_model_len=64, target_ranks=2, target_blocks=[2, 1000], draft_blocks=None)
    ref = add_requests(eng, [(1, 5, 20)])
    eng.run()
    assert_matches_reference(eng, ref)


def test_preempted_sequences_of_several_ranks_requeue_oldest_first():
    eng = build(k=0, max_model_len=64, target_ranks=2, target_blocks=4, draft_blocks=None)
    add_requests(eng, [(1, 4, 30), (2, 4, 30), (3, 4, 30), (4, 4, 30)])
    while not eng.preemptions:
        eng.step()
    # running order was 1, 2, 3, 4; 3 and 4 were preempted: 3 is older and keeps its priority
    assert [s.seq_id for s in eng.sched.waiting] == [3, 4]


def test_a_draft_worker_that_is_down_gets_no_plan_not_even_frees():
    # A sequence that finished (or was requeued) while its draft worker was down used to queue
    # a free for that worker; the next step then sent a frees-only plan to the dead worker, and
    # the Engine counted its failed call as a second failure.
    eng = build(k=2)
    ref = add_requests(eng, [(1, 4, 3), (2, 4, 30)])
    eng.step()
    eng.kill_draft(0)
    eng.back_at[("draft", 0)] = 10**9       # it stays down until let back
    eng.step()                               # its call fails: the engine hears of the death
    assert eng.sched.drafts_down == {0}

    def no_draft_call(step):
        assert step.draft_plans == [None]
    eng.on_plan = no_draft_call
    while 1 not in eng.finished:
        eng.step()
    eng.step()                  # the free of sequence 1 would have gone out with this step
    eng.on_plan = None
    del eng.back_at[("draft", 0)]           # it answers again: the engine takes it back
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.stats.num_draft_worker_failures == 1


def test_disable_by_batch_size_holds_in_the_step_that_admits_the_batch():
    # Eight requests arriving together into an empty batch make a batch of eight: with the
    # rule at 4, nobody proposes and the draft is not called (it used to prefill every
    # prompt, because the rule was checked against the sequences already running: none).
    eng = build(disable_by_batch_size=4)
    ref = add_requests(eng, [(i, 10, 6) for i in range(1, 9)])
    plans = []
    eng.on_plan = plans.append
    eng.run()
    assert_matches_reference(eng, ref)
    assert len(plans[0].seqs) == 8 and all(s.proposal_len == 0 for s in plans[0].seqs)
    # The batch never drops below the rule (all finish together): the draft is never called.
    assert all(p is None for step in plans for p in step.draft_plans)
    # Below the rule, newcomers propose as before.
    small = build(disable_by_batch_size=4)
    add_requests(small, [(1, 10, 6), (2, 10, 6)])
    assert [s.proposal_len for s in small.sched.schedule().seqs] == [4, 4]


@pytest.mark.parametrize("draft_blocks,want", [(100, [10 + 2 * 3, 8 + 2 * 3]), (7, [10 + 2 * 3, 8 + 3 - 1])])
def test_predraft_reserves_the_next_windows_draft_slots_where_they_fit(draft_blocks, want):
    """Overlap: a drafting sequence's draft plan reserves L + 2 k_i slots (the pre-draft of
    its next window) where the pool holds them, else the usual L + k_i - 1; the target's
    reservation and the proposal lengths do not change."""
    spec = SpeculationConfig(num_speculative_tokens=3, overlap=True)
    draft = BlockManager(draft_blocks, 4)
    s = Scheduler(CacheConfig(block_size=4), spec, 256, BlockManager(100, 4), draft)
    s.add(make_seq(1, prompt_for(1, 10), 20))
    s.add(make_seq(2, prompt_for(2, 8), 20))
    step = s.schedule()
    plan = step.draft_plans[0]
    assert plan.num_slots == want and plan.proposal_lens == [3, 3]
    assert step.target_plans[0].num_slots == [10 + 3, 8 + 3]
    assert [len(draft.block_table(i)) * 4 >= n for i, n in zip((1, 2), want)] == [True, True]
    draft.check_integrity()


def test_every_target_worker_dead_for_good_fails_the_step_at_once():
    """Every target worker dead more often than Ray restarts it (``WorkerCall.gone``): the
    engine says so at the next step, without waiting out ``target_down_timeout_s``; while
    one may come back it waits instead."""
    eng = build(target_ranks=2)
    add_requests(eng, [(1, 5, 30), (2, 6, 30)])
    assert eng.step()
    for r in range(2):
        eng.kill_target(r)
        eng.back_at[("target", r)] = 10**9          # not back within this test
    eng.engine.target_down_timeout_s = 3600
    assert eng.step()                 # the calls fail: both ranks are down, their sequences requeued
    assert eng.sched.targets_down == {0, 1} and len(eng.sched.waiting) == 2
    assert not eng.step()             # down, not gone: it waits for one to come back
    eng.gone_for_good |= {("target", 0), ("target", 1)}
    with pytest.raises(RuntimeError, match="every target worker is dead"):
        eng.engine.step()
