"""Where a worker's step meets structured output: the target's masks for a verify pass,
computed on a host thread while the forward runs, and the draft's masks pass by pass.

Both sides build their ``GrammarBook`` on the first plan that constrains a sequence (the
tokenizer's grammar vocabulary costs about a second for a large vocabulary, and a worker
that never sees a grammar never pays it). Their matchers live where the sampling happens,
in the worker's own process, so nothing but the plan's spec and output tokens
(``StepPlan.grammar_lens``) crosses a process boundary.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from specray.scheduler.messages import StepPlan
from specray.workers.grammar import GrammarBook, allows, apply_bitmask, tokenizer_for


class GrammarSide:
    """One worker's structured output: ``tokenizer_path`` names the target (whose ids both
    models share), ``vocab_size`` is the width its masks cover (the target's logits)."""

    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.path = tokenizer_path
        self.vocab_size = vocab_size
        self._book: GrammarBook | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def book(self, plan: StepPlan) -> GrammarBook | None:
        """The book, built on the first plan that needs it; frees are applied to it."""
        if self._book is None and plan.grammar_lens and any(plan.grammar_lens):
            self._book = GrammarBook(tokenizer_for(self.path, self.vocab_size))
        if self._book is not None and plan.free_seq_ids and not plan.grammar_lens:
            for sid in plan.free_seq_ids:
                self._book.matchers.pop(sid, None)
        return self._book if plan.grammar_lens else None

    # -- the target -----------------------------------------------------------------
    def start_verify_masks(self, plan: StepPlan, proposal_lens: list[int]) -> Future | None:
        """Starts the verify pass's masks (``GrammarBook.verify_masks``) on a host thread;
        None when the plan constrains nothing."""
        self._settle()
        book = self.book(plan)
        if book is None:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specray-grammar")

        self._pending = self._pool.submit(book.verify_masks, plan, proposal_lens)
        return self._pending

    def finish_verify_masks(self, started: Future | None, logits: torch.Tensor) -> float:
        """Waits for the masks and applies them to the verify pass's ``logits``
        ``[sum(proposal_lens) + n, V]``; returns the seconds this added to the step (what
        was left of filling them once the forward was done, and applying them)."""
        if started is None:
            return 0.0
        t0 = time.perf_counter()
        self._pending = None
        apply_bitmask(logits, started.result())
        return time.perf_counter() - t0

    def _settle(self) -> None:
        # A step that raised under its masks' thread: that thread finishes (and rolls its
        # matchers back) before anything touches them again.
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except Exception:  # noqa: BLE001, S110 - it was told with its own step
                pass

    # -- the draft ------------------------------------------------------------------
    def draft_masks(self, plan: StepPlan, scored: int) -> DraftMasks | None:
        """The masks of one ``propose`` call (``scored``: the ids the draft scores), or None
        when the plan constrains nothing it proposes for."""
        self._settle()
        book = self.book(plan)
        if book is None:
            return None
        matchers = book.sync(plan)
        if not any(m is not None and p > 0 for m, p in zip(matchers, plan.proposal_lens)):
            return None
        return DraftMasks(book, matchers, scored)


class DraftMasks:
    """A draft's passes under its sequences' grammars: before pass p samples, each
    constrained row is masked in the state after its p proposals so far, so the proposals
    are drawn from the masked draft distribution, the q the target verifies against.
    A row stops being masked after it proposes an end (EOS), or where the grammar allows
    nothing the draft scores (a draft with a smaller vocabulary): its q is then the
    unmasked one it really samples from, and the target rejects what it must. ``close``
    rolls every matcher back to where the call found it.

    The seam for any proposer that samples pass by pass in a worker (the draft model's
    ``_passes``; an EAGLE head's loop likewise): ``GrammarSide.draft_masks(plan, scored)``
    once per call, ``mask(p, rows, logits, proposals)`` before each pass samples, and the
    ``q`` it returns computed from the masked logits; ``close()`` at the end."""

    def __init__(self, book: GrammarBook, matchers: list, scored: int) -> None:
        self.book = book
        self.matchers = matchers
        self.scored = scored
        self.eos = set(book.tokenizer.ll.eos_tokens)
        self.consumed = [0] * len(matchers)
        self.live = [m is not None for m in matchers]
        self.last: dict[int, tuple[np.ndarray, int]] = {}      # row -> (the mask it sampled under, its row)
        self.seconds = 0.0

    def mask(self, p: int, rows: list[int], logits: torch.Tensor, proposals: torch.Tensor) -> None:
        """Masks ``logits`` ``[len(rows), scored]`` of pass ``p`` in place; ``rows``: the
        batch rows it scores; ``proposals`` ``[n, width]``: the passes before it."""
        t0 = time.perf_counter()
        guided = [(j, i) for j, i in enumerate(rows) if self.live[i]]
        if p > 0 and guided:
            tokens = proposals[torch.tensor([i for _, i in guided], device=proposals.device), p - 1].tolist()
            for (_, i), t in zip(guided, tokens):
                bm, row = self.last[i]
                if t in self.eos or not allows(bm, row, t):
                    self.live[i] = False      # past an end, or a proposal not drawn under the mask
                    continue
                self.matchers[i].consume_token(t)
                self.consumed[i] += 1
            guided = [(j, i) for j, i in guided if self.live[i]]
        if guided:
            bm = np.empty((len(guided), self.book.tokenizer.words), dtype=np.int32)
            self.book.fill([self.matchers[i] for _, i in guided], bm)
            # Rows whose allowed tokens all lie past what the draft scores stay unmasked.
            bits = np.unpackbits(bm.view(np.uint8), axis=1, bitorder="little")[:, :self.scored]
            keep = bits.any(axis=1)
            for k, (_, i) in enumerate(guided):
                if keep[k]:
                    self.last[i] = (bm, k)
                else:
                    self.live[i] = False
            sel = [k for k in range(len(guided)) if keep[k]]
            if sel:
                apply_bitmask(logits, bm[sel], torch.tensor([guided[k][0] for k in sel], device=logits.device))
        self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        for m, c in zip(self.matchers, self.consumed):
            if c:
                m.rollback(c)
        self.consumed = [0] * len(self.matchers)
