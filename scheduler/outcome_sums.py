"""What steps delivered against what the cost model predicted for them, kept per key."""

from __future__ import annotations


class OutcomeSums(dict):
    """key -> [tokens, seconds, predicted tokens, predicted seconds, steps]: discounted
    sums of decode steps' measured and predicted outcomes, each key's sums decaying per
    observation of that key (a key seen seldom keeps its last few steps). Their ratio,
    measured over predicted goodput, says how far the model has been off for that key:
    the on/off switch keys them by (bucket, speculating), the level correction by
    (bucket, level)."""

    def __init__(self, decay: float) -> None:
        super().__init__()
        self.decay = decay

    def add(self, key, tokens: float, seconds: float, predicted_tokens: float, predicted_seconds: float) -> None:
        s = self.setdefault(key, [0.0, 0.0, 0.0, 0.0, 0])
        for i, v in enumerate((tokens, seconds, predicted_tokens, predicted_seconds)):
            s[i] = s[i] * self.decay + v
        s[4] += 1

    def ratio(self, key, min_samples: int) -> float | None:
        """Measured over predicted goodput for ``key``; None before ``min_samples`` steps
        (or while any sum is still zero)."""
        s = self.get(key)
        if not s or s[4] < min_samples or min(s[:4]) <= 0:
            return None
        return (s[0] / s[1]) / (s[2] / s[3])

    def steps(self, key) -> int:
        s = self.get(key)
        return s[4] if s else 0
