"""model_loader: string prompts encode as ``tokenizer(text)`` does (whatever puts the BOS
first) without a trailing EOS; names that can only be paths fail naming the directory."""

from __future__ import annotations

import os

import pytest
from specray_testing import ROOT, make_pair, word_tokenizer
from transformers import ByT5Tokenizer

from specray.workers import model_loader
from specray.workers.model_loader import encode_prompt, load_config, looks_local, resolve_model_path

TEXTS = ["w3 w4 w5", "w7", "w9 w9 w9 w9 w10 w11"]


@pytest.mark.parametrize("bos,eos_after,first,last", [
    ("post", False, [1], []),      # a post-processor puts BOS first (Gemma 3, Llama 3 fast tokenizers)
    ("flag", False, [1], []),      # add_bos_token=True (Llama 2 style)
    (None, True, [], [2]),         # the post-processor appends EOS
    (None, False, [], []),         # neither
    ("post", True, [1], [2]),      # both: the BOS stays, the EOS goes
])
def test_prompts_encode_as_the_tokenizer_does_without_a_trailing_eos(tmp_path, bos, eos_after, first, last):
    word_tokenizer(20, bos, eos_after).save_pretrained(tmp_path)
    tok = model_loader.load_tokenizer(str(tmp_path))
    for text in TEXTS:
        full = tok(text)["input_ids"]
        plain = tok(text, add_special_tokens=False)["input_ids"]
        assert full == first + plain + last            # what the tokenizer itself does
        assert encode_prompt(tok, text) == first + plain


def test_byt5_appends_eos_and_the_prompt_keeps_only_the_bytes():
    tok = ByT5Tokenizer(extra_ids=0)
    for text in ("def f(x):", "é", " "):
        assert tok(text)["input_ids"][-1] == tok.eos_token_id
        assert encode_prompt(tok, text) == [b + 3 for b in text.encode()]


def test_the_builtin_pair_reads_plain_bytes():
    tok = model_loader.load_tokenizer(str(ROOT / "models" / "tiny-target"))
    assert tok("x = 1")["input_ids"][-1] == 1          # its ByT5 tokenizer appends eos
    assert encode_prompt(tok, "x = 1") == [b + 3 for b in b"x = 1"]


def test_a_text_of_no_plain_tokens_keeps_the_bos(tmp_path):
    # Whitespace only: nothing to anchor the prefix on; the BOS stays, an EOS goes.
    word_tokenizer(20, "post", True).save_pretrained(tmp_path)
    tok = model_loader.load_tokenizer(str(tmp_path))
    assert tok("   ", add_special_tokens=False)["input_ids"] == []
    assert encode_prompt(tok, "   ") == [1]


@pytest.mark.parametrize("name,local", [
    ("./nowhere", True), ("/abs/nowhere", True), ("~/nowhere", True), ("a/b/c", True),
    ("models/tiny-target", True), ("tiny-draft", True), ("Qwen/Qwen2.5-0.5B", False), ("gpt2", False),
])
def test_which_names_can_only_be_paths(name, local):
    assert looks_local(name) is local


def test_a_missing_relative_directory_is_named_absolutely(tmp_path, monkeypatch):
    """The README's ``models/tiny-target`` run from a folder that has a models/ of its
    own, but not the model: the error names where it looked, not a hub repository."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for name in ("models/other", "./other", "a/b/c"):
        with pytest.raises(ValueError) as e:
            load_config(name)
        assert str(e.value) == (f"no such model directory: {os.path.abspath(name)} "
                                f"(relative paths resolve from {tmp_path})")


def test_the_builtin_pair_by_its_relative_path_elsewhere_points_at_builtin_model(tmp_path, monkeypatch):
    # The README's example path, run outside the clone: no hub request, and a pointer.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        load_config("models/tiny-target")
    assert str(e.value) == (f"no such model directory: {tmp_path / 'models' / 'tiny-target'} (relative paths "
                            f"resolve from {tmp_path}); specray.builtin_model('tiny-target') gives the built-in "
                            "model's path")


def test_a_hub_looking_name_that_is_nowhere_says_both(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as e:
        load_config("nobody-here/no-model")          # no nobody-here/ folder: it may be a hub id
    msg = str(e.value)
    assert msg.startswith("cannot load a model config from 'nobody-here/no-model': it is neither a directory "
                          f"here (relative paths resolve from {tmp_path}) nor a model the hub or its cache holds")


def test_local_directories_resolve_to_absolute_paths(tmp_path, monkeypatch):
    t, _ = make_pair(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    rel = os.path.relpath(t, tmp_path)
    assert resolve_model_path(rel) == t
    assert load_config(rel).vocab_size == 97
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_path("~/" + rel) == t
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"     # a hub id stays one
