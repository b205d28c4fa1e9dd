"""The bench's prompt sets, and the bench of a target alone (no draft) on quoting prompts."""

from __future__ import annotations

import pytest
from specray_testing import word_tokenizer

from specray import builtin_model
from specray.runtime.bench.prompts import INSTRUCTIONS, PARAGRAPHS, bench_prompts, quote_texts
from specray.runtime.bench.stdlib_corpus import held_out_prompts
from specray.workers.model_loader import load_tokenizer


def test_quote_prompts_quote_a_paragraph_after_an_instruction():
    texts = quote_texts(40)
    assert len(set(texts[:32])) == 32 and texts[32:] == texts[:8]      # every pair once, then again
    for t in texts:
        instruction, paragraph = t.split("\n\n")
        assert instruction in INSTRUCTIONS and paragraph in PARAGRAPHS
    assert len({t.split("\n\n")[0] for t in texts[:4]}) > 1 and len({t.split("\n\n")[1] for t in texts[:4]}) > 1


def test_prompts_are_the_tokenizers_ids():
    tok = load_tokenizer(builtin_model("tiny-target"))           # bytes, a plain chat template
    code = bench_prompts("code", 3, tok)
    assert code == [[b + 3 for b in t.encode()] for t in held_out_prompts(3)]
    quote = bench_prompts("quote", 2, tok)
    assert quote == [[b + 3 for b in f"# user: {t}\n# assistant: ".encode()] for t in quote_texts(2)]
    with pytest.raises(ValueError, match="prompts must be one of code, quote"):
        bench_prompts("poems", 1, tok)


def test_a_chat_model_gets_the_request_as_its_user_turn():
    tok = word_tokenizer(50)
    tok.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"
    (ids,) = bench_prompts("quote", 1, tok)
    text = quote_texts(1)[0]
    assert ids == tok(f"<s> {text} </s>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2


def test_a_target_alone_is_benched_with_ngram_and_plain_decoding(ray_session, tmp_path):
    from specray.runtime.bench.report import format_table, write_outputs
    from specray.runtime.bench.run import run_bench
    from specray.runtime.bench.settings import BenchSettings

    s = BenchSettings(target=builtin_model("tiny-target"), draft=None, batch_sizes=(1, 2), max_tokens=12,
                      repeats=2, prompt_set="quote", device="cpu", colocate=True, progress=False,
                      out_dir=str(tmp_path))
    result = run_bench(s, "no")
    assert result["greedy_outputs_equal"], result["mismatches"]
    keys = {(r["system"], r["proposer"], r["batch_size"]) for r in result["runs"]}
    assert keys == {("specray", p, b) for p in ("ngram", "suffix", "none") for b in (1, 2)} | {
        ("hf", "none", 1), ("hf", "lookup", 1), ("hf", "none", 2)}
    assert result["alpha"] is None and result["analytic_bound"] is None
    # n-gram lookup and suffix decoding are held to plain decoding, per batch size.
    assert {(p["proposer"], p["batch_size"], p["against"]) for p in result["paired"]} == {
        (proposer, b, against) for proposer in ("ngram", "suffix") for b in (1, 2)
        for against in ("none", "best other")}
    ratios = result["batch1_ratios"]
    assert all(q is not None and q["min"] <= q["median"] <= q["max"] for q in ratios.values())
    assert "no draft: n-gram and plain decoding only" in format_table(result)
    jpath, ppath = write_outputs(result, str(tmp_path / "out"))
    assert jpath.is_file() and ppath.stat().st_size > 1000
