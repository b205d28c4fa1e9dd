"""The best proposal lengths at each speculation level, given what each proposal is worth
and what a step costs."""

from __future__ import annotations

from specray.scheduler.adaptive.step_cost import StepPrice


class LevelChoices:
    """Level m (the draft's passes, max k_i; 0 is plain decoding) -> the expected tokens
    per second of its best choice of k_i (``rates``), and that choice (``ks(m)``).

    With m fixed, a step's time is linear in the proposed tokens, and a sequence's j-th
    proposal is worth less than its (j-1)-th, so without the level's constraint the best
    choice is the candidates (depth j <= m) taken in order of gain while each gains more
    than the rate's worth of its time: the best prefix ``U`` of that order. The constraint
    is that some sequence proposes m. If ``U`` reaches depth m, it is the level's best;
    otherwise the best is a whole chain of m proposals of one sequence ``s`` plus the best
    prefix of the others' candidates, and that prefix holds all of ``U`` (every token of
    ``U`` gains more than ``U``'s rate, which no constrained choice beats) and goes on
    while the next token still pays. So ``U`` once per level, and per candidate ``s`` a
    few tokens past it.

    Each level's k_i are built only when asked for (a step runs one level), once. A
    sequence alone reaches level m only by proposing m: its rates are running sums,
    without the search (it runs on every step of a batch-1 request)."""

    def __init__(self, gains: list[list[float]], price: StepPrice) -> None:
        """``gains[i][j-1]``: expected tokens from sequence i's j-th proposal, never rising
        with j (its length is the sequence's cap); levels past every cap are absent."""
        n = self.num_seqs = len(gains)
        # Best first; ties go shallower first, which keeps each sequence's candidates in order.
        order = sorted((-g, j, i) for i, row in enumerate(gains) for j, g in enumerate(row, 1))
        self.rates: dict[int, float] = {0: n / max(price.plain, 1e-12)}
        # level -> (its candidates in order, how many of them, the sequence whose chain
        # is added to them or -1)
        self._picks: dict[int, tuple[list[tuple[float, int, int]], int, int]] = {}
        self._ks: dict[int, list[int]] = {}
        if n == 1:
            gain = 1.0
            for m, g in enumerate(gains[0], 1):
                gain += g
                self.rates[m] = gain / max(price.time(m, m), 1e-12)
                self._ks[m] = [m]
            return
        pt = price.per_token
        for m in range(1, max((len(row) for row in gains), default=0) + 1):
            cands = [c for c in order if c[1] <= m]
            gain, t, length = float(n), price.time(1, m) - pt, 0
            while length < len(cands) and -cands[length][0] * t > gain * pt:
                gain -= cands[length][0]
                t += pt
                length += 1
            if any(j == m for _, j, _ in cands[:length]):
                self.rates[m], self._picks[m] = gain / max(t, 1e-12), (cands, length, -1)
                continue
            in_u = [0] * n       # each sequence's first few candidates are in U
            for _, _, i in cands[:length]:
                in_u[i] += 1
            best = None
            for s in range(n):
                if len(gains[s]) < m:
                    continue
                # U plus the rest of s's chain.
                g_s, t_s = gain + sum(gains[s][in_u[s]:m]), t + (m - in_u[s]) * pt
                end = length
                while end < len(cands):
                    neg, _, i = cands[end]
                    if i != s:
                        if -neg * t_s <= g_s * pt:
                            break
                        g_s -= neg
                        t_s += pt
                    end += 1
                rate = g_s / max(t_s, 1e-12)
                if best is None or rate > best[0]:
                    best = (rate, end, s)
            if best is not None:
                self.rates[m], self._picks[m] = best[0], (cands, best[1], best[2])

    def ks(self, m: int) -> list[int]:
        """Level m's k_i, a fresh list (the caller may change it). Built once per
        level: the policy keeps these choices across steps while nothing they read moves."""
        if m not in self._ks:
            out = [0] * self.num_seqs
            if m:
                cands, length, chain = self._picks[m]
                for _, _, i in cands[:length]:
                    if i != chain:
                        out[i] += 1
                if chain >= 0:
                    out[chain] = m
            self._ks[m] = out
        return list(self._ks[m])
