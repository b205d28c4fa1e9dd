"""What a worker is built from, and how it refuses a plan: plain types without torch, so the
driver's side (the client process that defines the actors) can name them cheaply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_model_len: int | None = 2048   # None: the model's own
    max_num_seqs: int = 256
    # Another model whose context window also bounds this worker's: the draft serves the
    # target's sequences. Read by the worker, so the driver can start workers before it
    # has loaded any config itself.
    window_of: str | None = None


class StaleCacheError(RuntimeError):
    """The driver counts cached tokens this worker does not hold (it restarted empty)."""


class PlanError(ValueError):
    """A step plan that contradicts this worker's state or limits; refused before any of
    the worker's state changed."""
