"""How long a text prompt can be and still fit the window, known from the tokenizer alone.

Tokenizing costs as much as the text is long, so a text that cannot fit is refused before
it is tokenized. The bound holds where every character of a text ends up in some token and
no token stands for more characters than its vocabulary entry spells:

- byte-level BPE (GPT-2's, Llama 3's, Qwen's): each byte of the text is one character of
  a token's entry, and a character is at least one byte;
- SentencePiece BPE with byte fallback (Llama 2's, Mistral's, Gemma's): a piece spells
  its characters (a space as "▁"), an unknown character falls back to "<0x..>" byte
  tokens, longer than it;
- ByT5's bytes, one token each;
- and nothing before them drops characters: no normalizer, or ones that keep them all
  (NFC and NFKC compose at most four code points into one: the bound grows fourfold).

Anything else can make a long text a few tokens -- a word-level model or WordPiece makes
an unknown word of any length one token, a pre-tokenizer may drop whitespace, a
SentencePiece model without byte fallback fuses unknown characters into one -- and then
there is no bound: such prompts are measured by tokenizing them.
"""

from __future__ import annotations

import json

# Normalizers that keep every character (and by how much they may shrink a text).
_KEEPING = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "NFC": 4, "NFKC": 4}
# Pre-tokenizers that split a text without dropping any of it.
_SPLITTING = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """The most characters a text of fewer than ``max_model_len`` tokens can have, or None
    where the tokenizer gives no bound (module docstring)."""
    per_token = chars_per_token(tokenizer)
    return None if per_token is None else max_model_len * per_token


def chars_per_token(tokenizer) -> int | None:
    """How many characters of a text one token stands for at most, or None."""
    if tokenizer is None:
        return None
    if type(tokenizer).__name__ == "ByT5Tokenizer":
        return _longest_entry(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None                       # a slow tokenizer of another kind: nothing known
    model = json.loads(backend.model.__getstate__())
    pre = _state(backend.pre_tokenizer)
    byte_level = any(p.get("type") == "ByteLevel" for p in _flat(pre, "pretokenizers"))
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    if not all(_keeps(p) for p in _flat(pre, "pretokenizers")):
        return None
    shrink = 1
    for n in _flat(_state(backend.normalizer), "normalizers"):
        kind = n.get("type")
        if kind == "Replace" and _replaces_in_kind(n):
            continue
        if kind not in _KEEPING:
            return None
        shrink = max(shrink, _KEEPING[kind])
    return shrink * _longest_entry(tokenizer)


def _longest_entry(tokenizer) -> int:
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _flat(state: dict | None, key: str) -> list[dict]:
    """A component's parts: a Sequence's, or itself."""
    if state is None:
        return []
    if state.get("type") == "Sequence":
        return [p for s in state.get(key, []) for p in _flat(s, key)]
    return [state]


def _keeps(pre: dict) -> bool:
    kind = pre.get("type")
    if kind in ("Split", "Punctuation"):
        return pre.get("behavior") != "Removed"
    return kind in _SPLITTING


def _replaces_in_kind(n: dict) -> bool:
    """A Replace of a fixed string by one at least as long (Llama 2's " " -> "▁")."""
    pattern = n.get("pattern", {})
    return "String" in pattern and len(n.get("content", "")) >= len(pattern["String"]) > 0
