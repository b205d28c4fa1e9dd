"""String prompts through the driver are what transformers' own generation path feeds
for a plain prompt: the BOS wherever the tokenizer adds it (Gemma 3 and Llama 3 put it
in their post-processor, where ``add_bos_token`` does not show), never a trailing EOS."""

from __future__ import annotations

import shutil

import pytest
from specray_testing import hf_greedy, make_pair, run_local, word_tokenizer

from specray.runtime.config import RuntimeConfig
from specray.scheduler.sampling_params import SamplingParams

TEXTS = ["w5 w9 w14 w5 w9", "w33"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    t, _ = make_pair(tmp_path_factory.mktemp("strings"))
    return t


@pytest.mark.parametrize("bos,eos_after", [("post", False), ("flag", False), (None, True), (None, False)])
def test_string_prompts_encode_and_generate_as_transformers(target, tmp_path, bos, eos_after):
    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(target, model)
    word_tokenizer(97, bos, eos_after).save_pretrained(model)
    tok = AutoTokenizer.from_pretrained(model)
    wanted = [tok(t)["input_ids"][:-1] if eos_after else tok(t)["input_ids"] for t in TEXTS]
    assert all((ids[0] == 1) == (bos is not None) for ids in wanted)
    cfg = RuntimeConfig(target=str(model), proposer="ngram", block_size=4, device="cpu", dtype="float32")
    outs, _ = run_local(cfg, TEXTS, SamplingParams(max_tokens=8, temperature=0.0))
    assert [o.prompt_token_ids for o in outs] == wanted
    assert [o.token_ids for o in outs] == hf_greedy(str(model), wanted, 8)
