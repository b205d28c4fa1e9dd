"""The longest text that can fit the window, from the tokenizer alone: checked against the
tokenizers themselves on texts made to be short in tokens (long words, whitespace runs,
combining marks, characters no piece spells), and refused where no bound holds."""

from __future__ import annotations

import random

import pytest
from specray_testing import word_tokenizer

from specray.runtime.driver.prompt_bound import chars_per_token, max_prompt_chars
from specray.runtime.model_store import builtin_model

CORPUS = ["def parse_args(argv):\n    return argv[1:]\n", "import os\nimport sys\n", "héllo wörld ✓ " * 3,
          "the quick brown fox jumps over the lazy dog"] * 20


def fast(tk):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def byte_level_bpe(normalizer=None):
    """GPT-2's kind, trained here on a small corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    if normalizer is not None:
        tk.normalizer = normalizer
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return fast(tk)


def sentencepiece_bpe(byte_fallback=True):
    """Llama 2's kind: "▁" for spaces, a few merged pieces, bytes for everything else."""
    from tokenizers import Tokenizer, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    pieces = ["▁", "a", "b", "d", "e", "f", "▁a", "ab", "▁ab", "de", "▁de", "▁def", "ef"]
    vocab.update({p: 257 + i for i, p in enumerate(pieces)})
    merges = [("▁", "a"), ("a", "b"), ("▁a", "b"), ("d", "e"), ("▁", "de"), ("▁de", "f"), ("e", "f")]
    tk = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=byte_fallback, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return fast(tk)


def texts(seed: int, n: int = 60) -> list[str]:
    """Texts made to be few tokens for their length, and ordinary ones."""
    rng = random.Random(seed)
    alphabet = "abdef ▁\n\t✓é" + "\u0301\u0308" + "가각" + "\U0001F600" + "xyz"
    out = ["a" * 500, " " * 500, "\u0301" * 300, "e" + "\u0301" * 300, "def " * 100, "<|endoftext|>" * 20,
           "\u1100\u1161\u11a8" * 50, "\u03b1\u0313\u0342\u0345" * 50]
    out += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200))) for _ in range(n)]
    out += CORPUS[:4]
    return out


def assert_bound_holds(tok, seed: int = 0) -> int:
    per_token = chars_per_token(tok)
    assert per_token is not None
    for text in texts(seed):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(text) <= per_token * max(len(ids), 1), (text[:40], len(ids), per_token)
    return per_token


def test_byte_level_bpe_bound_holds_on_texts_made_to_be_short():
    tok = byte_level_bpe()
    per_token = assert_bound_holds(tok)
    assert per_token == max(map(len, tok.get_vocab()))
    assert max_prompt_chars(tok, 100) == 100 * per_token


def test_a_composing_normalizer_makes_the_bound_fourfold():
    from tokenizers import normalizers

    plain, nfc = byte_level_bpe(), byte_level_bpe(normalizers.NFC())
    assert chars_per_token(nfc) == 4 * max(map(len, nfc.get_vocab()))
    assert_bound_holds(nfc, seed=1)
    assert chars_per_token(plain) < chars_per_token(nfc)


def test_sentencepiece_bpe_with_byte_fallback_bound_holds():
    assert_bound_holds(sentencepiece_bpe(), seed=2)


def test_byt5_bytes_bound_holds():
    from transformers import AutoTokenizer

    assert_bound_holds(AutoTokenizer.from_pretrained(builtin_model("tiny-target")), seed=3)


def test_no_bound_where_a_long_text_can_be_few_tokens():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    words = word_tokenizer(97)                      # whitespace dropped, an unknown word is one token
    assert len(words("w5" + " " * 1000 + "w9")["input_ids"]) == 2
    no_fallback = sentencepiece_bpe(byte_fallback=False)     # unknown characters fuse into one <unk>
    assert len(no_fallback("✓" * 1000, add_special_tokens=False)["input_ids"]) <= 2
    wordpiece = Tokenizer(models.WordPiece({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    squeezing = byte_level_bpe(normalizers.Replace("  ", " "))   # shrinks a text
    stripping = byte_level_bpe(normalizers.StripAccents())
    for tok in (words, no_fallback, fast(wordpiece), squeezing, stripping, None):
        assert chars_per_token(tok) is None
        assert max_prompt_chars(tok, 100) is None


@pytest.mark.parametrize("pre", ["WhitespaceSplit", "Removed"])
def test_a_pre_tokenizer_that_drops_text_gives_no_bound(pre):
    from tokenizers import Regex, pre_tokenizers

    tok = byte_level_bpe()
    drop = (pre_tokenizers.WhitespaceSplit() if pre == "WhitespaceSplit"
            else pre_tokenizers.Split(Regex(r"\s+"), behavior="removed"))
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([drop, pre_tokenizers.ByteLevel()])
    assert chars_per_token(tok) is None
