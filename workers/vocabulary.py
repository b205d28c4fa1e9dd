"""Whether a draft's tokenizer speaks the target's token ids.

A draft and a target need not have the same ``vocab_size``: checkpoints sharing one
tokenizer pad their embedding matrices differently (Qwen2.5-0.5B: 151936 rows, Qwen2.5-7B:
152064, for 151665 tokens). What speculation needs is that a token id means the same
token to both, for every id both can score: ids below the smaller ``vocab_size``. Ids
that only one tokenizer maps (padding rows, extra added tokens) are not compared; which
tokens each names its eos, bos or pad may differ too (a base target with an instruct
draft), as long as every id both map is the same token.

The draft worker keeps the rest exact: it proposes only ids below the target's
``vocab_size`` and gives its probabilities over the target's vocabulary (see
``draft_worker``).
"""

from __future__ import annotations


def id_to_token(tokenizer, size: int) -> list[str | None]:
    """``[size]``: the token each id below ``size`` maps to (None where none does),
    added tokens included. One pass over the vocabulary (150k entries: tens of ms)."""
    out: list[str | None] = [None] * size
    for token, i in tokenizer.get_vocab().items():
        if 0 <= i < size:
            out[i] = token
    return out


def vocabulary_mismatch(target_tok, draft_tok, shared: int) -> str | None:
    """None if the two tokenizers agree on every id below ``shared`` that both map;
    otherwise what differs: how many ids and the first few, with both tokens."""
    a, b = id_to_token(target_tok, shared), id_to_token(draft_tok, shared)
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x is not None and y is not None and x != y]
    if not differ:
        return None
    shown = ", ".join(f"id {i} is {a[i]!r} to the target and {b[i]!r} to the draft" for i in differ[:3])
    return f"{len(differ)} of the {shared} shared token ids differ ({shown})"


def check_pair(target: str, draft: str, target_vocab: int, draft_vocab: int, target_tok, draft_tok) -> None:
    """Refuse a pair whose tokenizers (where both are there) disagree on a shared id.

    Raises ValueError naming both models, their tokenizers and what differs."""
    if target_tok is None or draft_tok is None:
        return
    why = vocabulary_mismatch(target_tok, draft_tok, min(target_vocab, draft_vocab))
    if why is not None:
        raise ValueError(f"draft {draft!r} ({_describe(draft_vocab, draft_tok)}) and target {target!r} "
                         f"({_describe(target_vocab, target_tok)}) do not share a tokenizer: {why}")


def _describe(vocab_size: int, tok) -> str:
    return f"vocab_size {vocab_size}, tokenizer {type(tok).__name__} of {len(tok)} tokens"
