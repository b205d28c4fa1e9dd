"""Grammar matchers on a worker (``specray.workers.grammar``), on the built-in pair's
byte-level vocabulary: a matcher follows a sequence's output whatever happened to it
(advanced, rolled back where the output differs, rebuilt for another spec, dropped when
freed); the verify pass's masks are those of a fresh matcher stepped through each
proposal, all-allowed past a forbidden one, and leave the matchers where they were;
``apply_bitmask`` masks what llguidance's own numpy kernel masks."""

from __future__ import annotations

import llguidance
import llguidance.numpy as lnp
import numpy as np
import pytest
import torch

from specray import builtin_model
from specray.scheduler.grammar_plan import add_grammars
from specray.scheduler.messages import StepPlan
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.sequence import Sequence
from specray.scheduler.structured_output import StructuredOutput, grammar_text
from specray.workers.errors import PlanError
from specray.workers.grammar import GrammarBook, apply_bitmask, tokenizer_for

V = 259
CHOICE = {"choice": ["cat", "car", "cart", "dog"]}


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for(builtin_model("tiny-target"), V)


def b(text: str) -> list[int]:
    return [c + 3 for c in text.encode()]


def plan_for(outputs: dict[int, tuple[dict | None, list[int]]], proposals: dict[int, list[int]] | None = None,
             width: int = 0, free=()) -> StepPlan:
    seqs = []
    for sid, (spec, out) in outputs.items():
        s = Sequence(seq_id=sid, request_id=str(sid), prompt_len=1, tokens=[40] + out,
                     params=SamplingParams(structured_output=spec), seed=0)
        s.step_len = s.num_tokens
        seqs.append(s)
    n = len(seqs)
    props = proposals or {}
    plan = StepPlan(width=width, seq_ids=list(outputs), num_computed=[0] * n, num_new=[s.num_tokens for s in seqs],
                    token_ids=[t for s in seqs for t in s.tokens], num_slots=[s.num_tokens + width for s in seqs],
                    proposal_lens=[len(props.get(sid, [])) for sid in outputs], temperature=[1.0] * n,
                    top_k=[0] * n, top_p=[1.0] * n, seeds=[0] * n, free_seq_ids=list(free))
    if width:
        plan.proposal_token_ids = [t for sid in outputs for t in (props.get(sid, []) + [-1] * width)[:width]]
        plan.draft_rows = [-1] * n
    add_grammars(plan, seqs)
    plan.validate()
    return plan


def allowed(bm: np.ndarray, row: int) -> set[int]:
    return {t for t in range(V) if (int(bm[row, t // 32]) >> (t % 32)) & 1}


def fresh_allowed(tok, spec: dict, tokens: list[int]) -> set[int]:
    m = llguidance.LLMatcher(tok.ll, grammar_text(StructuredOutput(**spec)))
    assert m.consume_tokens(tokens)
    bm = lnp.allocate_token_bitmask(1, V)
    lnp.fill_next_token_bitmask(m, bm, 0)
    return allowed(bm, 0)


def test_a_matcher_follows_the_output_it_is_given(tok):
    book = GrammarBook(tok)
    (m,) = book.sync(plan_for({7: (CHOICE, b("ca"))}))
    assert book.matchers[7].consumed == b("ca")
    bm = np.zeros((1, tok.words), dtype=np.int32)
    book.fill([m], bm)
    assert allowed(bm, 0) == set(b("tr"))
    book.sync(plan_for({7: (CHOICE, b("car"))}))            # advanced
    book.fill([m], bm)
    assert allowed(bm, 0) == {1} | set(b("t"))               # "car" may end: EOS, or go on to "cart"
    book.sync(plan_for({7: (CHOICE, b("do"))}))             # another history (a resumed request's): rolled back
    assert book.matchers[7].consumed == b("do")
    book.fill([m], bm)
    assert allowed(bm, 0) == set(b("g"))
    (m2,) = book.sync(plan_for({7: ({"regex": "[0-9]+"}, b("12"))}))    # another spec: another matcher
    assert m2 is not m and book.matchers[7].consumed == b("12")
    book.sync(plan_for({8: (CHOICE, [])}, free=[7]))
    assert set(book.matchers) == {8}
    with pytest.raises(PlanError, match="sequence 9: its output leaves its structured_output grammar"):
        book.sync(plan_for({9: (CHOICE, b("cow"))}))
    assert 9 not in book.matchers


def test_verify_masks_are_a_fresh_matchers_along_each_proposal(tok):
    book = GrammarBook(tok)
    outputs = {1: (CHOICE, b("c")), 2: (None, b("xyz")), 3: (CHOICE, []), 4: ({"regex": "[0-9]{2}"}, [])}
    proposals = {1: b("art"), 2: b("abc"), 3: b("dxg"), 4: b("1")}
    plan = plan_for(outputs, proposals, width=3)
    bm = book.verify_masks(plan, plan.proposal_lens)
    assert bm.shape == (sum(plan.proposal_lens) + 4, tok.words)
    everything = set(range(V))
    want = []
    for sid, (spec, out) in outputs.items():
        props, forbidden = proposals[sid], False
        for j in range(len(props) + 1):
            forbidden = forbidden or (j > 0 and props[j - 1] not in want[-1])
            # Past a forbidden proposal (never read) and where unconstrained: all-allowed.
            want.append(everything if spec is None or forbidden else fresh_allowed(tok, spec, out + props[:j]))
    assert [allowed(bm, r) for r in range(bm.shape[0])] == want
    # Sequence 3's "x" is forbidden: its rows past it are all-allowed.
    assert want[10] == everything and want[11] == everything
    # The matchers are back where the plan found them: the same masks again.
    assert np.array_equal(book.verify_masks(plan, plan.proposal_lens), bm)


def test_apply_bitmask_masks_what_llguidances_numpy_kernel_masks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g)
    bm = torch.randint(-2**31, 2**31 - 1, (5, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32).numpy()
    ref = logits.numpy().copy()
    lnp.apply_token_bitmask_inplace(ref, bm)
    got = apply_bitmask(logits.clone(), bm)
    assert torch.equal(got, torch.from_numpy(ref))
    # On chosen rows only, and on fewer columns than the mask covers (a smaller draft vocabulary).
    part = logits[:, :200].clone()
    apply_bitmask(part, bm[[1, 3]], torch.tensor([4, 0]))
    ref = logits[[4, 0], :200].numpy().copy()
    lnp.apply_token_bitmask_inplace(ref, bm[[1, 3]])
    assert torch.equal(part[[4, 0]], torch.from_numpy(ref))
    assert torch.equal(part[1:4], logits[1:4, :200])


def test_a_tokenizer_a_grammar_cannot_drive_is_refused_naming_the_field(tok):
    from specray_testing import word_tokenizer

    from specray.workers.grammar import GrammarTokenizer

    assert tok.vocab_size == V and tok.ll.eos_token == 1
    with pytest.raises(ValueError, match="^structured_output cannot use the model's tokenizer: .*WordPiece"):
        GrammarTokenizer.build(word_tokenizer(50), 50)
