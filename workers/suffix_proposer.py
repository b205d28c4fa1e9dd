"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): proposals looked up in what the
traffic has produced before, without a model.

Two kinds of ``SuffixTree``:

- one per running request, over its own tokens (prompt and output so far): the repeats
  within a request, as prompt lookup finds them, but the continuation seen most often wins;
- one global tree over the whole sequences of the last ``suffix_cache_requests`` finished
  requests (first in, first out, and fewer while it holds more than ``suffix_max_nodes``):
  what other requests emitted, so best-of-n samples, retries and agents that repeat
  themselves propose what an earlier answer said.

A sequence proposes the better of the two trees' candidates (``SuffixTree.speculate``:
a longer match proposes more, up to its ``proposal_len``; nothing past a path chance below
``suffix_min_prob``), or nothing where neither matches. Each proposal carries its score,
the number of its tokens expected to be accepted, for ``proposer="draft+suffix"`` to
weigh it against the draft model's.

The proposer runs in the driver's process, beside the scheduler: it reads each sequence's
tokens from the ``Sequence`` itself, and a request's tree only ever grows by tokens the
target emitted (never by proposals), so nothing is rolled back and a preempted request
keeps its tree. Proposals are deterministic: the rejection sampler treats them as one-hot.
"""

from __future__ import annotations

import sys
import time
from collections import deque

from specray.scheduler.config import SpeculationConfig
from specray.scheduler.messages import Proposals
from specray.scheduler.sequence import Sequence
from specray.workers.suffix_tree import Candidate, SuffixTree

# Bytes of one tree node as CPython holds it (its count, its slot in the children list,
# a small children dict, its entry in its parent's): measured once, for metrics().
NODE_BYTES = 8 + 8 + sys.getsizeof({0: 1}) + 8


class SuffixProposer:
    def __init__(self, speculation: SpeculationConfig) -> None:
        self.spec = speculation
        self.requests: dict[int, SuffixTree] = {}
        self.cache = SuffixTree(speculation.suffix_max_depth)
        self._order: deque[int] = deque()           # cached requests, oldest first

    def propose(self, step_id: int, seqs: list[Sequence]) -> Proposals:
        """Proposals for ``seqs``, each up to its ``proposal_len``, in a ``[n, width]`` grid
        (width: the longest proposal_len), with their scores."""
        t0 = time.perf_counter()
        width = max((s.proposal_len for s in seqs), default=0)
        lens, tokens, scores = [], [], []
        for seq in seqs:
            cand = self._candidate(seq)
            found = cand.tokens if cand is not None else []
            lens.append(len(found))
            tokens += found + [-1] * (width - len(found))
            scores.append(cand.score if cand is not None else 0.0)
        return Proposals(step_id=step_id, width=width, has_probs=False, compute_s=time.perf_counter() - t0,
                         seq_ids=[s.seq_id for s in seqs], proposal_lens=lens, token_ids=tokens, scores=scores)

    def _candidate(self, seq: Sequence) -> Candidate | None:
        tree = self.requests.get(seq.seq_id)
        if tree is None:
            tree = self.requests[seq.seq_id] = SuffixTree(self.spec.suffix_max_depth)
        known = tree.num_tokens
        if known < seq.num_tokens:
            tree.extend(seq.seq_id, seq.tokens[known:])
        context = seq.tokens[-self.spec.suffix_max_depth:]
        spec = self.spec
        cands = [t.speculate(context, seq.proposal_len, spec.suffix_min_prob, spec.suffix_spec_factor)
                 for t in (tree, self.cache)]
        return max((c for c in cands if c is not None), key=lambda c: c.score, default=None)

    def finished(self, seq: Sequence) -> None:
        """A request ended with its output: its whole sequence joins the global tree (the
        oldest cached requests leave to make room) and its own tree goes."""
        self.requests.pop(seq.seq_id, None)
        if self.spec.suffix_cache_requests == 0:
            return
        if seq.seq_id in self.cache:        # cannot happen twice, but the cache stays exact if it does
            self.cache.remove(seq.seq_id)
            self._order.remove(seq.seq_id)
        self.cache.extend(seq.seq_id, list(seq.tokens))
        self._order.append(seq.seq_id)
        while self._order and (len(self._order) > self.spec.suffix_cache_requests
                               or self.cache.num_nodes > self.spec.suffix_max_nodes):
            self.cache.remove(self._order.popleft())

    def forget(self, seq_ids) -> None:
        """Requests that ended without an output worth keeping (failed, aborted)."""
        for sid in seq_ids:
            self.requests.pop(sid, None)

    def stats(self) -> dict:
        nodes = self.cache.num_nodes + sum(t.num_nodes for t in self.requests.values())
        return {"suffix_cached_requests": len(self._order), "suffix_cache_nodes": self.cache.num_nodes,
                "suffix_request_nodes": nodes - self.cache.num_nodes, "suffix_tree_bytes": nodes * NODE_BYTES}
