"""Prefix caching: the hash chain, the pool's shared blocks, and the real Scheduler and
Engine over fake workers (tests/engine_harness.py) whose pools hold each block's tokens,
so a hit reads what another sequence wrote and a write to a shared or cached block fails.
Every run is checked against plain greedy decoding (``reference``), the driver's pools
with ``check_integrity`` after every scheduler call, and each worker's pool against the
driver's mirror of it after every step."""

from __future__ import annotations

import random

import pytest
from engine_harness import V, assert_matches_reference, build, make_seq, reference

from specray.scheduler.block_manager import BlockManager
from specray.scheduler.prefix_cache import block_hash, extend_hashes, root_hash
from specray.scheduler.sampling_params import SamplingParams

# -- names ------------------------------------------------------------------------------------


def test_a_name_stands_for_the_whole_prefix_under_one_pair_and_salt():
    tokens = list(range(12))
    root = root_hash("pair", None)
    hashes = extend_hashes([], root, tokens, 3, 4)
    assert hashes == [block_hash(root, tokens[:4]), block_hash(hashes[0], tokens[4:8]),
                      block_hash(hashes[1], tokens[8:12])]
    # growing in steps gives the same names
    assert extend_hashes(extend_hashes([], root, tokens, 1, 4), root, tokens, 3, 4) == hashes
    # a token changed in block 0 changes every later name; one in block 2 only that one
    other = extend_hashes([], root, [99] + tokens[1:], 3, 4)
    assert all(a != b for a, b in zip(hashes, other))
    late = extend_hashes([], root, tokens[:11] + [99], 3, 4)
    assert late[:2] == hashes[:2] and late[2] != hashes[2]
    # another model pair or another salt: nothing shared
    for r in (root_hash("other pair", None), root_hash("pair", "tenant-a"), root_hash("pair", "")):
        assert all(a != b for a, b in zip(hashes, extend_hashes([], r, tokens, 3, 4)))
    with pytest.raises(ValueError, match="full blocks"):
        extend_hashes([], root, tokens, 4, 4)


def test_cache_salt_is_validated():
    assert SamplingParams(cache_salt="t").cache_salt == "t"
    for bad in ("", 3, "x" * 257):
        with pytest.raises(ValueError, match="cache_salt"):
            SamplingParams(cache_salt=bad)


# -- the pool ---------------------------------------------------------------------------------


def test_shared_blocks_reference_counts_and_lru_eviction():
    bm = BlockManager(6, 4, enable_prefix_caching=True)

    def check():
        bm.check_integrity()

    assert bm.allocate_slots(1, 12)               # blocks 0, 1, 2
    check()
    assert bm.cache_blocks(1, [b"a", b"b"]) == 2    # the two full blocks of committed tokens
    check()
    assert bm.cached_prefix([b"a", b"b", b"c"]) == 2 and bm.cached_prefix([b"c", b"a"]) == 0
    # a newcomer starts with both: shared, nothing new taken
    assert bm.allocate_slots(2, 9, hits=[b"a", b"b"])
    check()
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2] and bm._ref[0] == bm._ref[1] == 2
    assert bm.num_used_blocks == 4 and bm.take_hits(2) == [0, 1] and bm.take_hits(2) == []
    ev = bm.take_events()
    assert (ev.cached_seq_ids, ev.cached_index, ev.cached_names) == ([1, 1], [0, 1], [0, 1])
    with pytest.raises(ValueError, match="newcomers"):
        bm.allocate_slots(2, 9, hits=[b"a"])
    # the same content computed twice stays uncached in the second block
    assert bm.allocate_slots(3, 4) and bm.cache_blocks(3, [b"a"]) == 0
    check()
    bm.free(3)
    bm.free(1)                                    # block 2 (unkeyed) goes back empty, 0 and 1 stay with 2
    check()
    assert bm._ref[0] == bm._ref[1] == 1 and bm.num_cached_blocks == 2
    bm.free(2)                                    # now evictable, last block first
    check()
    assert list(bm._evictable) == [1, 0] and bm.num_free_blocks == 6
    # new content takes the empty blocks first, then evicts the least recently used
    assert bm.allocate_slots(4, 4 * 5)
    check()
    assert bm.num_cached_blocks == 1 and bm.cached_prefix([b"a", b"b"]) == 1
    assert bm.take_events().evicted_names == [1]
    # a hit on an evictable block leaves the free count: a newcomer that needs it and one
    # new block does not fit in a pool with just that one free
    assert not bm.can_allocate_slots(5, 8, hits=[b"a"])
    assert bm.allocate_slots(5, 4, hits=[b"a"]) and bm.num_free_blocks == 0
    check()


def test_a_worker_pool_follows_the_names_it_is_told():
    mirror = BlockManager(4, 2, enable_prefix_caching=True)
    worker = BlockManager(4, 2, enable_prefix_caching=True, named_by_driver=True)
    worker._free.reverse()                        # it hands out other physical ids
    for pool in (mirror, worker):
        assert pool.allocate_slots(7, 4)
    mirror.cache_blocks(7, [b"x", b"y"])
    ev = mirror.take_events()
    for sid, j, name in zip(ev.cached_seq_ids, ev.cached_index, ev.cached_names):
        worker.cache_block(sid, j, name)
    assert [worker.key_of(b) for b in worker.block_table(7)] == mirror.block_table(7)
    for pool in (mirror, worker):
        pool.free(7)
        pool.check_integrity()
    # the mirror evicts for new content; the worker only where told, and never by itself
    assert mirror.allocate_slots(8, 6)
    assert not worker.allocate_slots(8, 6)
    for name in mirror.take_events().evicted_names:
        worker.evict(name)
    assert worker.allocate_slots(8, 6)
    assert worker.num_cached_blocks == mirror.num_cached_blocks == 1
    with pytest.raises(RuntimeError, match="disagree"):
        worker.evict(12345)
    mirror.uncache_all()
    assert mirror.take_events().uncached_all and mirror.num_cached_blocks == 0
    mirror.check_integrity()


# -- the scheduler over fake workers ----------------------------------------------------------

SYSTEM = [(7 * j + 3) % V for j in range(40)]


def shared_prompts(n: int, prefix=SYSTEM) -> list[list[int]]:
    return [list(prefix) + [(11 * i + 5 * j + 1) % V for j in range(3 + i % 5)] for i in range(n)]


def run(prompts, *, caching: bool, salts=None, max_tokens: int = 12, arrive_every: int = 0, **kw):
    """Each prompt after ``arrive_every`` steps of the previous one (0: all at once)."""
    eng = build(enable_prefix_caching=caching, **kw)
    ref = {}
    pending = list(enumerate(prompts, start=1))
    while pending or eng.sched.has_work:
        if pending and (not eng.sched.has_work or not arrive_every or eng.counts.steps % arrive_every == 0):
            sid, prompt = pending.pop(0)
            salt = salts[sid - 1] if salts else None
            eng.sched.add(make_seq(sid, prompt, max_tokens, cache_salt=salt))
            ref[sid] = reference(prompt, max_tokens, (), eng.sched.max_model_len)
        assert eng.step()
    assert_matches_reference(eng, ref)
    return eng


def test_shared_prefixes_equal_plain_decoding_with_caching_on_and_off_and_accept_the_same():
    prompts = shared_prompts(6)
    off = run(prompts, caching=False, arrive_every=3)
    on = run(prompts, caching=True, arrive_every=3)
    assert off.sched.stats.prefix_cache_hits == 0 and off.targets[0].num_hit_tokens == 0
    st = on.sched.stats
    assert st.prefix_cache_hits > 0 and 0 < st.as_dict()["prefix_cache_hit_rate"] < 1
    # one decision for every model: the draft found as much cached as the target
    assert on.targets[0].num_hit_tokens == on.drafts[0].num_hit_tokens == st.prefix_cache_hits
    # the draft's KV was restored: it proposed and got accepted exactly as without the cache
    assert (on.counts.drafted, on.counts.accepted) == (off.counts.drafted, off.counts.accepted)
    for sid in on.finished:
        assert on.finished[sid].num_draft_tokens == off.finished[sid].num_draft_tokens
        assert on.finished[sid].num_accepted_tokens == off.finished[sid].num_accepted_tokens
    # fewer tokens computed: the prefix was fed once, not six times
    assert on.sched.stats.num_steps <= off.sched.stats.num_steps


def test_a_second_request_with_a_40_token_shared_prefix_finds_it_cached():
    a, b = shared_prompts(2)
    eng = run([a, b], caching=True, arrive_every=4, block_size=4)
    assert eng.finished[1].num_cached_tokens == 0
    assert eng.finished[2].num_cached_tokens >= 32
    assert eng.finished[2].num_cached_tokens == 40          # every full block of the shared 40 tokens


def test_an_identical_prompt_still_computes_its_last_token():
    prompt = SYSTEM[:16]                                     # 4 full blocks
    eng = run([prompt, prompt], caching=True, arrive_every=3, block_size=4)
    assert eng.finished[2].num_cached_tokens == 12           # not the block holding the last token


def test_cache_salt_keeps_tenants_apart():
    prompts = [SYSTEM + [1, 2], SYSTEM + [3, 4], SYSTEM + [5, 6]]
    eng = run(prompts, caching=True, arrive_every=4, salts=["a", "b", "a"])
    assert [eng.finished[i].num_cached_tokens for i in (1, 2, 3)] == [0, 0, 40]


def test_a_hit_margin_gives_back_blocks_for_heads_whose_kv_needs_the_next_token():
    a, b = shared_prompts(2)
    eng = run([a, b], caching=True, arrive_every=4, block_size=4, hit_margin=1)
    assert eng.finished[2].num_cached_tokens == 36


def test_ngram_style_proposers_cache_for_the_target_alone():
    prompts = shared_prompts(4)
    eng = run(prompts, caching=True, arrive_every=3, draft_blocks=None)
    assert eng.sched.stats.prefix_cache_hits > 0 == eng.drafts[0].num_hit_tokens


def test_preempted_sequences_recompute_mostly_from_the_cache():
    prompts = shared_prompts(6)
    hits_after_preemption = []

    def watch(step):
        for r, plan in enumerate(step.target_plans):
            if plan is None or not plan.num_hits:
                continue
            for seq, n in zip(step.target_seqs[r], plan.num_hits):
                if n and seq.num_preemptions:
                    hits_after_preemption.append(n)

    eng = build(enable_prefix_caching=True, target_blocks=26, block_size=4, max_num_seqs=6)
    eng.on_plan = watch
    ref = {}
    for sid, prompt in enumerate(prompts, start=1):
        eng.sched.add(make_seq(sid, prompt, 30))
        ref[sid] = reference(prompt, 30, (), eng.sched.max_model_len)
    eng.run()
    assert_matches_reference(eng, ref)
    assert eng.sched.stats.num_preemptions > 0 and hits_after_preemption


@pytest.mark.parametrize("scenario", range(24))
def test_small_pools_with_many_shared_prefixes_match_plain_decoding(scenario):
    """Evictions, preemptions, several ranks, draft losses: every output is plain greedy
    decoding's, every hit reads what was written (the fake workers' pools hold tokens)."""
    rng = random.Random(5100 + scenario)
    bs = rng.choice([1, 2, 3, 4, 8])
    k = rng.choice([0, 1, 3, 4])
    T, D = rng.choice([(1, 1), (1, 1), (2, 1), (1, 2), (2, 2)])
    tml = 96
    need = -(-tml // bs)
    eng = build(k=k, max_model_len=tml, block_size=bs, target_ranks=T, draft_ranks=D,
                target_blocks=rng.choice([need, need + 3, 2 * need, 6 * need]),
                draft_blocks=rng.choice([None, need, 3 * need]), max_num_seqs=rng.randrange(1, 7),
                max_num_batched_tokens=rng.randrange(4, 120), enable_prefix_caching=True)
    prefixes = [[rng.randrange(V) for _ in range(rng.randrange(0, 50))] for _ in range(3)]
    salts = [None, None, "s"]
    ref, next_id, steps = {}, 1, 0
    total = rng.randrange(6, 16)
    kill_at = rng.randrange(1, 40) if rng.random() < 0.3 else None
    while next_id <= total or eng.sched.has_work:
        while next_id <= total and (not eng.sched.has_work or rng.random() < 0.35):
            p = rng.randrange(len(prefixes))
            prompt = (prefixes[p] + [rng.randrange(V) for _ in range(rng.randrange(1, 12))])[:tml - 2]
            # a later turn: an earlier request's whole prompt and output, and more
            if ref and rng.random() < 0.3:
                sid0 = rng.choice(sorted(eng.finished)) if eng.finished else None
                if sid0 is not None:
                    prev = eng.finished[sid0]
                    prompt = (prev.tokens + [rng.randrange(V)])[:tml - 2]
            mt = rng.randrange(1, 20)
            eng.sched.add(make_seq(next_id, prompt, mt, cache_salt=salts[p]))
            ref[next_id] = reference(prompt, mt, (), tml)
            next_id += 1
        if steps == kill_at and eng.sched.num_draft_ranks and eng.sched.draft_pools:
            eng.fail_drafts.add(0)
        assert eng.step()
        eng.fail_drafts.clear()
        eng.tick += 1
        steps += 1
        assert steps < 5000
    assert_matches_reference(eng, ref)


# -- the plan's fields ------------------------------------------------------------------------


def test_a_plans_cache_fields_round_trip_and_are_validated():
    from specray.scheduler.messages import ProtocolError, StepPlan, decode, encode

    plan = StepPlan(step_id=3, seq_ids=[5, 6], num_computed=[8, 0], num_new=[1, 2], token_ids=[1, 2, 3],
                    num_slots=[9, 2], proposal_lens=[0, 0], temperature=[0.0] * 2, top_k=[0, 0], top_p=[1.0] * 2,
                    seeds=[1, 2], num_hits=[2, 0], hit_names=[2**30, 7], uncached_all=True, cached_seq_ids=[5],
                    cached_index=[1], cached_names=[9], evicted_names=[4, 2**31 - 1])
    assert decode(encode(plan), expected=StepPlan) == plan
    for bad, match in [(dict(num_hits=[2]), "num_hits does not match"), (dict(hit_names=[1]), "hit_names"),
                       (dict(cached_index=[]), "cached_seq_ids"), (dict(num_hits=[-1, 1], hit_names=[]),
                                                                   "negative")]:
        wrong = StepPlan(**{**plan.__dict__, **bad})
        with pytest.raises(ProtocolError, match=match):
            decode(encode(wrong), expected=StepPlan)
