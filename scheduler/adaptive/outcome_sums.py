"""How long steps took against what the cost model predicted for them, kept per key."""

from __future__ import annotations


class OutcomeSums(dict):
    """key -> [seconds, predicted seconds, steps]: discounted sums of decode steps'
    measured and predicted times, each key's sums decaying per observation of that key (a
    key seen seldom keeps its last few steps). Their ratio, predicted over measured, says
    how much faster than the model's figure that key's steps run (a factor for its
    goodput): the on/off switch keys them by (bucket, speculating)."""

    def __init__(self, decay: float) -> None:
        super().__init__()
        self.decay = decay

    def add(self, key, seconds: float, predicted_seconds: float) -> None:
        s = self.setdefault(key, [0.0, 0.0, 0])
        s[0] = s[0] * self.decay + seconds
        s[1] = s[1] * self.decay + predicted_seconds
        s[2] += 1

    def ratio(self, key, min_samples: int) -> float | None:
        """Predicted over measured seconds for ``key``; None before ``min_samples`` steps
        (or while either sum is still zero)."""
        s = self.get(key)
        if not s or s[2] < min_samples or min(s[:2]) <= 0:
            return None
        return s[1] / s[0]

    def steps(self, key) -> int:
        s = self.get(key)
        return s[2] if s else 0
