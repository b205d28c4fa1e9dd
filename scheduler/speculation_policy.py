"""How many tokens each sequence should propose this step.

Static: ``k_i = k`` wherever the limits allow (optionally 0 for everyone once the batch
reaches ``disable_by_batch_size``).

Adaptive (goodput): each sequence keeps discounted counts of its own proposals; its
per-token acceptance probability ``a_i`` is those counts shrunk towards the draft's recent
rate across sequences, as far as sequences have been measured to differ (empirical Bayes,
scheduler.acceptance.RateSpread: on the built-in pair they differ persistently but
modestly, and a rate that trusts a sequence's last few steps silences good sequences
after one unlucky step). Its j-th proposal gains about ``a_i^j`` expected tokens
(calibrated against what deeper proposals actually got accepted). The online cost model
of step time (scheduler.step_cost) prices a choice of ``k_i``. For each level
``m = max k_i`` (the draft's passes) scheduler.level_choice finds the choice with the most
expected tokens per second exactly (candidate tokens in order of gain while they pay,
plus the cheapest way to reach depth m); the level whose best choice is best wins, which
may be level 0: speculation off when verifying extra tokens costs more than they return
(large batches).

A sequence alone in the batch (``stop_early``) proposes up to its cap, which may reach
``alone_k_max`` (past ``k_max``, the most a sequence in a larger batch proposes), and its
draft stops once the chance that all its proposals so far are accepted (the draft's
probability of each, calibrated against what the target accepted:
scheduler.draft_confidence) times its rate falls below the break-even gain of one more
proposal: the model's goodput of the chosen level times what one more proposal costs (a
pass and a verified token). No rate sees which proposals the draft is unsure of, and at
batch 1 no policy built on rates can beat the best fixed k by more than about 1 % on the
built-in pair (its acceptance is not bursty, and a 64-token request is too short to
learn its own best k); in ``specray bench`` at batch 1 (32 prompts) adaptive ran 0.88-0.97
of static k in three runs without this and 0.96-1.03 in five with it. In a larger batch the stops
are not used: a pass is shared, the rule above misprices it, and they measured 3-9 %
lower at batch 32.

Stops are also why a sequence alone may reach further than a batch: a fixed k must
stop where the average text stops paying, a stopping draft only where this text does.
In process on the built-in pair at batch 1 (ratios to static k = 4 within repeats,
geometric means): with k_max = 4 / 6 / 8 / 10 for every batch size, adaptive ran 1.04 /
1.11 / 1.18 / 1.13 where static k = 6 / 8 / 10 ran 1.10 / 1.10 / 0.98 (30 prompts); with
k_max = 4 and alone_k_max = 4 / 8 / 12 / 16, 0.99 / 1.07 / 1.05 / 1.05 where static
k = 6 ran 0.99 (48 prompts, on one runtime). Capped at k = 4, adaptive could only trim
the fixed k's proposals, not follow the easy stretches past it. In a batch a deeper
level is the rate-based choice's to make, and k_max keeps it where it was measured.

A sequence whose draft keeps failing drops to 0 and is probed with one token after
``probe_interval`` quiet steps, so it can come back (one that never proposed is not: the
draft's recent rate across sequences already speaks for it); each failed probe doubles the wait
(up to ``max_probe_interval``), a success resets it. Probes of all quiet sequences happen
in the same steps: a draft call serves them together instead of one every step.

A model fitted only from the steps its own choices produce cannot tell apart costs that
always move together (with every sequence at level m, ``n``, ``sum k_i`` and ``n * m``
are proportional) and would price the levels it never runs from its prior. So every
``explore_levels_every``-th speculating step (a trial slot) runs the best choice at
another level, the one waiting longest, nearest first: enough to keep the per-level costs
measured, and a level that looked bad on a few early steps gets measured again. A trial
costs a step at a worse level (at batch 1 on the bench prompt, level 1 emits half of
level 4's tokens), so like probes they back off: a level that is still not the best after
its trial waits twice as many slots for the next one (up to ``max_level_wait``), and
comes back to every slot once it has been the best.

How levels compare has a measured word too (``LevelCorrection``): the cost model tells a
draft pass's price from the draft call's only through steps at several levels, so each
level's figure is scaled by how its trial steps' measured time has compared with the
model's, relative to the running level's steps of the same moment (the machine's speed
drifts for every level alike). The level trials above keep every level measured.

On or off for the whole batch has a measured last word: ``GoodputSwitch`` scales the
model's expected goodput of each mode by how far its step times for that mode have been
off at this batch size, runs whichever mode is ahead and tries the other one now and then.
Both check time only: what sequences emit is their acceptance estimates' business, and a
ratio of emitted to expected tokens per batch size or level would credit it with the
sequences that happened to run there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.scheduler.acceptance import AcceptanceEstimate, DepthCalibration, RateSpread
from specray.scheduler.draft_confidence import ConfidenceCalibration
from specray.scheduler.goodput_switch import GoodputSwitch
from specray.scheduler.level_choice import LevelChoices
from specray.scheduler.level_correction import LevelCorrection
from specray.scheduler.step_cost import StepCostModel, StepPrice, batch_bucket

POLICIES = ("static", "adaptive")


@dataclass
class SpeculationPolicy:
    kind: str = "static"
    k_max: int = 4                   # the most a sequence proposes (alone: alone_k_max)
    disable_by_batch_size: int | None = None
    prior_acceptance: float = 0.6
    decay: float = 0.98              # a sequence's last fifty-odd steps count
    overall_decay: float = 0.99      # about the last hundred, across sequences
    probe_interval: int = 16
    max_probe_interval: int = 256
    explore_levels_every: int = 16   # 0: never run another level
    max_level_wait: int = 8          # trial slots between a losing level's trials, at most
    cost: StepCostModel = field(default_factory=StepCostModel)
    switch: GoodputSwitch = field(default_factory=GoodputSwitch)
    # Every sequence's observations together: a new sequence starts from what the draft
    # has been doing lately rather than from a fixed guess.
    overall: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    depth: DepthCalibration = field(default_factory=DepthCalibration)
    spread: RateSpread = field(default_factory=RateSpread)
    levels: LevelCorrection = field(default_factory=LevelCorrection)
    stop_early: bool = True          # adaptive, batch 1: the draft stops where proposing stops paying
    alone_k_max: int | None = None   # with stop_early, the cap of a sequence alone (None: k_max)
    confidence: ConfidenceCalibration = field(default_factory=ConfidenceCalibration)
    _calls: int = 0
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
    # ((price, level correction state), per_level, best).
    _gains: tuple | None = None
    _levels: tuple | None = None

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"speculation_policy must be one of {POLICIES}, got {self.kind!r}")
        if self.alone_k_max is not None and self.alone_k_max < self.k_max:
            raise ValueError(f"alone_k_max {self.alone_k_max} must be >= k_max {self.k_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"acceptance decay must be in (0, 1], got {self.decay}")

    def choose(self, caps: list[int], estimates: list[AcceptanceEstimate], fed_tokens: int) -> list[int]:
        """k_i per sequence given each one's cap (what max_tokens, max_model_len and the
        draft's window allow) and acceptance estimate; ``fed_tokens``: tokens the batch
        feeds the target besides proposals."""
        n = len(caps)
        self._break_even = 0.0
        if self.disable_by_batch_size is not None and n >= self.disable_by_batch_size:
            return [0] * n
        # Caps come from the scheduler's widest step: a sequence alone, whose draft stops
        # early, may reach alone_k_max; anyone else k_max.
        limit = self.widest_k if n == 1 else self.k_max
        caps = [min(c, limit) for c in caps]
        if self.kind == "static":
            return caps
        # What each sequence's proposals are worth changes only when somebody's outcome
        # comes in, and the price of a step only when the cost model re-solves: with
        # speculation off, most steps see neither, and the policy's own time is then all
        # it costs over plain decoding.
        state = self._valuation_inputs(caps, estimates)
        if self._gains is None or self._gains[0] != (state, self.spread.observations):
            # The spread measures each state of the batch once: counting an unchanged
            # cross-section again every quiet step would only overweight it.
            self.spread.observe(estimates)
            rates = self._rates(estimates)
            gains = self.depth.gains(rates, caps, estimates, self.spread.weight)
            self._gains = ((state, self.spread.observations), rates, gains)
            self._levels = None
        rates, gains = self._gains[1:]
        price = self.cost.price(n, fed_tokens)
        # The level ranking also reads the level correction, which moves only when a
        # speculating step is observed: it renews the ranking, not the gains.
        ranking = (price, self.levels.observations)
        if self._levels is None or self._levels[0] != ranking:
            per_level = LevelChoices(gains, price)
            self._levels = (ranking, per_level, self._best_level(n, per_level))
        per_level, best = self._levels[1:]
        for e, rate in zip(estimates, rates):
            e.assumed_rate = rate
        level = 0
        alone = self.stop_early and n == 1
        if best and self.switch.speculate(n, per_level.rates[best], per_level.rates[0]):
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
        self._calls += 1
        if self._calls % self.probe_interval == 0:
            for i in range(n):
                # Probe sequences that have gone quiet after failing, so a recovering draft
                # is noticed. Not those that never proposed: the overall rate already
                # speaks for them, and a first probe would cost the draft a whole prefill.
                e = estimates[i]
                if (chosen[i] == 0 and caps[i] > 0 and (e.accepted or e.rejected)
                        and e.steps_without_proposal >= (e.quiet_limit or self.probe_interval)):
                    chosen[i] = 1
        # The final choice's price, for the switch and the level correction to check.
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
    def widest_k(self) -> int:
        """The longest proposal this policy ever chooses: the scheduler's lookahead."""
        if self.kind == "adaptive" and self.stop_early and self.alone_k_max is not None:
            return self.alone_k_max
        return self.k_max

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
        return self.confidence.reach_map()

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
        alone = self.stop_early and n == 1
        cap = min(cap, self.widest_k if alone else self.k_max)
        rates = self._rates([AcceptanceEstimate()]) * n
        price = self.cost.price(n, n)
        per_level = LevelChoices(self.depth.gains(rates, [cap] * n), price)
        best = self._best_level(n, per_level)
        figure = per_level.rates
        if not best or self.switch.goodput(n, True, figure[best]) < self.switch.goodput(n, False, figure[0]):
            return 0
        if alone:
            self._break_even = self._break_even_at(figure[best], price)
            return cap
        return max(per_level.ks(best))

    def observe_step(self, num_seqs: int, fed_tokens: int, proposed: int, emitted: int, seconds: float,
                     draft_catch_up: int = 0, longest: int | None = None) -> None:
        """A whole step's outcome, for the on/off switch and the level correction (which
        counts only steps that ran a level the policy chose). Only decode steps count: a step
        that also prefills (more than about one fed token per sequence) says nothing about
        speculation and would make whichever mode it ran in look slow. So does a step
        whose batch is not the one the policy chose for (a preemption shrank it), and one
        priced before its batch size had measurements of its own: the prior's or a
        neighbour's price can be off several times over, the cost model soon corrects
        itself from the same steps, and those ratios would linger in the switch's sums
        (after a bench's first batch of 32, plain decoding there counted as 0.62 of what
        the refitted model expects of it, for runs on end).

        ``draft_catch_up``: tokens the draft was fed beyond the one per drafting sequence
        that the step's price assumes: mostly what it skipped while not proposing (a
        newcomer's whole context), plus the second token after a wholly accepted proposal.
        Their price comes off the step's time, so the measured time and the price describe
        the same step. The catch-up is paid once when speculation resumes; left in, it made
        the switch's every trial of speculation after a stretch of plain decoding look
        slower than speculating runs (in the bench, batch 1 then decoded plain for most of
        its steps: 1.6 accepted tokens per step against static k's 4.0).

        ``proposed`` and ``longest`` (None: as chosen) are what the drafts proposed: a
        draft that stopped early made a cheaper step than the one chosen, and it is priced
        as made. Priced as chosen, a bad draft's stops (one proposal where four were
        chosen) made every trial of speculation look faster than the model expects, and
        the switch kept trying it."""
        expected, self._expected = self._expected, None
        if not (self.kind == "adaptive" and num_seqs and fed_tokens <= 2 * num_seqs
                and expected is not None and expected[0] == num_seqs):
            return
        if draft_catch_up > 0:
            seconds -= self.cost.draft_fed_price(num_seqs) * draft_catch_up
        if seconds > 0:
            predicted = expected[1] if longest is None else expected[3].time(proposed, longest)
            self.switch.observe(num_seqs, proposed > 0, emitted, seconds, predicted)
            if proposed:
                self.levels.observe(num_seqs, expected[2], seconds, predicted)

    def observe(self, estimate: AcceptanceEstimate, proposed: int, accepted: int,
                confidence: list[float] | None = None) -> None:
        """One sequence-step's outcome, for that sequence's estimate and the overall one;
        ``confidence``: the draft's probability of each proposal, when it reported them."""
        if proposed and estimate.steps_without_proposal >= (estimate.quiet_limit or self.probe_interval):
            # This was a probe: back off after a failure, come back fully after a success.
            limit = estimate.quiet_limit or self.probe_interval
            estimate.quiet_limit = self.probe_interval if accepted else min(2 * limit, self.max_probe_interval)
        if proposed and self.kind == "adaptive":
            # What the choice assumed: this sequence's rate before this outcome (computed
            # now for a proposal no rate-based choice made: a newcomer's). A static policy
            # prices nothing, so it keeps no calibration: none of this on its step loop.
            rate = estimate.assumed_rate
            self.depth.observe(self._rates([estimate])[0] if rate is None else rate, proposed, accepted,
                               estimate.last_full)
            if confidence:
                self.confidence.observe(confidence, accepted)
        estimate.assumed_rate = None
        estimate.observe(proposed, accepted, self.decay)
        if proposed:
            self.overall.observe(proposed, accepted, self.overall_decay)

    def _valuation_inputs(self, caps: list[int], estimates: list[AcceptanceEstimate]) -> tuple:
        """What the proposals' values read, compared by value: a change made behind the
        policy's back counts as much as an observation."""
        return (tuple(caps), self.overall.rate(self.prior_acceptance), self.depth.observations,
                [(e.accepted, e.rejected, e.last_full) for e in estimates])

    def _rates(self, estimates: list[AcceptanceEstimate]) -> list[float]:
        """Each sequence's acceptance rate: its own counts, shrunk towards the draft's
        recent rate across sequences as far as sequences have been seen to differ."""
        return self.spread.rates(estimates, self.overall.rate(self.prior_acceptance))

    def _best_level(self, num_seqs: int, per_level: LevelChoices) -> int:
        """The speculating level whose figure, as measured to hold up, is best (0 when
        none is possible). On against off is left to the switch, which gets the model's
        own figure for this level."""
        speculating = [m for m in per_level.rates if m]
        if not speculating:
            return 0
        factors = self.levels.factors(num_seqs, speculating)
        return max(speculating, key=lambda m: per_level.rates[m] * factors[m])

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
                wait = min(2 * self._level_trials.get((tb, tm), (1, 0))[0], self.max_level_wait)
                self._level_trials[(tb, tm)] = (wait, slot + wait)
        if not self.explore_levels_every:
            return best
        self._level_choices += 1
        if self._level_choices % self.explore_levels_every:
            return best
        slot = self._level_choices // self.explore_levels_every
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
