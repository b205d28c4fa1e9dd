"""The adaptive policy: each sequence's ``proposal_len`` chosen for goodput (expected
emitted tokens per second of step time).

- Each sequence keeps discounted acceptance counts; its rate leans on the draft's recent
  rate across sequences (``shrinkage`` pseudo-proposals of it), and its j-th proposal is
  worth ``rate ** j`` expected tokens.
- An online model of step time (``StepCostModel``), fitted from the runtime's own steps,
  prices a choice; for each level ``m`` (the draft's passes, the step's width)
  ``LevelChoices`` finds the proposal lengths with the most expected tokens per second,
  and the best level wins, which may be 0: speculation off for the whole step.

Invariants: ``decide`` never returns more than a sequence's ``proposal_limit`` nor more
than ``num_speculative_tokens``; it reads nothing but the view and the outcomes, so output
is the target's whatever it chooses. Per-sequence state is kept for the sequences of the
last view only. What each mechanism was measured to be worth, and the ones removed for
lack of it: docs/history.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.scheduler.adaptive.acceptance import AcceptanceEstimate, gains
from specray.scheduler.adaptive.config import AdaptiveConfig
from specray.scheduler.adaptive.level_choice import LevelChoices
from specray.scheduler.adaptive.step_cost import StepCostModel
from specray.scheduler.config import SpeculationConfig
from specray.scheduler.speculation_policy import Decision, PolicyView
from specray.scheduler.step import StepOutcome


@dataclass
class AdaptivePolicy:
    config: AdaptiveConfig
    cost: StepCostModel = field(default_factory=StepCostModel)
    # Every sequence's observations together: a new sequence starts from what the draft
    # has been doing lately rather than from a fixed guess.
    overall: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    estimates: dict[int, AcceptanceEstimate] = field(default_factory=dict)   # seq id -> its counts
    # The last choice and what it was computed from: with speculation off nothing it reads
    # moves between most steps, and the choice is then all the policy costs a step.
    _last: tuple | None = field(default=None, repr=False)

    @classmethod
    def of(cls, speculation: SpeculationConfig) -> "AdaptivePolicy":
        return cls(AdaptiveConfig.of(speculation))

    # -- the policy interface --------------------------------------------------------
    def decide(self, view: PolicyView) -> Decision:
        self.estimates = {sid: self.estimates.get(sid) or AcceptanceEstimate() for sid in view.seq_ids}
        lens = self.choose(view.proposal_limits, [self.estimates[s] for s in view.seq_ids], view.fed_tokens)
        spec = self.config.speculation
        k = spec.num_speculative_tokens
        # Newcomers join the running batch's choice; into an empty batch, the one the batch
        # they make would get from the draft's recent rate.
        newcomer = min(round(sum(lens) / len(lens)), k) if lens else self.fresh_len(view.batch_size)
        off = spec.disable_by_batch_size
        if off is not None and view.batch_size >= off:
            newcomer = 0
        return Decision(lens, newcomer_proposal_len=newcomer)

    def observe(self, outcome: StepOutcome) -> None:
        n = len(outcome.verdicts)
        t = outcome.times
        if n and not outcome.lost_workers:
            step = outcome.step
            self.cost.observe_target(n, step.target_fed, outcome.proposed, outcome.longest, t.verify_s)
            if t.draft_s is not None:
                self.cost.observe_draft(n, outcome.longest, step.draft_fed, outcome.proposed, t.draft_s)
            self.cost.observe_overhead(n, t.step_s - (t.draft_s or 0.0) - t.verify_s)
        cfg = self.config
        for v in outcome.verdicts:
            if not v.proposed:
                continue
            self.estimates.setdefault(v.seq_id, AcceptanceEstimate()).observe(v.proposed, v.accepted, cfg.decay)
            self.overall.observe(v.proposed, v.accepted, cfg.overall_decay)

    # -- the choice ------------------------------------------------------------------
    def choose(self, limits: list[int], estimates: list[AcceptanceEstimate], fed_tokens: int) -> list[int]:
        """Each sequence's proposal_len, given its limit and acceptance counts;
        ``fed_tokens``: tokens the batch feeds the target besides proposals."""
        spec = self.config.speculation
        n = len(limits)
        if spec.disable_by_batch_size is not None and n >= spec.disable_by_batch_size:
            return [0] * n
        limits = [min(c, spec.num_speculative_tokens) for c in limits]
        rates = self.rates(estimates)
        price = self.cost.price(n, fed_tokens)
        key = (tuple(limits), tuple(rates), price)
        if self._last is None or self._last[0] != key:
            self._last = (key, self._best(LevelChoices(gains(rates, limits), price), n))
        return list(self._last[1])

    def fresh_len(self, num_seqs: int) -> int:
        """The proposal_len of ``num_seqs`` new sequences arriving together into an empty
        batch, as the batch they form would decode at the draft's recent rate."""
        n = max(1, num_seqs)
        k = self.config.speculation.num_speculative_tokens
        rate = self.rates([AcceptanceEstimate()])[0]
        return max(self._best(LevelChoices(gains([rate] * n, [k] * n), self.cost.price(n, n)), n), default=0)

    def rates(self, estimates: list[AcceptanceEstimate]) -> list[float]:
        """Each sequence's acceptance rate: its own counts plus ``shrinkage``
        pseudo-proposals at the draft's recent rate across sequences."""
        cfg = self.config
        overall = min(max(self.overall.rate(cfg.prior_acceptance), 1e-3), 1.0 - 1e-3)
        return [e.rate(overall, cfg.shrinkage) for e in estimates]

    @staticmethod
    def _best(levels: LevelChoices, n: int) -> list[int]:
        """The choice of the speculating level with the best goodput, where it beats plain
        decoding's; else nobody proposes."""
        best = max((m for m in levels.rates if m), key=lambda m: levels.rates[m], default=0)
        return levels.ks(best) if best and levels.rates[best] >= levels.rates[0] else [0] * n
