"""Chat: conversations in, the target tokenizer's chat template applied (as transformers'
``apply_chat_template(..., add_generation_prompt=True)``), greedy output equal to
transformers' generate on those ids; through ``rt.chat`` and ``specray batch`` lines with
"messages". A tokenizer without a template is a clear ValueError."""

from __future__ import annotations

import json

import pytest
from specray_testing import hf_greedy, make_pair, word_tokenizer

from specray import RuntimeConfig, SamplingParams, SpecRuntime
from specray.runtime.chat import check_messages
from specray.runtime.entrypoints.batch.job import main as batch_main

# Roles become marker words; the generation prompt is "w7". Words w3..w96 are the vocabulary.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ 'w5' if m['role'] == 'user' else 'w6' }} "
            "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w7{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "w10 w11 w12"}],
    [{"role": "user", "content": "w40 w41"}, {"role": "assistant", "content": "w42 w43 w44"},
     {"role": "user", "content": "w45"}],
]


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    t, d = make_pair(tmp_path_factory.mktemp("chat"), tokenizer=True)
    tok = word_tokenizer(97)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(t)
    return t, d, tok


@pytest.fixture(scope="module")
def rt(ray_module, chat_pair):
    t, d, _ = chat_pair
    runtime = SpecRuntime(RuntimeConfig(target=t, draft=d, num_speculative_tokens=3, block_size=4, device="cpu",
                                        dtype="float32", max_model_len=64, layout="colocated"))
    yield runtime
    runtime.shutdown()


def test_chat_equals_transformers_generate_on_the_templated_ids(rt, chat_pair):
    t, _, tok = chat_pair
    wanted = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
              for c in CONVERSATIONS]
    assert wanted[0] == [1, 5, 10, 11, 12, 7]     # the template did apply
    outs = rt.chat(CONVERSATIONS, SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.prompt_token_ids for o in outs] == wanted
    assert [o.token_ids for o in outs] == hf_greedy(t, wanted, 12)
    assert outs[0].text == tok.decode(outs[0].token_ids, skip_special_tokens=True)


def test_chat_refuses_malformed_conversations_naming_them(rt):
    with pytest.raises(ValueError, match=r"request 1: messages\[0\] needs a string 'content'"):
        rt.chat([CONVERSATIONS[0], [{"role": "user"}]])
    with pytest.raises(ValueError, match="list of conversations"):
        rt.chat(CONVERSATIONS[0])                  # one conversation, not a list of them
    with pytest.raises(ValueError, match="messages is empty"):
        check_messages([])


def test_a_tokenizer_without_a_template_is_a_clear_error(tmp_path, ray_module):
    t, d = make_pair(tmp_path, tokenizer=True)
    r = SpecRuntime(RuntimeConfig(target=t, draft=d, block_size=4, device="cpu", dtype="float32", max_model_len=64,
                                  layout="colocated"))
    try:
        with pytest.raises(ValueError, match="request 0: messages need a chat template, and the target's "
                                             "tokenizer has none"):
            r.chat(CONVERSATIONS[:1])
        assert r.info.has_chat_template is False
        (o,) = r.generate([[5, 10, 11]], SamplingParams(max_tokens=3, temperature=0.0))   # still serving
        assert len(o.token_ids) == 3
    finally:
        r.shutdown()


def test_batch_lines_with_messages(chat_pair, tmp_path, ray_module, capsys):
    t, d, tok = chat_pair
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"messages": CONVERSATIONS[1], "id": "chat"}, {"prompt": [5, 10, 11]},
             {"messages": [{"role": "user"}]}, {"prompt": [3], "messages": CONVERSATIONS[0]}]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc = batch_main(["--target", t, "--draft", d, "-k", "3", "--block-size", "4", "--device", "cpu", "--dtype",
                     "float32", "--max-model-len", "64", "--colocate", "--no-progress", "--temperature", "0",
                     "--max-tokens", "8", "--input", str(inp), "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert "line 3: messages[0] needs a string 'content'" in err
    assert 'line 4: give "prompt" or "messages"' in err
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    ids = tok.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert [r["line"] for r in recs] == [1, 2] and recs[0]["id"] == "chat"
    assert recs[0]["prompt_token_ids"] == ids
    assert [r["token_ids"] for r in recs] == hf_greedy(t, [ids, [5, 10, 11]], 8)

