"""Grammar matchers and token masks, on the worker that samples.

A constrained sequence's tokens are sampled from its model's distribution with the
tokens the grammar forbids masked out of the logits *before* temperature, top-k and
top-p: the target's ``p_j`` and the draft's ``q_j`` at every position are then the
distributions plain constrained decoding samples from, and the rejection sampler, fed
these masked ``p`` and ``q`` unchanged, emits exactly the target's masked distribution
(the speculative-sampling theorem holds for any ``q`` the proposals were really drawn
from). A proposal the grammar forbids (an n-gram or suffix proposal, never a masked
draft's) has ``p = 0`` and is rejected with certainty; the residual at that position is
then ``p`` itself.

Masks per sequence and step, with ``m`` its ``proposal_len``::

    state after its output so far (s_0) --x_1--> s_1 --x_2--> ... --x_m--> s_m
    mask rows:  M_0                      M_1            ...          M_m      (m + 1)

``M_j`` is filled in ``s_j``; the matcher then rolls back to ``s_0`` (it advances only on
emitted tokens, which the next plan brings: ``GrammarBook.sync``). Rows past a forbidden
proposal are left all-allowed: the sampler never reaches them.

The engine is llguidance (``docs/structured-output.md``: why). Masks are int32 bitmasks
``[rows, ceil(V/32)]`` (bit ``t % 32`` of word ``t // 32`` set: token t allowed), filled on
the host and unpacked on the logits' device (``apply_bitmask``: the one place any
sampler, the draft's, the target's or an EAGLE head's, masks its logits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy as lnp
import numpy as np
import torch

from specray.scheduler.messages import StepPlan
from specray.scheduler.structured_output import StructuredOutput, check_grammar
from specray.workers import transformers_import
from specray.workers.errors import PlanError

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class GrammarTokenizer:
    """A model's vocabulary as llguidance sees it: ``vocab_size`` ids (the model's logits
    width), the EOS ids a grammar may end with."""

    ll: llguidance.LLTokenizer
    vocab_size: int

    @classmethod
    def build(cls, hf_tokenizer, vocab_size: int, eos_ids: list[int] | None = None) -> GrammarTokenizer:
        """Hugging Face fast tokenizers, and byte-level ones (the built-in pair's ByT5:
        ids ``offset + b`` for the bytes ``b``, special tokens first). Any other is a
        ValueError naming structured_output."""
        eos = eos_ids or ([hf_tokenizer.eos_token_id] if hf_tokenizer.eos_token_id is not None else None)
        if getattr(hf_tokenizer, "backend_tokenizer", None) is not None:
            try:
                # Imported here, not at module level: it imports transformers, which a
                # worker that never builds a grammar's tokenizer does not need.
                from_tokenizer = transformers_import.attr("llguidance.hf", "from_tokenizer")
                return cls(from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos), vocab_size)
            except ValueError as e:      # llguidance knows byte-level BPE and similar decoders, not all
                raise ValueError(f"structured_output cannot use the model's tokenizer: {e}") from None
        offset = len(hf_tokenizer) - 256
        if offset < 0 or hf_tokenizer("az", add_special_tokens=False)["input_ids"] != [ord("a") + offset,
                                                                                         ord("z") + offset]:
            raise ValueError(f"structured_output needs a fast tokenizer or a byte-level one; the model's is "
                             f"{type(hf_tokenizer).__name__}")
        wrapper = _ByteVocabulary(offset, eos[0] if eos else 0,
                                  [t.encode() for t in hf_tokenizer.convert_ids_to_tokens(list(range(offset)))])
        return cls(llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=eos),
                   vocab_size)

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def encode(self, text: str) -> list[int]:
        return self.ll.tokenize_str(text)


class _ByteVocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: each id's bytes and an encoder."""

    def __init__(self, offset: int, eos: int, specials: list[bytes]) -> None:
        self.offset = offset
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = specials + [bytes([b]) for b in range(256)]
        self.special_token_ids = list(range(offset))

    def __call__(self, data: bytes) -> list[int]:
        return [b + self.offset for b in data]


@functools.lru_cache(maxsize=8)
def tokenizer_for(path: str, vocab_size: int) -> GrammarTokenizer:
    """The grammar vocabulary of the model at ``path`` (its tokenizer, its config's EOS
    ids), built once per process: wrapping a large vocabulary takes about a second."""
    from specray.workers import model_loader

    eos = model_loader.eos_token_ids(model_loader.load_config(path))
    return GrammarTokenizer.build(model_loader.load_tokenizer(path), vocab_size, eos or None)


def check_for_model(spec: StructuredOutput, path: str, vocab_size: int) -> None:
    """Refuses (``ValueError`` naming structured_output) a spec the model at ``path``
    cannot follow: its tokenizer is not one a grammar can drive, or the grammar is
    invalid against its vocabulary. The driver asks before it admits a request."""
    try:
        tokenizer = tokenizer_for(path, vocab_size)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - no tokenizer at all: transformers' own error types
        raise ValueError(f"structured_output needs the target's tokenizer: {type(e).__name__}: {e}") from None
    check_grammar(spec, tokenizer.ll)


@functools.lru_cache(maxsize=256)
def _grammar(key: str) -> str:
    return check_grammar(StructuredOutput.from_key(key))


@dataclass
class _Matcher:
    key: str
    matcher: llguidance.LLMatcher
    consumed: list[int] = field(default_factory=list)


class GrammarBook:
    """One worker's matchers, one per constrained sequence, each kept at the state after
    the sequence's output so far (``sync``)."""

    def __init__(self, tokenizer: GrammarTokenizer) -> None:
        self.tokenizer = tokenizer
        self.matchers: dict[int, _Matcher] = {}
        self.executor = llguidance.LLExecutor()

    def sync(self, plan: StepPlan) -> list[llguidance.LLMatcher | None]:
        """Per sequence of ``plan``: its matcher brought to exactly its output so far
        (rolled back past what differs, then advanced), or None where it is unconstrained.
        Matchers of freed sequences are dropped. An output the grammar refuses is a
        PlanError naming the sequence."""
        for sid in plan.free_seq_ids:
            self.matchers.pop(sid, None)
        if not plan.grammar_lens:
            return [None] * plan.num_seqs
        out: list[llguidance.LLMatcher | None] = []
        g = o = 0
        for sid, glen, olen in zip(plan.seq_ids, plan.grammar_lens, plan.output_lens):
            if not glen:
                out.append(None)
                continue
            key = bytes(plan.grammar_bytes[g:g + glen]).decode()
            tokens = plan.output_token_ids[o:o + olen]
            g, o = g + glen, o + olen
            entry = self.matchers.get(sid)
            if entry is None or entry.key != key:
                entry = self.matchers[sid] = _Matcher(key, llguidance.LLMatcher(self.tokenizer.ll, _grammar(key)))
            have = entry.consumed
            same = len(have) if tokens[:len(have)] == have else next(
                i for i, (a, b) in enumerate(zip(have, tokens)) if a != b)
            if same < len(have):
                entry.matcher.rollback(len(have) - same)
                del have[same:]
            if len(tokens) > same:
                if not entry.matcher.consume_tokens(tokens[same:]):
                    self.matchers.pop(sid)
                    raise PlanError(f"sequence {sid}: its output leaves its structured_output grammar "
                                    f"({entry.matcher.get_error()[:200]})")
                have += tokens[same:]
            out.append(entry.matcher)
        return out

    def verify_masks(self, plan: StepPlan, proposal_lens: list[int]) -> np.ndarray | None:
        """The target's masks: int32 ``[sum(proposal_lens) + n, words]``, sequence i's
        ``proposal_lens[i] + 1`` rows back to back (the verify pass's logit rows), all-allowed
        for unconstrained sequences and past a forbidden proposal; None when the plan
        constrains nothing."""
        matchers = self.sync(plan)
        if not any(m is not None for m in matchers):
            return None
        bm = np.full((sum(proposal_lens) + plan.num_seqs, self.tokenizer.words), -1, dtype=np.int32)
        drafted, plain, row, w = [], [], 0, plan.width
        for i, (m, p) in enumerate(zip(matchers, proposal_lens)):
            if m is not None and p:
                drafted.append((m, row, plan.proposal_token_ids[i * w:i * w + p]))
            elif m is not None:
                plain.append((m, row))
            row += p + 1
        # Advances each matcher through its proposals as far as they are allowed, filling
        # a row in every state, and rolls it back: the matchers end where they began.
        if drafted:
            lnp.fill_next_token_bitmask_par_with_draft_tokens(self.executor, drafted, bm)
        if plain:
            lnp.fill_next_token_bitmask_par(self.executor, plain, bm)
        return bm

    def fill(self, matchers: list[llguidance.LLMatcher], bm: np.ndarray) -> None:
        """Row j of ``bm`` for ``matchers[j]`` in its current state."""
        lnp.fill_next_token_bitmask_par(self.executor, [(m, j) for j, m in enumerate(matchers)], bm)


def allows(bm: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bm[row, token >> 5]) >> (token & 31)) & 1)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray | torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """Forbidden tokens' logits set to -inf, in place: row ``j`` of ``bitmask`` (int32
    ``[R, words]``) masks row ``rows[j]`` of ``logits`` (``[N, V]``; all rows in order when
    ``rows`` is None). Columns past the mask's width are forbidden; mask bits past ``V``
    are ignored (a draft scores fewer ids than the target's vocabulary)."""
    bm = torch.as_tensor(bitmask).to(logits.device, non_blocking=True)
    vocab = logits.shape[-1]
    allowed = ((bm.unsqueeze(-1) >> _BITS.to(bm.device)) & 1).bool().view(bm.shape[0], -1)   # [R, words*32]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab]                                                             # [R, V]
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
