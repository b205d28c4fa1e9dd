"""specray: exact speculative decoding for LLM serving, distributed with Ray.

The installed package is this folder (``runtime/`` in the repository: actors, the driver
loop, the client handle and the CLI), with ``specray.scheduler`` (the decisions: no
torch, no ray) and ``specray.workers`` (the compute: no ray at import time) beneath it.

The public names load on first use, so ``import specray.scheduler`` does not import Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "SpecRuntime": "specray.client",
    "RuntimeConfig": "specray.config",
    "RequestOutput": "specray.request_output",
    "SamplingParams": "specray.scheduler.sampling_params",
    "Overloaded": "specray.driver",
    "builtin_model": "specray.model_store",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from specray.client import SpecRuntime
    from specray.config import RuntimeConfig
    from specray.driver import Overloaded
    from specray.model_store import builtin_model
    from specray.request_output import RequestOutput
    from specray.scheduler.sampling_params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
