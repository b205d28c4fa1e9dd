"""Draft and target at the same time: the engine's book of pre-drafts.

While the target verifies a window, each draft worker that can pre-draft drafts the next
window on the optimistic outcome of that verification (every proposal accepted, the bonus
token the draft's own top choice; ``Predraft`` can carry several branches a sequence, the
worker drafts one). The next step takes its proposals from there when every sequence of a
draft plan has a branch that holds (``specray.scheduler.predraft``); that worker is then
told which branches won (``adopt``), which also pre-drafts the step after. Otherwise the
plan is drafted as without overlap, and the pre-draft is dropped.

Pre-drafting pays only when a step is likely to use it: the book keeps the share of
sequences whose branch held, and a draft plan of ``n`` sequences is pre-drafted only while
that share to the ``n``-th power (every sequence holds) is at least ``min_use``. While it
is not, the share drifts back toward its prior, so a runtime whose early windows missed
probes again later instead of never pre-drafting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specray.scheduler.messages import Predraft, Proposals, StepPlan
from specray.scheduler.predraft import all_held, branches, window


@dataclass
class Taken:
    """A draft plan served from a pre-draft."""

    proposals: Proposals
    probs: Any                    # the pre-draft's probabilities handle (None when greedy)
    chosen: list[int]             # the branch of each sequence


@dataclass
class PredraftBook:
    min_use: float = 0.5
    prior: float = 0.7            # share of sequences whose branch holds, before any is seen
    hit_rate: float = 0.7         # share of sequences whose branch held
    decay: float = 0.95
    pending: dict[int, tuple[Predraft, Any]] = field(default_factory=dict)   # draft rank -> pre-draft

    def wanted(self, plan: StepPlan) -> bool:
        """Whether pre-drafting the outcomes of this draft plan's window is worth its work."""
        n = plan.num_seqs
        if n > 0 and plan.width > 0 and self.hit_rate ** n >= self.min_use:
            return True
        self.hit_rate += (1.0 - self.decay) * (self.prior - self.hit_rate)
        return False

    def take(self, rank: int, plan: StepPlan) -> tuple[Taken | None, int]:
        """The pre-drafted proposals for ``plan`` when every sequence's branch holds, and
        how many pre-drafted windows this drops (all of them, or those of sequences the
        plan does not draft)."""
        got = self.pending.pop(rank, None)
        if got is None:
            return None, 0
        pre, probs = got
        windows = len(set(pre.seq_ids))
        if pre.has_probs and pre.width != plan.width:
            # Its probabilities are [B, pre.width, V]; the step verifies [n, plan.width, V].
            return None, windows
        held = branches(plan, pre)
        for sid, b in zip(plan.seq_ids, held):
            if sid in pre.seq_ids:
                self.hit_rate = self.hit_rate * self.decay + (1.0 - self.decay) * (b is not None)
        chosen = all_held(held)
        if chosen is None:
            return None, windows
        return Taken(window(plan, pre, chosen), probs, chosen), windows - plan.num_seqs

    def drop(self) -> None:
        self.pending.clear()

