"""How a worker refuses a plan. Plain exceptions without torch: the driver's side
(``specray.runtime.transport.actor_handle``) tells a restarted worker from a bad plan by them."""

from __future__ import annotations


class StaleCacheError(RuntimeError):
    """The driver counts cached tokens this worker does not hold (it restarted empty)."""


class PlanError(ValueError):
    """A step plan that contradicts this worker's state or limits; refused before any of
    the worker's state changed."""
