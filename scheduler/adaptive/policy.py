"""The adaptive policy: each sequence's k_i chosen for goodput (expected emitted tokens per
second of step time).

- Each sequence has discounted acceptance counts (``AcceptanceEstimate``), shrunk towards
  the draft's recent rate across sequences as far as sequences are measured to differ
  (``RateSpread``); its j-th proposal gains about ``a_i^j`` expected tokens, calibrated
  against what deeper proposals actually got accepted (``DepthCalibration``).
- An online model of step time (``StepCostModel``) prices a choice; for each level
  ``m = max k_i`` (the draft's passes) ``LevelChoices`` finds the choice with the most
  expected tokens per second, and the best level wins, which may be 0 (speculation off).
- On against off for the whole batch is checked against measured step times
  (``GoodputSwitch``); now and then a step runs another speculating level, so the cost
  model sees several.
- A sequence alone proposes up to ``max_speculative_tokens`` and its draft stops once
  the calibrated chance that all its proposals so far pass (``ConfidenceCalibration``)
  times its rate falls below what one more proposal costs.
- A sequence whose draft keeps failing drops to 0; it proposes again only when the
  draft's rate across sequences, which its shrunk rate leans on, recovers.

Invariants: ``decide`` never returns more than a cap, nor more than k for a batch of two
or more; where a draft stops depends only on proposals already drawn, so output keeps
the target's distribution. See docs/adaptive-policy.md for the measurements behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.scheduler.adaptive.acceptance import AcceptanceEstimate, DepthCalibration, RateSpread
from specray.scheduler.adaptive.config import AdaptiveConfig
from specray.scheduler.adaptive.draft_confidence import ConfidenceCalibration
from specray.scheduler.adaptive.goodput_switch import GoodputSwitch
from specray.scheduler.adaptive.level_choice import LevelChoices
from specray.scheduler.adaptive.step_cost import StepCostModel, StepPrice, batch_bucket
from specray.scheduler.speculation_policy import Decision, PolicyOutcome, PolicyView


# Lifts of 1 at every depth and no per-sequence depth counts: a^j as the rate says.
_UNCALIBRATED = DepthCalibration()


@dataclass
class AdaptivePolicy:
    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    cost: StepCostModel = field(default_factory=StepCostModel)
    switch: GoodputSwitch = field(default_factory=GoodputSwitch)
    # Every sequence's observations together: a new sequence starts from what the draft
    # has been doing lately rather than from a fixed guess.
    overall: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    depth: DepthCalibration = field(default_factory=DepthCalibration)
    spread: RateSpread = field(default_factory=RateSpread)
    confidence: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    # seq id -> its acceptance estimate, from its first decision to its finish
    estimates: dict[int, AcceptanceEstimate] = field(default_factory=dict)
    _level_choices: int = 0          # speculating choices, for level exploration
    # (batch bucket, level) -> (trial slots it waits between trials, the slot it is next
    # due); absent: every slot, due now. The trial in flight as (bucket, level, slot).
    _level_trials: dict = field(default_factory=dict)
    _trial: tuple[int, int, int] | None = None
    # (n, seconds, level, price) the model expects of the last choice; None when its price
    # was not measured yet (see observe_step)
    _expected: tuple[int, float, int, StepPrice] | None = None
    # Expected tokens one more proposal must bring to pay for itself this step (0: no
    # early stops), see min_reach.
    _break_even: float = 0.0
    # The last valuation: ((inputs, spread state), rates, gains), and for those gains,
    # (price, per_level, best).
    _gains: tuple | None = None
    _levels: tuple | None = None

    # -- the policy interface --------------------------------------------------------
    def decide(self, view: PolicyView) -> Decision:
        estimates = [self.estimates.setdefault(sid, AcceptanceEstimate()) for sid in view.seq_ids]
        ks = self.choose(view.caps, estimates, view.fed_tokens)
        cfg = self.config
        if ks:
            # Within k: a sequence alone may plan further, but a newcomer makes a batch.
            newcomer = min(round(sum(ks) / len(ks)), cfg.k)
        else:
            # Nothing running to go by: what the model would give a fresh sequence. Not k
            # regardless: with a draft that has been failing, every newcomer would cost the
            # draft a prefill for proposals that will be rejected.
            newcomer = self.fresh_k(view.lookahead, view.batch_size)
        limit = cfg.disable_by_batch_size
        if limit is not None and view.batch_size >= limit:
            newcomer = 0
        decision = Decision(ks, newcomer_len=newcomer)
        if self.stopping:
            decision.min_reach = [self.min_reach(e) for e in estimates]
            decision.newcomer_min_reach = self.min_reach(AcceptanceEstimate())
            decision.reach_map = self.reach_map()
        return decision

    def observe(self, outcome: PolicyOutcome) -> None:
        n = len(outcome.sequences)
        if n and not outcome.lost_workers:
            self.cost.observe_target(n, outcome.target_fed, outcome.proposed, outcome.longest, outcome.verify_s)
            if outcome.draft_s is not None:
                # ``longest`` and ``proposed`` are the passes and tokens the drafts made:
                # fewer than chosen where one stopped early.
                self.cost.observe_draft(n, outcome.longest, outcome.draft_fed, outcome.proposed, outcome.draft_s)
        for s in outcome.sequences:
            estimate = self.estimates.setdefault(s.seq_id, AcceptanceEstimate())
            self.observe_sequence(estimate, s.proposed, s.accepted, s.confidence)
            if s.finished:
                del self.estimates[s.seq_id]
        for sid in outcome.forgotten:
            self.estimates.pop(sid, None)
        if not outcome.lost_workers:
            # Beyond the one token per drafting sequence that the step's price assumes.
            catch_up = outcome.draft_fed - outcome.num_drafting
            self.observe_step(n, outcome.target_fed, outcome.proposed, outcome.emitted, outcome.step_s, catch_up,
                              outcome.longest)
            self.cost.observe_overhead(n, outcome.step_s - (outcome.draft_s or 0.0) - outcome.verify_s)
        else:
            self._expected = None

    def choose(self, caps: list[int], estimates: list[AcceptanceEstimate], fed_tokens: int) -> list[int]:
        """k_i per sequence given each one's cap (what max_tokens, max_model_len and the
        draft's window allow) and acceptance estimate; ``fed_tokens``: tokens the batch
        feeds the target besides proposals."""
        n = len(caps)
        self._break_even = 0.0
        cfg = self.config
        if cfg.disable_by_batch_size is not None and n >= cfg.disable_by_batch_size:
            return [0] * n
        # Caps come from the scheduler's lookahead: a sequence alone, whose draft stops
        # early, may reach max_speculative_tokens; anyone else k.
        limit = self.lookahead if n == 1 else cfg.k
        caps = [min(c, limit) for c in caps]
        # What each sequence's proposals are worth changes only when somebody's outcome
        # comes in, and the price of a step only when the cost model re-solves: with
        # speculation off, most steps see neither, and the policy's own time is then all
        # it costs over plain decoding.
        state = self._valuation_inputs(caps, estimates)
        if self._gains is None or self._gains[0] != (state, self.spread.observations):
            # The spread measures each state of the batch once: counting an unchanged
            # cross-section again every quiet step would only overweight it.
            if self.config.rate_spread:
                self.spread.observe(estimates)
            rates = self._rates(estimates)
            calibrated = self.config.depth_calibration
            gains = self._depth().gains(rates, caps, estimates if calibrated else None, self.spread.weight)
            self._gains = ((state, self.spread.observations), rates, gains)
            self._levels = None
        rates, gains = self._gains[1:]
        price = self.cost.price(n, fed_tokens)
        # A new price re-ranks the levels from the same gains.
        if self._levels is None or self._levels[0] != price:
            per_level = LevelChoices(gains, price)
            self._levels = (price, per_level, self._best_level(per_level))
        per_level, best = self._levels[1:]
        for e, rate in zip(estimates, rates):
            e.assumed_rate = rate
        level = 0
        alone = self.config.stop_early and n == 1
        if best and self._speculate(n, per_level.rates[best], per_level.rates[0]):
            # A sequence alone proposes up to its cap whatever the level: a trial of
            # another level would run the same step, priced at that level's goodput.
            level = best if alone else self._explore_levels(n, best, per_level)
        alone = alone and level > 0
        chosen = per_level.ks(level)
        if alone:
            # Alone in the batch, the draft's passes are its own: each proposal costs a pass
            # and a verified token, and the stop below prices them one by one, knowing the
            # draft's doubts. The rate-based choice would cut the same doubtful tail twice.
            chosen = list(caps)
        # The final choice's price, for the switch to check.
        self._expected = ((n, price.time(sum(chosen), max(chosen, default=0)), level, price)
                          if self.cost.fitted(n, any(chosen)) else None)
        if alone:
            self._break_even = self._break_even_at(per_level.rates[level], price)
        return chosen

    @staticmethod
    def _break_even_at(goodput: float, price: StepPrice) -> float:
        """What one more proposal must gain alone: the step's goodput times a pass and a
        verified token (see min_reach)."""
        return goodput * (price.per_token + price.per_pass)

    @property
    def lookahead(self) -> int:
        """The longest proposal this policy ever chooses: the scheduler's lookahead."""
        return self.config.lookahead

    @property
    def stopping(self) -> bool:
        """Whether the last choice's drafts get floors (see min_reach)."""
        return self._break_even > 0

    def min_reach(self, estimate: AcceptanceEstimate) -> float:
        """The floor under which this sequence's draft stops proposing this step
        (``StepPlan.min_reach``): one more proposal gains about (the chance that all so far
        are accepted) x (its rate), and must gain the break-even. 0: never stop."""
        if not self._break_even:
            return 0.0
        rate = estimate.assumed_rate
        if rate is None:       # a newcomer: no choice of this step rated it
            rate = self._rates([estimate])[0]
        return min(1.0, self._break_even / rate) if rate > 0 else 1.0

    def reach_map(self) -> list[float]:
        """The draft probability's calibration for the draft workers (``StepPlan.reach_map``)."""
        return self.confidence.reach_map() if self.config.calibrate_confidence else []

    def fresh_k(self, cap: int, num_seqs: int = 1) -> int:
        """The k for ``num_seqs`` new sequences arriving together into an empty batch, as
        the batch they form would decode: their rate is the draft's recent rate across
        sequences, and on against off is judged at that batch size as the switch has
        measured it. Requests arriving together are not valued as if each were alone: at
        batch 1 speculation nearly always pays, and every newcomer's draft would prefill
        in a batch where it does not. No switch or exploration state is touched.

        One arriving alone is treated as ``choose`` treats a sequence alone: it gets its
        cap (up to ``alone_k_max``) and its draft a floor (``stopping``), so its first
        step, which prefills the draft too, stops where proposing stops paying."""
        n = max(1, num_seqs)
        alone = self.config.stop_early and n == 1
        cap = min(cap, self.lookahead if alone else self.config.k)
        rates = self._rates([AcceptanceEstimate()]) * n
        price = self.cost.price(n, n)
        per_level = LevelChoices(self._depth().gains(rates, [cap] * n), price)
        best = self._best_level(per_level)
        figure = per_level.rates
        if not best or not self._speculate(n, figure[best], figure[0], trial=False):
            return 0
        if alone:
            self._break_even = self._break_even_at(figure[best], price)
            return cap
        return max(per_level.ks(best))

    def observe_step(self, num_seqs: int, fed_tokens: int, proposed: int, emitted: int, seconds: float,
                     draft_catch_up: int = 0, longest: int | None = None) -> None:
        """A whole step's outcome, for the on/off switch. Only decode steps count: a step
        that also prefills (more than about one fed token per sequence) says nothing about
        speculation and would make whichever mode it ran in look slow. So does a step whose
        batch is not the one the policy chose for (a preemption shrank it), and one priced
        before its batch size had measurements of its own: that price can be off several
        times over, and the ratio would linger in the switch's sums.

        ``draft_catch_up``: tokens the draft was fed beyond the one per drafting sequence
        that the step's price assumes: mostly what it skipped while not proposing (a
        newcomer's whole context), plus the second token after a wholly accepted proposal.
        Their price comes off the step's time, so the measured time and the price describe
        the same step; left in, every trial of speculation after plain decoding looks slow.

        ``proposed`` and ``longest`` (None: as chosen) are what the drafts proposed: a
        draft that stopped early made a cheaper step than the one chosen, and it is priced
        as made. (Measurements: docs/adaptive-policy.md.)"""
        expected, self._expected = self._expected, None
        if not (num_seqs and fed_tokens <= 2 * num_seqs
                and expected is not None and expected[0] == num_seqs):
            return
        if draft_catch_up > 0:
            seconds -= self.cost.draft_fed_price(num_seqs) * draft_catch_up
        if seconds > 0:
            predicted = expected[1] if longest is None else expected[3].time(proposed, longest)
            self.switch.observe(num_seqs, proposed > 0, emitted, seconds, predicted)

    def observe_sequence(self, estimate: AcceptanceEstimate, proposed: int, accepted: int,
                         confidence: list[float] | None = None) -> None:
        """One sequence-step's outcome, for that sequence's estimate and the overall one;
        ``confidence``: the draft's probability of each proposal, when it reported them."""
        if proposed:
            # What the choice assumed: this sequence's rate before this outcome (computed
            # now for a proposal no rate-based choice made: a newcomer's). A static policy
            # prices nothing, so it keeps no calibration: none of this on its step loop.
            rate = estimate.assumed_rate
            self.depth.observe(self._rates([estimate])[0] if rate is None else rate, proposed, accepted,
                               estimate.last_full)
            if confidence:
                self.confidence.observe(confidence, accepted)
        estimate.assumed_rate = None
        estimate.observe(proposed, accepted, self.config.decay)
        if proposed:
            self.overall.observe(proposed, accepted, self.config.overall_decay)

    def _speculate(self, n: int, on: float, off: float, trial: bool = True) -> bool:
        """On against off at batch ``n`` from the model's figures of each mode: as the
        switch has measured them (``trial``: it may try the mode behind now and then)."""
        if not self.config.measured_switch:
            return on >= off
        if trial:
            return self.switch.speculate(n, on, off)
        return self.switch.goodput(n, True, on) >= self.switch.goodput(n, False, off)

    def _depth(self) -> DepthCalibration:
        return self.depth if self.config.depth_calibration else _UNCALIBRATED

    def _valuation_inputs(self, caps: list[int], estimates: list[AcceptanceEstimate]) -> tuple:
        """What the proposals' values read, compared by value: a change made behind the
        policy's back counts as much as an observation."""
        return (tuple(caps), self.overall.rate(self.config.prior_acceptance), self.depth.observations,
                [(e.accepted, e.rejected, e.last_full) for e in estimates])

    def _rates(self, estimates: list[AcceptanceEstimate]) -> list[float]:
        """Each sequence's acceptance rate: its own counts, shrunk towards the draft's
        recent rate across sequences as far as sequences have been seen to differ."""
        return self.spread.rates(estimates, self.overall.rate(self.config.prior_acceptance))

    @staticmethod
    def _best_level(per_level: LevelChoices) -> int:
        """The speculating level with the best expected goodput (0 when none is possible).
        On against off is left to the switch, which gets the model's figure for this level."""
        return max((m for m in per_level.rates if m), key=lambda m: per_level.rates[m], default=0)

    def _explore_levels(self, num_seqs: int, best: int, per_level: LevelChoices) -> int:
        """The best speculating level, or in a trial slot another one."""
        bucket = batch_bucket(num_seqs)
        # The best level is tried again at the first slot after it stops being the best.
        self._level_trials.pop((bucket, best), None)
        if self._trial is not None:
            tb, tm, slot = self._trial
            self._trial = None
            if tb == bucket and tm != best:
                # Its trial (observed by now) left it behind: wait longer for the next.
                wait = min(2 * self._level_trials.get((tb, tm), (1, 0))[0], self.config.max_level_wait)
                self._level_trials[(tb, tm)] = (wait, slot + wait)
        if not self.config.explore_levels_every:
            return best
        self._level_choices += 1
        if self._level_choices % self.config.explore_levels_every:
            return best
        slot = self._level_choices // self.config.explore_levels_every
        # Level 0 is not explored here: on against off is the switch's measurement.
        trials = {m: self._level_trials.get((bucket, m), (1, 0)) for m in per_level.rates if m and m != best}
        due = [m for m, (_, at) in trials.items() if at <= slot]
        if not due:
            return best
        # The one waiting longest, nearest first. Neighbours alone would leave a level two
        # away judged for good on the few noisy steps it ran early on.
        m = min(due, key=lambda m: (trials[m][1], abs(m - best), m))
        wait = trials[m][0]
        self._level_trials[(bucket, m)] = (wait, slot + wait)
        self._trial = (bucket, m, slot)
        return m
