"""The adaptive policy's own configuration. Each mechanism that has a switch here earned
its place in a paired bench (docs/adaptive-policy.md); the switch lets a bench run the
policy without it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specray.scheduler.config import SpeculationConfig


@dataclass(frozen=True)
class AdaptiveConfig:
    k: int = 4                            # num_speculative_tokens: the most a sequence in a batch proposes
    max_speculative_tokens: int | None = None   # a sequence alone, with early stops (None: k)
    disable_by_batch_size: int | None = None
    stop_early: bool = True               # a sequence alone: its draft stops where proposing stops paying
    prior_acceptance: float = 0.6
    decay: float = 0.98                   # a sequence's last fifty-odd steps count
    overall_decay: float = 0.99           # about the last hundred, across sequences
    explore_levels_every: int = 16        # 0: never run another level
    max_level_wait: int = 8               # trial slots between a losing level's trials, at most
    # Each mechanism on its own, so a bench can run the policy without it.
    measured_switch: bool = True          # on against off as measured (GoodputSwitch), not the model alone
    depth_calibration: bool = True        # deeper proposals' gains as measured (DepthCalibration)
    rate_spread: bool = True              # trust in a sequence's record as measured (RateSpread)
    calibrate_confidence: bool = True     # the draft's probabilities as measured (ConfidenceCalibration)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {self.k!r}")
        if self.max_speculative_tokens is not None and self.max_speculative_tokens < self.k:
            raise ValueError(f"max_speculative_tokens {self.max_speculative_tokens} must be >= "
                             f"num_speculative_tokens {self.k}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"acceptance decay must be in (0, 1], got {self.decay}")
        for f in dataclasses.fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")

    @property
    def lookahead(self) -> int:
        """The most any sequence proposes: past k only for a sequence alone whose draft stops."""
        return self.max_speculative_tokens if self.stop_early and self.max_speculative_tokens else self.k

    @classmethod
    def of(cls, spec: SpeculationConfig, **tuning) -> "AdaptiveConfig":
        """The adaptive policy of a runtime's speculation section; ``tuning``: more fields."""
        names = {f.name for f in dataclasses.fields(cls)} - {"k", "max_speculative_tokens", "disable_by_batch_size",
                                                             "stop_early"}
        unknown = sorted(set(tuning) - names)
        if unknown:
            raise ValueError(f"policy_options: the adaptive policy has no option {unknown[0]!r}")
        return cls(k=spec.k, max_speculative_tokens=spec.lookahead, disable_by_batch_size=spec.disable_by_batch_size,
                   stop_early=spec.stops_early, **tuning)
