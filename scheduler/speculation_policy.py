"""How many tokens each sequence should propose this step.

Static: ``k_i = k`` wherever the limits allow (optionally 0 for everyone once the batch
reaches ``disable_by_batch_size``).

Adaptive (goodput): each sequence keeps a discounted estimate of its own per-token
acceptance probability ``a_i`` (accepted proposals over accepted + rejected ones; a step
that stops at the first rejection counts one rejection). Proposing ``j`` tokens then
yields ``E_i(j) = 1 + a_i + ... + a_i^j`` expected tokens. A cost model of step time,
fitted online from the runtime's own measured steps::

    T(k) = target(n, n + sum k_i) + [sum k_i > 0] * draft(max k_i, sum k_i)
    target(n, tokens) = t0 + t_seq * n + t_tok * tokens
    draft(passes, tokens) = d0 + d_pass * passes + d_tok * tokens

lets the policy pick the ``k_i`` that maximise expected emitted tokens per second for
the whole batch: candidate tokens (sequence i's j-th proposal gains ``a_i^j``) are taken
in order of gain, and the best prefix wins, which may be the empty one: speculation off
when verifying extra tokens costs more than they return (large batches). A sequence
whose draft keeps failing drops to 0 and is probed with one token after
``probe_interval`` quiet steps, so it can come back; each failed probe doubles the wait
(up to ``max_probe_interval``), a success resets it. Probes of all quiet sequences
happen in the same steps: a draft call serves them together instead of one every step.

The cost model can be wrong (a machine's step time is not linear in anything, and other
load moves it), so the last word on the whole batch is measured: ``GoodputSwitch`` keeps
the emitted tokens per second of recent decode steps with and without speculation, per
batch-size bucket, runs whichever mode is ahead and tries the other one now and then.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

POLICIES = ("static", "adaptive")


@dataclass
class AcceptanceEstimate:
    """Discounted counts of accepted and rejected proposals of one sequence."""

    accepted: float = 0.0
    rejected: float = 0.0
    steps_without_proposal: int = 0
    quiet_limit: int = 0             # quiet steps before the next probe (0: the policy's base)

    def rate(self, prior: float, prior_weight: float = 1.0) -> float:
        return (self.accepted + prior * prior_weight) / (self.accepted + self.rejected + prior_weight)

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        if proposed == 0:
            self.steps_without_proposal += 1
            return
        self.steps_without_proposal = 0
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1 if accepted < proposed else 0)


class LinearFit:
    """Least squares ``y ~ w . x`` over a sliding window, in plain Python (3-4 features).

    The normal equations are kept as running sums (a sample leaving the window is
    subtracted), and solved lazily when a prediction needs fresh weights: an observation
    costs O(features^2) on the step loop, not a pass over the window."""

    def __init__(self, num_features: int, window: int = 256, prior: list[float] | None = None) -> None:
        self.n = num_features
        self.window = window
        self.samples: deque[tuple[list[float], float]] = deque()
        self._weights = list(prior) if prior else [0.0] * num_features
        self._xtx = [[0.0] * num_features for _ in range(num_features)]
        self._xty = [0.0] * num_features
        self._dirty = False

    def add(self, x: list[float], y: float) -> None:
        self._accumulate(x, y, 1.0)
        self.samples.append((x, y))
        if len(self.samples) > self.window:
            self._accumulate(*self.samples.popleft(), -1.0)
        self._dirty = True

    def _accumulate(self, x: list[float], y: float, sign: float) -> None:
        for i in range(self.n):
            self._xty[i] += sign * x[i] * y
            row = self._xtx[i]
            for j in range(self.n):
                row[j] += sign * x[i] * x[j]

    @property
    def weights(self) -> list[float]:
        if self._dirty and len(self.samples) >= 2 * self.n:
            self._solve()
        return self._weights

    @weights.setter
    def weights(self, value: list[float]) -> None:
        self._weights = list(value)
        self._dirty = False

    def predict(self, x: list[float]) -> float:
        return sum(w * v for w, v in zip(self.weights, x))

    def _solve(self) -> None:
        self._dirty = False
        # A small ridge term: features are often collinear early on.
        a = [[v + 1e-9 * (i == j) for j, v in enumerate(row)] for i, row in enumerate(self._xtx)]
        w = _solve_linear(a, list(self._xty))
        if w is not None:
            # Step time never shrinks with more work: negative slopes are noise.
            self._weights = [max(v, 0.0) for v in w]


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-18:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                for j in range(c, n + 1):
                    m[r][j] -= f * m[c][j]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass
class StepCostModel:
    """Online model of a step's time; ``observe_*`` feed it measured seconds. Fed tokens
    (prefill, catch-up) and proposed tokens are separate features: a prompt's tokens cost
    differently from a few verified ones, and mixing them would mis-price speculation."""

    target: LinearFit = field(default_factory=lambda: LinearFit(4, prior=[1e-3, 1e-5, 1e-4, 1e-4]))
    draft: LinearFit = field(default_factory=lambda: LinearFit(4, prior=[5e-4, 1e-4, 1e-5, 1e-5]))

    @staticmethod
    def target_features(num_seqs: int, fed: int, proposed: int) -> list[float]:
        return [1.0, float(num_seqs), float(fed), float(proposed)]

    @staticmethod
    def draft_features(passes: int, fed: int, proposed: int) -> list[float]:
        return [1.0, float(passes), float(fed), float(proposed)]

    def observe_target(self, num_seqs: int, fed: int, proposed: int, seconds: float) -> None:
        self.target.add(self.target_features(num_seqs, fed, proposed), seconds)

    def observe_draft(self, passes: int, fed: int, proposed: int, seconds: float) -> None:
        self.draft.add(self.draft_features(passes, fed, proposed), seconds)

    def step_time(self, num_seqs: int, fed_tokens: int, sum_k: int, max_k: int) -> float:
        t = self.target.predict(self.target_features(num_seqs, fed_tokens, sum_k))
        if sum_k:
            # In steady decoding a drafting sequence feeds the draft about one token.
            t += self.draft.predict(self.draft_features(max_k, num_seqs, sum_k))
        return t


@dataclass
class GoodputSwitch:
    """Speculation on or off for the whole batch, by measured goodput. Per bucket of batch
    sizes (1, 2-3, 4-7, ...) it keeps discounted sums of emitted tokens and seconds of
    recent decode steps for each mode, and the mode ahead runs. Now and then one step runs
    the other mode, so its figure stays current (the machine's load, the draft's acceptance
    and the batch's lengths all drift): after ``explore_every`` steps; each trial whose
    step did worse than the leader's figure doubles the wait, up to ``max_explore_every``
    (a trial can cost several plain steps: the draft catches up on what it skipped), and
    one that did better brings the next trial back soon. A trial step weighs like any
    other: at small batch one step's tokens swing from 1 to k+1, and a single unlucky
    step must not flip the mode."""

    explore_every: int = 16
    max_explore_every: int = 256
    decay: float = 0.9               # about the last ten steps of the running mode count
    min_samples: int = 3
    _sums: dict[tuple[int, bool], list[float]] = field(default_factory=dict)   # [tokens, seconds, steps]
    _steps: dict[int, int] = field(default_factory=dict)
    _next_trial: dict[int, int] = field(default_factory=dict)
    _wait: dict[int, int] = field(default_factory=dict)

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return num_seqs.bit_length()

    def goodput(self, num_seqs: int, speculate: bool) -> float | None:
        s = self._sums.get((self.bucket(num_seqs), speculate))
        return s[0] / s[1] if s and s[2] >= self.min_samples and s[1] > 0 else None

    def _own_leader(self, b: int) -> bool | None:
        on, off = self._sums.get((b, True)), self._sums.get((b, False))
        if not (on and off and min(on[2], off[2]) >= self.min_samples and on[1] > 0 and off[1] > 0):
            return None
        return on[0] / on[1] >= off[0] / off[1]

    def _rate_near(self, b: int, speculate: bool) -> float | None:
        for near in (b, b - 1, b + 1):
            s = self._sums.get((near, speculate))
            if s and s[2] >= self.min_samples and s[1] > 0:
                return s[0] / s[1]
        return None

    def leader(self, num_seqs: int) -> bool | None:
        """The mode ahead at this batch size (True: speculation), else at a neighbouring
        bucket's (half or twice the batch): a batch that drains or grows through buckets
        starts from what its neighbour learned instead of measuring both modes again.
        None while nothing close is known."""
        b = self.bucket(num_seqs)
        for near in (b, b - 1, b + 1):
            ahead = self._own_leader(near)
            if ahead is not None:
                return ahead
        return None

    def speculate(self, num_seqs: int) -> bool:
        b = self.bucket(num_seqs)
        self._steps[b] = self._steps.get(b, 0) + 1
        ahead = self.leader(num_seqs)
        if ahead is None:
            # Nothing known close by: measure speculation (the per-sequence policy decides
            # k_i), then plain decoding.
            return self.goodput(num_seqs, True) is None
        if self._steps[b] >= self._next_trial.setdefault(b, self._steps[b] + self.explore_every):
            return not ahead
        return ahead

    def observe(self, num_seqs: int, speculated: bool, tokens: int, seconds: float) -> None:
        b = self.bucket(num_seqs)
        before = self.leader(num_seqs)
        trial = before is not None and speculated != before
        if trial:
            lead = self._rate_near(b, before)
            wait = self._wait.get(b, self.explore_every)
            promising = lead is None or tokens / seconds > lead
            wait = self.explore_every if promising else min(2 * wait, self.max_explore_every)
            self._wait[b] = wait
            self._next_trial[b] = self._steps.get(b, 0) + wait
        s = self._sums.setdefault((b, speculated), [0.0, 0.0, 0])
        s[0] = s[0] * self.decay + tokens
        s[1] = s[1] * self.decay + seconds
        s[2] += 1


@dataclass
class SpeculationPolicy:
    kind: str = "static"
    k_max: int = 4
    disable_by_batch_size: int | None = None
    prior_acceptance: float = 0.6
    decay: float = 0.9               # about the last ten observations count
    overall_decay: float = 0.99      # about the last hundred, across sequences
    probe_interval: int = 16
    max_probe_interval: int = 256
    cost: StepCostModel = field(default_factory=StepCostModel)
    switch: GoodputSwitch = field(default_factory=GoodputSwitch)
    # Every sequence's observations together: a new sequence starts from what the draft
    # has been doing lately rather than from a fixed guess.
    overall: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    _calls: int = 0

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"speculation_policy must be one of {POLICIES}, got {self.kind!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"acceptance decay must be in (0, 1], got {self.decay}")

    def choose(self, caps: list[int], estimates: list[AcceptanceEstimate], fed_tokens: int) -> list[int]:
        """k_i per sequence given each one's cap (what max_tokens, max_model_len and the
        draft's window allow) and acceptance estimate; ``fed_tokens``: tokens the batch
        feeds the target besides proposals."""
        n = len(caps)
        if self.disable_by_batch_size is not None and n >= self.disable_by_batch_size:
            return [0] * n
        if self.kind == "static":
            return list(caps)
        if not self.switch.speculate(n):
            return [0] * n
        prior = self.overall.rate(self.prior_acceptance)
        rates = [e.rate(prior) for e in estimates]
        chosen = self._best_prefix(caps, rates, fed_tokens)
        self._calls += 1
        if self._calls % self.probe_interval == 0:
            for i in range(n):
                # Probe sequences that have gone quiet, so a recovering draft is noticed.
                e = estimates[i]
                if chosen[i] == 0 and caps[i] > 0 and e.steps_without_proposal >= (e.quiet_limit or self.probe_interval):
                    chosen[i] = 1
        return chosen

    def observe_step(self, num_seqs: int, fed_tokens: int, proposed: int, emitted: int, seconds: float) -> None:
        """A whole step's outcome, for the on/off switch. Only decode steps count: a step
        that also prefills (more than about one fed token per sequence) says nothing about
        speculation and would make whichever mode it ran in look slow."""
        if self.kind == "adaptive" and num_seqs and fed_tokens <= 2 * num_seqs and seconds > 0:
            self.switch.observe(num_seqs, proposed > 0, emitted, seconds)

    def observe(self, estimate: AcceptanceEstimate, proposed: int, accepted: int) -> None:
        """One sequence-step's outcome, for that sequence's estimate and the overall one."""
        if proposed and estimate.steps_without_proposal >= (estimate.quiet_limit or self.probe_interval):
            # This was a probe: back off after a failure, come back fully after a success.
            limit = estimate.quiet_limit or self.probe_interval
            estimate.quiet_limit = self.probe_interval if accepted else min(2 * limit, self.max_probe_interval)
        estimate.observe(proposed, accepted, self.decay)
        if proposed:
            self.overall.observe(proposed, accepted, self.overall_decay)

    def _best_prefix(self, caps: list[int], rates: list[float], fed_tokens: int) -> list[int]:
        """For each number of draft passes m, take candidate tokens (j <= m) in order of
        gain and keep the prefix with the best expected tokens per second; the pass count
        is fixed per search because its cost is not per token."""
        n = len(caps)
        # Candidate j of sequence i gains a_i^j expected tokens; gains fall with j, so
        # sorting keeps each sequence's candidates in order.
        cands = sorted(((rates[i] ** j, j, i) for i in range(n) for j in range(1, caps[i] + 1)), reverse=True)
        cost = self.cost
        best_rate = n / max(cost.step_time(n, fed_tokens, 0, 0), 1e-12)
        best: list[tuple[float, int, int]] = []
        # With m passes fixed, step time is linear in the proposed tokens: base + per_token * sum_k.
        per_token = cost.step_time(n, fed_tokens, 2, 1) - cost.step_time(n, fed_tokens, 1, 1)
        for m in range(1, max(caps, default=0) + 1):
            base = cost.step_time(n, fed_tokens, 1, m) - per_token
            usable = [c for c in cands if c[1] <= m]
            gain, sum_k = float(n), 0
            for idx, (g, _, _) in enumerate(usable):
                gain += g
                sum_k += 1
                rate = gain / max(base + per_token * sum_k, 1e-12)
                if rate > best_rate:
                    best_rate, best = rate, usable[:idx + 1]
        chosen = [0] * n
        for _, _, i in best:
            chosen[i] += 1
        return chosen
