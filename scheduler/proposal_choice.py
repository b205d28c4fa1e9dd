"""Several proposers, one verified window: which proposal of a sequence the target checks
(``specray.scheduler.proposers.merged.MergedProposer`` makes the choice with these).

With ``proposer="draft+suffix"`` the draft model and suffix decoding both propose for
every drafting sequence, and the target verifies one proposal per sequence: the one
expected to have more tokens accepted. Suffix decoding states its own expectation (its
``Proposals.scores``: the sum of its path's chances, scaled per tree by how far its
verified scores have held, ``ScoreRecord``: counts of one or two occurrences state chances
of 1 that code continuations do not keep); the draft model's is its measured acceptance
rate ``a`` across sequences, ``a + a^2 + ... + a^m`` for ``m`` proposals.

The choice reads only the draft's record and the suffix tree's counts, never the draft's
sampled tokens, so each verified proposal is still a draw from its own proposer and the
rejection sampler keeps the target's distribution.

When the suffix proposal wins, the draft model has still cached its own proposals (all
but the last): only as many of them as the emitted tokens start with hold
(``draft_kept``), and the draft is fed the rest next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from specray.scheduler.adaptive.acceptance import AcceptanceEstimate, gains
from specray.scheduler.messages import Proposals


@dataclass
class DraftRecord:
    """The draft model's acceptance across sequences, over the proposals the target
    verified: the adaptive policy's discounted counts, with a prior."""

    prior: float = 0.6
    prior_weight: float = 4.0
    decay: float = 0.99
    counts: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)

    def observe(self, proposed: int, accepted: int) -> None:
        self.counts.observe(proposed, accepted, self.decay)

    @property
    def accepted(self) -> float:
        return self.counts.accepted

    @property
    def rate(self) -> float:
        return self.counts.rate(self.prior, self.prior_weight)

    def expected(self, proposal_len: int) -> float:
        """Tokens of ``proposal_len`` draft proposals expected to be accepted."""
        return self.expected_upto(proposal_len)[proposal_len]

    def expected_upto(self, longest: int) -> list[float]:
        """``expected(n)`` for n = 0..longest, computed once (a step asks it of every
        drafting sequence)."""
        return [0.0, *accumulate(gains([self.rate], [longest])[0])]


@dataclass
class ScoreRecord:
    """How far a scoring proposer's stated expectations held, over its verified
    proposals: discounted accepted tokens over discounted scores."""

    prior_weight: float = 4.0          # in stated tokens, at a calibration of 1
    decay: float = 0.99
    accepted: float = 0.0
    scored: float = 0.0

    def observe(self, score: float, accepted: int) -> None:
        self.accepted = self.accepted * self.decay + accepted
        self.scored = self.scored * self.decay + score

    def fade(self) -> None:
        """A step without its proposals: the evidence ages, and the calibration drifts
        back toward 1."""
        self.accepted *= self.decay
        self.scored *= self.decay

    @property
    def calibration(self) -> float:
        return (self.accepted + self.prior_weight) / (self.scored + self.prior_weight)


def pick_shards(seq_ids: list[int], shards: list[Proposals], record: DraftRecord) -> dict[int, int]:
    """Sequence id -> the index of the shard whose proposal the target verifies. A shard
    with ``scores`` states its own expectation; one without is the draft model's, valued
    by ``record``. Ties go to the draft model (its probabilities make sampling cheaper to
    accept); a sequence in one shard only takes that one."""
    wanted = set(seq_ids)
    best: dict[int, tuple[float, int, int]] = {}
    for s, shard in enumerate(shards):
        for r, sid in enumerate(shard.seq_ids):
            if sid not in wanted:
                continue
            n = shard.proposal_lens[r]
            value = shard.scores[r] if shard.scores else record.expected(n)
            key = (value if n else -1.0, not shard.scores, -s)
            if sid not in best or key > best[sid][0:3]:
                best[sid] = (*key, s)
    return {sid: b[3] for sid, b in best.items()}


def common_prefix(a: list[int], b: tuple[int, ...] | list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
