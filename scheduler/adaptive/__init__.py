"""The adaptive speculation policy: per-sequence proposal lengths chosen for goodput
(expected tokens per second). A plug-in of ``specray.scheduler.speculation_policy``:
nothing outside this package imports it but the runtime's policy factory
(``specray.scheduler.policies``). See docs/adaptive-policy.md."""

from specray.scheduler.adaptive.config import AdaptiveConfig
from specray.scheduler.adaptive.policy import AdaptivePolicy

__all__ = ["AdaptiveConfig", "AdaptivePolicy"]
