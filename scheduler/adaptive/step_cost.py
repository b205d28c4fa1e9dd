"""An online model of a step's time, fitted from the runtime's own measured steps::

    T = target(n, fed, sum k_i, max k_i) + [sum k_i > 0] * draft(max k_i, fed, sum k_i) + overhead(n)
    target   = t0 + t_seq * n + t_fed * fed + t_tok * sum k_i + t_pad * n * max k_i
               + t_spec * [sum k_i > 0]
    draft    = d0 + d_pass * max k_i + d_fed * fed + d_tok * sum k_i
    overhead = o0 + o_seq * n          (the driver's own work: scheduling, merging, updating)

The longest proposal sets much of a step's price: the draft runs ``max k_i`` passes, and
attention pads every sequence's query rows to the longest (``t_pad``). Verifying any
proposals at all costs the target a step of its own (``t_spec``: the rejection sampler,
the draft rows, logits for every proposal row); without that term a line through plain
and speculating steps misprices every level (docs/history.md). Each term is fitted
per batch-size bucket (``BucketedFit``): a token's marginal cost is not one number across
batch sizes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class LinearFit:
    """Least squares ``y ~ w . x`` over a sliding window, in plain Python (a few features),
    with every weight >= 0 (step time never shrinks with more work: a negative slope is
    noise or collinearity) and, when a prior is given, a ridge towards it.

    With ``relative``, each sample weighs ``1 / y^2``: the fit minimises relative errors,
    so a few slow steps (a batch's prefill takes 40 decode steps' time) cannot drag the
    prediction for every ordinary step off by their squared size.

    The normal equations are kept as running sums (a sample leaving the window is
    subtracted): an observation costs O(features^2) on the step loop, not a pass over the
    window. They are solved again once a 32nd of the window is new (at least 4 samples),
    not on every step: a full window moves little with one more sample, and each solve is
    several small eliminations in Python. Not much rarer either: the machine's speed
    drifts. ``version`` counts solves, so
    what is derived from the weights can be kept until they change. The ridge weighs like
    ``ridge`` samples at each feature's typical size, so it decides only what the data do
    not."""

    def __init__(self, num_features: int, window: int = 256, prior: list[float] | None = None,
                 ridge: float = 0.01, relative: bool = False) -> None:
        self.n = num_features
        self.relative = relative
        self.window = window
        self.samples: deque[tuple[list[float], float]] = deque()
        self.prior = list(prior) if prior else None
        self.ridge = ridge if prior else 0.0     # nothing to lean towards without a prior
        self._weights = list(prior) if prior else [0.0] * num_features
        self._xtx = [[0.0] * num_features for _ in range(num_features)]
        self._xty = [0.0] * num_features
        self._dirty = 0                  # samples added since the last solve
        self.version = 0

    def add(self, x: list[float], y: float) -> bool:
        """Add a sample; True when the weights were solved again."""
        self._accumulate(x, y, 1.0)
        self.samples.append((x, y))
        if len(self.samples) > self.window:
            self._accumulate(*self.samples.popleft(), -1.0)
        self._dirty += 1
        count = len(self.samples)
        # The first solve comes as soon as there are enough samples (BucketedFit then
        # calls the fit ready).
        if count >= 2 * self.n and (self._dirty >= max(4, count // 32) or count == 2 * self.n):
            self._solve()
            return True
        return False

    def _accumulate(self, x: list[float], y: float, sign: float) -> None:
        if self.relative and y > 0:
            sign /= y * y
        # This runs twice per fit on every step: only the upper triangle of the symmetric
        # x'x is kept (_solve mirrors it), and zero features (no proposals when
        # speculation is off) add nothing.
        xtx, xty, n = self._xtx, self._xty, self.n
        for i, xi in enumerate(x):
            if not xi:
                continue
            s = sign * xi
            xty[i] += s * y
            row = xtx[i]
            for j in range(i, n):
                xj = x[j]
                if xj:
                    row[j] += s * xj

    @property
    def weights(self) -> list[float]:
        return self._weights

    def solve(self) -> list[float]:
        """The weights over every sample in the window now, not as of the last solve."""
        if self._dirty:
            self._solve()
        return self._weights

    def predict(self, x: list[float]) -> float:
        return sum(w * v for w, v in zip(self.weights, x))

    def _solve(self) -> None:
        self._dirty = 0
        self.version += 1
        count = len(self.samples)
        a = [[self._xtx[min(i, j)][max(i, j)] for j in range(self.n)] for i in range(self.n)]
        b = list(self._xty)
        for i in range(self.n):
            # Ridge towards the prior, scaled by the feature's mean square; a tiny one
            # without a prior, since early features are often collinear.
            lam = self.ridge * self._xtx[i][i] / count
            a[i][i] += lam + 1e-9
            if lam:
                b[i] += lam * self.prior[i]
        w = _nonnegative_solve(a, b)
        if w is not None:
            self._weights = w


def _nonnegative_solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """The ``w >= 0`` minimising ``w.a.w / 2 - b.w`` (least squares in normal-equation
    form; ``a`` positive definite), or None when a system is singular.

    Dropping the most negative weight (pinning it at 0) and solving again settles nearly
    every case, but not all: a weight pinned early may be wanted back once another is
    pinned. So the result is checked: it is the optimum when no pinned weight would lower
    the objective by rising (the KKT conditions); otherwise every support is tried (at
    most 2^5 small solves, and rare)."""
    n = len(b)
    free = list(range(n))
    w = [0.0] * n
    while free:
        s = _solve_on(a, b, free)
        if s is None:
            return None
        worst = min(free, key=s.__getitem__)
        if s[worst] >= 0.0:
            w = s
            break
        free.remove(worst)
    for i in range(n):
        if w[i] == 0.0:
            pull = sum(a[i][j] * w[j] for j in range(n))
            if b[i] - pull > 1e-9 * (abs(b[i]) + abs(pull)):
                break
    else:
        return w
    best, best_value = [0.0] * n, 0.0        # every weight pinned: feasible, objective 0
    for mask in range(1, 1 << n):
        s = _solve_on(a, b, [i for i in range(n) if mask >> i & 1])
        if s is None or min(s) < 0.0:
            continue
        value = sum(s[i] * (sum(a[i][j] * s[j] for j in range(n)) / 2 - b[i]) for i in range(n))
        if value < best_value:
            best, best_value = s, value
    return best


def _solve_on(a: list[list[float]], b: list[float], free: list[int]) -> list[float] | None:
    """The unconstrained solution with the weights outside ``free`` at 0."""
    s = _solve_linear([[a[i][j] for j in free] for i in free], [b[i] for i in free])
    if s is None:
        return None
    out = [0.0] * len(b)
    for i, v in zip(free, s):
        out[i] = v
    return out


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


def batch_bucket(num_seqs: int) -> int:
    """Batch sizes 1, 2-3, 4-7, ...: within a bucket a step's cost is close to linear."""
    return num_seqs.bit_length()


class BucketedFit:
    """One ``LinearFit`` per batch-size bucket. A token's marginal cost is not one number
    across batch sizes (matrix products get more efficient with more rows), so a single
    global fit is wrong at both ends. A bucket without enough samples of its own predicts
    with the nearest bucket that has them, and a new bucket's fit starts from (and leans
    towards) that neighbour's weights instead of the fixed prior."""

    def __init__(self, num_features: int, prior: list[float], window: int = 256) -> None:
        self.n = num_features
        self.prior = list(prior)
        self.window = window
        self.fits: dict[int, LinearFit] = {}
        self.version = 0                 # moves whenever a prediction may change

    def _ready(self, b: int) -> LinearFit | None:
        fit = self.fits.get(b)
        return fit if fit is not None and len(fit.samples) >= 2 * self.n else None

    def _nearest(self, b: int) -> LinearFit | None:
        ready = [near for near in self.fits if self._ready(near) is not None]
        return self.fits[min(ready, key=lambda near: (abs(near - b), near))] if ready else None

    def add(self, num_seqs: int, x: list[float], y: float) -> None:
        b = batch_bucket(num_seqs)
        fit = self.fits.get(b)
        if fit is None:
            near = self._nearest(b)
            prior = near.weights if near is not None else self.prior
            fit = self.fits[b] = LinearFit(self.n, self.window, prior=prior, relative=True)
            self.version += 1
        if fit.add(x, y):
            self.version += 1

    def weights(self, num_seqs: int) -> list[float]:
        b = batch_bucket(num_seqs)
        fit = self._ready(b) or self._nearest(b) or self.fits.get(b)
        return fit.weights if fit is not None else self.prior

    def predict(self, num_seqs: int, x: list[float]) -> float:
        return sum(w * v for w, v in zip(self.weights(num_seqs), x))

    def set_weights(self, weights: list[float]) -> None:
        """Every batch size predicts with these weights (until observations come in)."""
        if len(weights) != self.n:
            raise ValueError(f"expected {self.n} weights, got {len(weights)}")
        self.prior = list(weights)
        self.fits.clear()
        self.version += 1


@dataclass
class StepCostModel:
    """Online model of a step's time; ``observe_*`` feed it measured seconds. Fed tokens
    (prefill, catch-up) and proposed tokens are separate features: a prompt's tokens cost
    differently from a few verified ones, and mixing them would mis-price speculation.
    The target's ``n * max k_i`` term is the padding of every sequence's query rows to
    the longest proposal in attention. The driver's own time per step is in the model
    too: leaving a cost every option pays out of the denominator would make the relative
    price of speculating look higher than it is."""

    target: BucketedFit = field(default_factory=lambda: BucketedFit(6, prior=[1e-3, 1e-5, 1e-4, 1e-4, 1e-5, 2e-4]))
    draft: BucketedFit = field(default_factory=lambda: BucketedFit(4, prior=[5e-4, 1e-4, 1e-5, 1e-5]))
    overhead: BucketedFit = field(default_factory=lambda: BucketedFit(2, prior=[2e-4, 2e-5]))
    # The last price, with what it was computed from: a policy asks about the same batch
    # every step, and the weights change every few steps.
    _price: tuple | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def target_features(num_seqs: int, fed: int, proposed: int, max_k: int) -> list[float]:
        return [1.0, float(num_seqs), float(fed), float(proposed), float(num_seqs * max_k), 1.0 if proposed else 0.0]

    @staticmethod
    def draft_features(passes: int, fed: int, proposed: int) -> list[float]:
        return [1.0, float(passes), float(fed), float(proposed)]

    def observe_target(self, num_seqs: int, fed: int, proposed: int, max_k: int, seconds: float) -> None:
        self.target.add(num_seqs, self.target_features(num_seqs, fed, proposed, max_k), seconds)

    def observe_draft(self, num_seqs: int, passes: int, fed: int, proposed: int, seconds: float) -> None:
        self.draft.add(num_seqs, self.draft_features(passes, fed, proposed), seconds)

    def observe_overhead(self, num_seqs: int, seconds: float) -> None:
        """A step's time outside the worker calls."""
        if seconds > 0:
            self.overhead.add(num_seqs, [1.0, float(num_seqs)], seconds)

    def price(self, num_seqs: int, fed_tokens: int) -> StepPrice:
        """The model at one batch, as a function of the proposal alone: what a policy
        weighing many proposals for the same batch evaluates, without a fit lookup each."""
        key = (num_seqs, fed_tokens, *self._versions())
        if self._price is not None and self._price[0] == key:
            return self._price[1]
        n = float(num_seqs)
        tw, dw, ow = self.target.weights(num_seqs), self.draft.weights(num_seqs), self.overhead.weights(num_seqs)
        price = StepPrice(
            plain=tw[0] + tw[1] * n + tw[2] * fed_tokens + ow[0] + ow[1] * n,
            # In steady decoding a drafting sequence feeds the draft about one token.
            speculating=dw[0] + dw[2] * n + tw[5],
            per_pass=dw[1] + tw[4] * n,
            per_token=tw[3] + dw[3])
        self._price = (key, price)
        return price

    def _versions(self) -> tuple[int, int, int]:
        return self.target.version, self.draft.version, self.overhead.version

    def step_time(self, num_seqs: int, fed_tokens: int, sum_k: int, max_k: int) -> float:
        return self.price(num_seqs, fed_tokens).time(sum_k, max_k)


@dataclass(frozen=True)
class StepPrice:
    """Predicted seconds of a step of one batch: ``plain`` without speculation; with it,
    plus ``speculating`` (the draft call, and the target's verifying at all), ``per_pass``
    for each of the step's width in draft passes (and the padding they cost verification)
    and ``per_token`` per proposal."""

    plain: float
    speculating: float
    per_pass: float
    per_token: float

    def time(self, sum_k: int, max_k: int) -> float:
        if not sum_k:
            return self.plain
        return self.plain + self.speculating + self.per_pass * max_k + self.per_token * sum_k
