"""The adaptive policy's own settings (``SpeculationConfig.policy_options``), validated
once here; the rest of what it reads is the speculation section itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specray.scheduler.config import SpeculationConfig, check_number


@dataclass(frozen=True)
class AdaptiveConfig:
    speculation: SpeculationConfig
    prior_acceptance: float = 0.6     # a draft's rate before anything is seen
    decay: float = 0.98               # a sequence's last fifty-odd steps count
    overall_decay: float = 0.99       # about the last hundred, across sequences
    # Pseudo-proposals of the draft's rate across sequences added to each one's own
    # counts: one step's accepted count says little about the next, so a sequence's
    # record alone chases noise (docs/adaptive-policy.md).
    shrinkage: float = 15.0

    def __post_init__(self) -> None:
        if not isinstance(self.speculation, SpeculationConfig):
            raise ValueError(f"speculation must be a SpeculationConfig, got {type(self.speculation).__name__}")
        for name in ("prior_acceptance", "decay", "overall_decay"):
            value = getattr(self, name)
            check_number(name, value)
            if value > 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        check_number("shrinkage", self.shrinkage, positive=False)

    @classmethod
    def of(cls, speculation: SpeculationConfig) -> "AdaptiveConfig":
        """The policy of a runtime's speculation section, with its ``policy_options``."""
        names = {f.name for f in dataclasses.fields(cls)} - {"speculation"}
        unknown = sorted(set(speculation.policy_options) - names)
        if unknown:
            raise ValueError(f"policy_options: the adaptive policy has no option {unknown[0]!r} "
                             f"(it has {', '.join(sorted(names))})")
        return cls(speculation, **speculation.policy_options)
