"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): proposals looked up in what the
traffic has produced before, without a model.

Two sources of matches:

- each running request's own tokens (prompt and output so far), in a ``SequenceMatches``
  (what a suffix tree of that request would propose, without building one): the repeats
  within a request, as prompt lookup finds them, but the continuation seen most often wins;
- one global ``SuffixTree`` over the outputs of the last ``suffix_cache_requests`` finished
  requests, each after the tail of its prompt a match can reach (first in, first out, and
  fewer while it holds more than ``suffix_max_nodes``):
  what other requests emitted, so best-of-n samples, retries and agents that repeat
  themselves propose what an earlier answer said.

A sequence proposes the better of the two candidates (``speculate``:
a longer match proposes more, up to its ``proposal_len``; nothing past a path chance below
``suffix_min_prob``), or nothing where neither matches. Each proposal carries its score,
the number of its tokens expected to be accepted, for ``proposer="draft+suffix"`` to
weigh it against the draft model's.

The proposer runs in the driver's process, beside the scheduler: it reads each sequence's
tokens from the ``Sequence`` itself, and a request's index only ever grows by tokens the
target emitted (never by proposals), so nothing is rolled back and a preempted request
keeps its index. Proposals are deterministic: the rejection sampler treats them as one-hot.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import TYPE_CHECKING

from specray.scheduler.config import SpeculationConfig
from specray.scheduler.messages import Proposals, StepPlan
from specray.scheduler.proposal_choice import ScoreRecord, common_prefix
from specray.scheduler.proposers.proposer import HostProposer
from specray.scheduler.proposers.sequence_matches import SequenceMatches
from specray.scheduler.proposers.suffix_tree import Candidate, SuffixTree
from specray.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from specray.scheduler.step import StepOutcome

# Bytes of one tree node as CPython holds it (its count, its slot in the children list,
# a small children dict, its entry in its parent's): measured once, for metrics().
NODE_BYTES = 8 + 8 + sys.getsizeof({0: 1}) + 8


class SuffixProposer(HostProposer):
    def __init__(self, speculation: SpeculationConfig) -> None:
        self.spec = speculation
        self.requests: dict[int, SequenceMatches] = {}
        self.cache = SuffixTree(speculation.suffix_max_depth)
        self._order: deque[int] = deque()           # cached requests, oldest first
        # Per source, how far its stated scores held; a proposal's score is its path's
        # chances times its source's calibration.
        self.records = {"own": ScoreRecord(), "global": ScoreRecord()}
        self._proposed: dict[int, tuple[str, Candidate]] = {}   # seq id -> its last proposal, and whence

    def propose_plan(self, plan: StepPlan, seqs: list[Sequence]) -> Proposals:
        return self.propose(plan.step_id, seqs)

    def propose(self, step_id: int, seqs: list[Sequence]) -> Proposals:
        """Proposals for ``seqs``, each up to its ``proposal_len``, in a ``[n, width]`` grid
        (width: the longest proposal_len), with their scores."""
        t0 = time.perf_counter()
        width = max((s.proposal_len for s in seqs), default=0)
        lens, tokens, scores = [], [], []
        for seq in seqs:
            source, cand = self._candidate(seq)
            found = cand.tokens if cand is not None else []
            lens.append(len(found))
            tokens += found + [-1] * (width - len(found))
            scores.append(cand.score * self.records[source].calibration if cand is not None else 0.0)
            if cand is not None:
                self._proposed[seq.seq_id] = (source, cand)
            else:
                self._proposed.pop(seq.seq_id, None)
        return Proposals(step_id=step_id, width=width, has_probs=False, compute_s=time.perf_counter() - t0,
                         seq_ids=[s.seq_id for s in seqs], proposal_lens=lens, token_ids=tokens, scores=scores)

    def observe(self, outcome: StepOutcome) -> None:
        """Every verified sequence's last proposal judged (``judge``)."""
        for v in outcome.verdicts:
            self.judge(v.seq_id, v.tokens)

    def judge(self, seq_id: int, emitted) -> None:
        """The target emitted ``emitted`` for ``seq_id`` this step: its last proposal is
        judged against them whether it was verified or another proposer's was. Where the
        draft's was, the emitted tokens are the target's own (its greedy tokens, or a draw
        from its distribution: the rejection sampler is lossless), and a one-hot proposal
        is accepted exactly as far as it agrees with such tokens, so each step judges every
        proposal, not only the ones chosen. Past the emitted tokens nothing is known: a
        proposal that agrees with all of them counts as one of that length."""
        last = self._proposed.pop(seq_id, None)
        if last is None or not emitted:
            return
        source, cand = last
        agreed = common_prefix(cand.tokens, emitted)
        judged = agreed if agreed == len(emitted) else len(cand.tokens)
        self.records[source].observe(sum(cand.chances[:judged]), agreed)

    def ceiling(self) -> float:
        """The most a proposal of n tokens can score is n times this."""
        return max(r.calibration for r in self.records.values())

    def fade(self) -> None:
        """A step that asked nothing of it: its records age (see ``ScoreRecord.fade``)."""
        for r in self.records.values():
            r.fade()

    def _candidate(self, seq: Sequence) -> tuple[str, Candidate | None]:
        own = self.requests.get(seq.seq_id)
        if own is None:
            own = self.requests[seq.seq_id] = SequenceMatches(self.spec.suffix_max_depth)
        known = own.num_tokens
        if known < seq.num_tokens:
            own.extend(seq.tokens[known:])
        spec = self.spec
        n, min_prob, factor = seq.proposal_len, spec.suffix_min_prob, spec.suffix_spec_factor
        cands = [("own", own.speculate(n, min_prob, factor))]
        if self.cache.num_nodes:
            cands.append(("global", self.cache.speculate(seq.tokens[-spec.suffix_max_depth:], n, min_prob, factor)))
        cands = [(src, c) for src, c in cands if c is not None]
        return max(cands, key=lambda sc: sc[1].score * self.records[sc[0]].calibration, default=("own", None))

    def finished(self, seq: Sequence) -> None:
        """A request ended with its output: the output joins the global tree (the
        oldest cached requests leave to make room) and its own index goes."""
        self.requests.pop(seq.seq_id, None)
        self._proposed.pop(seq.seq_id, None)
        if self.spec.suffix_cache_requests == 0:
            return
        # Its output, after as much of its prompt as a match can reach: what later requests
        # repeat is what a request emitted, and its prompt's tail is how they get there
        # (a retried prompt ends the same way). The whole prompt would cost as many nodes
        # again, for matches the requests' own indexes find.
        self.cache.extend(seq.seq_id, list(seq.tokens[max(0, seq.prompt_len - self.spec.suffix_max_depth + 1):]))
        self._order.append(seq.seq_id)
        while self._order and (len(self._order) > self.spec.suffix_cache_requests
                               or self.cache.num_nodes > self.spec.suffix_max_nodes):
            self.cache.remove(self._order.popleft())

    def forget(self, seq_ids) -> None:
        """Requests that ended without an output worth keeping (failed, aborted)."""
        for sid in seq_ids:
            self.requests.pop(sid, None)
            self._proposed.pop(sid, None)

    def stats(self) -> dict:
        own = self.requests.values()
        return {"suffix_cached_requests": len(self._order), "suffix_cache_nodes": self.cache.num_nodes,
                "suffix_request_tokens": sum(m.num_tokens for m in own),
                "suffix_tree_bytes": self.cache.num_nodes * NODE_BYTES + sum(m.num_bytes for m in own)}
