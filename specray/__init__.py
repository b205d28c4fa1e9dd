"""specray: exact speculative decoding for LLM serving, distributed with Ray.

This is the public face; the code lives in three subpackages, each a folder of the
repository with the same name:

- ``specray.scheduler`` (``scheduler/``): the decisions, pure Python, no torch, no ray;
- ``specray.workers`` (``workers/``): the compute, torch and transformers, no ray at import;
- ``specray.runtime`` (``runtime/``): Ray actors, the driver loop, the client handle, the CLI.

The public names load on first use, so ``import specray.scheduler`` does not import Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "SpecRuntime": "specray.runtime.client",
    "RuntimeConfig": "specray.runtime.config",
    "RequestOutput": "specray.runtime.request_output",
    "SamplingParams": "specray.scheduler.sampling_params",
    "TokenLogprob": "specray.scheduler.token_logprob",
    "Overloaded": "specray.runtime.driver.replies",
    "builtin_model": "specray.runtime.model_store",
}

__all__ = ["SpecRuntime", "RuntimeConfig", "RequestOutput", "SamplingParams", "TokenLogprob", "Overloaded",
           "builtin_model"]
assert set(__all__) == set(_EXPORTS)

if TYPE_CHECKING:
    from specray.runtime.client import SpecRuntime
    from specray.runtime.config import RuntimeConfig
    from specray.runtime.driver.replies import Overloaded
    from specray.runtime.model_store import builtin_model
    from specray.runtime.request_output import RequestOutput
    from specray.scheduler.sampling_params import SamplingParams
    from specray.scheduler.token_logprob import TokenLogprob


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
