"""Pairs whose vocabularies are padded differently (as Qwen2.5-7B's 152064 rows and
Qwen2.5-0.5B's 151936 for one tokenizer): served exactly, greedy equal to transformers'
own generate; a pair whose tokenizers disagree is refused, naming both."""

from __future__ import annotations

import pytest
from specray_testing import disagreeing_pair, hf_greedy, make_pair, run_local

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.scheduler.sampling_params import SamplingParams

V = 97
MAX_NEW = 20
# Token-id prompts; the second and third hold ids past the smaller draft's 80 rows (the
# target scores them: a user may send them, and the target may emit them).
ID_PROMPTS = [[5, 9, 14, 5, 9, 14, 5], [85, 7, 96, 7, 85, 3], [90, 91, 92, 90, 91]]
TEXT_PROMPTS = ["w5 w9 w14 w5 w9", "w33 w4 w60 w33 w4 w60 w33"]


@pytest.fixture(scope="module", params=[80, 110], ids=["smaller-draft", "larger-draft"])
def padded_pair(request, tmp_path_factory):
    t, d = make_pair(tmp_path_factory.mktemp(f"v{request.param}"), vocab=V, draft_vocab=request.param,
                     tokenizer=True)
    return t, d, request.param


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_equals_hf_generate(padded_pair, k):
    from transformers import AutoTokenizer

    t, d, dv = padded_pair
    tok = AutoTokenizer.from_pretrained(t)
    text_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    expected = hf_greedy(t, ID_PROMPTS + text_ids, MAX_NEW)
    cfg = RuntimeConfig(target=t, draft=d, num_speculative_tokens=k, block_size=4, device="cpu", dtype="float32")
    outs, m = run_local(cfg, ID_PROMPTS + TEXT_PROMPTS, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [o.prompt_token_ids for o in outs[len(ID_PROMPTS):]] == text_ids
    assert [o.token_ids for o in outs] == expected
    # The draft helped: it shares the target's first layer and head, padded another way.
    assert 0.2 < m["acceptance_rate"] < 0.98


def test_sampling_with_a_padded_draft_runs_and_is_seeded(padded_pair):
    t, d, _ = padded_pair
    cfg = RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=5)
    a, m = run_local(cfg, ID_PROMPTS, params)
    b, _ = run_local(cfg, ID_PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(0 <= x < V for o in a for x in o.token_ids)
    assert m["num_draft_tokens"] > 0 and 0 < m["acceptance_rate"] < 1


def test_a_pair_whose_tokenizers_disagree_is_refused_naming_both(tmp_path):
    t, d = disagreeing_pair(tmp_path)
    with pytest.raises(ValueError) as e:
        DriverCore(RuntimeConfig(layout="colocated", target=t, draft=d, block_size=4, device="cpu", dtype="float32"))
    msg = str(e.value)
    assert f"draft {d!r} (vocab_size 97, tokenizer" in msg and f"target {t!r} (vocab_size 97, tokenizer" in msg
    assert "do not share a tokenizer: 94 of the 97 shared token ids differ (id 3 is 'w3' to the target and 'v3'" in msg
