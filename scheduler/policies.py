"""Which speculation policy a runtime runs, by its configured name."""

from __future__ import annotations

from specray.scheduler.config import SpeculationConfig
from specray.scheduler.speculation_policy import SpeculationPolicy, StaticPolicy


def build_policy(spec: SpeculationConfig) -> SpeculationPolicy:
    if spec.speculation_policy == "static":
        return StaticPolicy(spec)
    if spec.speculation_policy == "adaptive":
        try:
            from specray.scheduler.adaptive import AdaptivePolicy
        except ImportError as e:
            raise ValueError("speculation_policy='adaptive' needs the specray.scheduler.adaptive package, "
                             f"which is not installed ({e})") from None
        return AdaptivePolicy.of(spec)
    raise ValueError(f"unknown speculation_policy {spec.speculation_policy!r}")
