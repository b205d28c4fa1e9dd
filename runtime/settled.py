"""What follows from a configuration once its layout is decided (``specray.runtime.layout``)
and its models' files can be read: decided once, by the driver, before anything starts,
and handed on whole. Every part reads the settled configuration; none decides again.

- ``overlap`` (pre-drafting): None is on where draft actors run beside the target (the
  actor layout, with the draft model proposing alone) and off co-located, where nothing
  would run beside the verify; an explicit True is kept in either layout (in one process
  pre-drafts run in turn and compute the same windows), and is off for every proposer
  but the draft model (host-side proposals cost nothing to hide).
- ``max_model_len``: the window in force, the asked one within the target's own
  (``max_position_embeddings``).
- ``draft_max_model_len``: the draft model's, within ``max_model_len`` (it serves the
  target's sequences); past it a sequence decodes without proposals. None with an
  EAGLE-3 head: it drafts at the target's positions, over the target's window.
- ``enable_prefix_caching``: off with an EAGLE-3 head (its KV rows depend on the next
  token, in blocks it shares with the target).
- ``tensor_parallel_size``, ``draft_tensor_parallel_size``: checked against the model's
  heads, KV heads and MLP once its config can be read; a split the layers do not allow is
  refused before anything starts.
"""

from __future__ import annotations

import dataclasses

from specray.runtime.config import RuntimeConfig
from specray.workers.model_files import read_config, settle_windows


def settle(config: RuntimeConfig) -> RuntimeConfig:
    """``config`` with every setting above decided. Refuses a layout still "auto": only
    ``layout.resolve``, which sees the cluster, decides that."""
    layout = config.cluster.layout
    if layout == "auto":
        raise ValueError("layout 'auto' must be resolved against the cluster first (layout.resolve; "
                         "SpecRuntime does it): give 'actors' or 'colocated'")
    spec = config.speculation
    overlap = spec.overlap if spec.overlap is not None else layout == "actors"
    spec = dataclasses.replace(spec, overlap=overlap and spec.proposer == "draft")
    if spec.head:
        model = dataclasses.replace(settle_windows(dataclasses.replace(config.model, draft=None)),
                                    draft=config.model.draft)
    else:
        model = settle_windows(config.model)
    k = spec.num_speculative_tokens
    if k >= model.max_model_len:
        raise ValueError(f"num_speculative_tokens {k} must be below max_model_len {model.max_model_len}")
    from types import SimpleNamespace

    from specray.workers.tensor_parallel import check_split

    for name, path in (("tensor_parallel_size", model.target), ("draft_tensor_parallel_size", model.draft)):
        tp = getattr(config.cluster, name)
        if tp > 1 and path:
            check_split(SimpleNamespace(**read_config(path)), tp, name)
    cache = config.cache
    if spec.head and cache.enable_prefix_caching:
        # An EAGLE-3 head keeps its KV in the target's blocks, and its row at a position
        # carries the token after it: a block two sequences share cannot hold both rows.
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    return config.replace(model=model, speculation=spec, cache=cache)
