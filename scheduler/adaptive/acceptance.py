"""How likely a sequence's draft is to be right: discounted acceptance counts per
sequence and across sequences, and what each further proposal is worth."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AcceptanceEstimate:
    """Discounted counts of proposals accepted and of steps that rejected one."""

    accepted: float = 0.0
    rejected: float = 0.0

    def rate(self, prior: float, prior_weight: float = 1.0) -> float:
        """Accepted per proposal reached, with ``prior_weight`` pseudo-proposals at ``prior``."""
        return (self.accepted + prior * prior_weight) / (self.accepted + self.rejected + prior_weight)

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        if proposed == 0:
            return
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1 if accepted < proposed else 0)


def gains(rates: list[float], limits: list[int]) -> list[list[float]]:
    """Per sequence, the expected tokens its 1st..limit-th proposal adds: its j-th is
    accepted only if every one before it was, ``rate ** j``."""
    out = []
    for rate, limit in zip(rates, limits):
        row, g = [], 1.0
        for _ in range(limit):
            g *= rate
            row.append(g)
        out.append(row)
    return out
