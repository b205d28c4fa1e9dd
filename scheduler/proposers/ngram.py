"""Prompt-lookup (n-gram) proposals: no model, just the sequence's own history.

It keeps each sequence's tokens the way a draft model keeps KV: truncated to
``num_computed`` and extended with the fed tokens each step, plus its own proposals but
the last, exactly like a draft's cache, so the driver's ``num_computed`` bookkeeping is the
same for both. Proposals are deterministic (the sampler treats them as one-hot).
"""

from __future__ import annotations

import time

from specray.scheduler.config import SpeculationConfig
from specray.scheduler.messages import Proposals, StepPlan
from specray.scheduler.proposers.proposer import HostProposer
from specray.scheduler.sequence import Sequence


class NgramProposer(HostProposer):
    def __init__(self, speculation: SpeculationConfig) -> None:
        """Matches n-grams of ``speculation.ngram_max`` down to ``ngram_min`` tokens."""
        self.max_ngram = speculation.ngram_max
        self.min_ngram = speculation.ngram_min
        self.history: dict[int, list[int]] = {}

    def propose_plan(self, plan: StepPlan, seqs: list[Sequence]) -> Proposals:
        return self.propose(plan)[0]

    def propose(self, plan: StepPlan) -> tuple[Proposals, None]:
        t0 = time.perf_counter()
        for sid in plan.free_seq_ids:
            self.history.pop(sid, None)
        width = plan.width
        lens: list[int] = []
        tokens: list[int] = []
        start = 0
        for i, sid in enumerate(plan.seq_ids):
            hist = self.history.setdefault(sid, [])
            computed, m = plan.num_computed[i], plan.num_new[i]
            if computed > len(hist):
                raise RuntimeError(f"sequence {sid}: {computed} tokens claimed cached, {len(hist)} held")
            del hist[computed:]
            hist.extend(plan.token_ids[start:start + m])
            start += m
            found = self.lookup(hist, plan.proposal_lens[i])
            hist.extend(found[:-1])
            lens.append(len(found))
            tokens.extend(found + [-1] * (width - len(found)))
        return Proposals(step_id=plan.step_id, width=width, has_probs=False, compute_s=time.perf_counter() - t0,
                         seq_ids=list(plan.seq_ids), proposal_lens=lens, token_ids=tokens), None

    def lookup(self, hist: list[int], proposal_len: int) -> list[int]:
        """Continuation of the most recent earlier occurrence of the longest suffix
        n-gram (max_ngram down to min_ngram), up to ``proposal_len`` tokens."""
        if proposal_len <= 0:
            return []
        size = len(hist)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            pattern = hist[size - n:]
            last = pattern[-1]
            for end in range(size - 2, n - 2, -1):   # end: index of the match's last token
                if hist[end] == last and hist[end - n + 1:end + 1] == pattern:
                    return hist[end + 1:end + 1 + proposal_len]
        return []
