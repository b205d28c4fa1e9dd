"""A model's files read without torch or transformers: where a model named by a local
directory or a hub id lives, and its context window from its ``config.json``. The driver
reads these before it starts its workers (importing transformers takes seconds, which it
spends while the workers load instead).

A name that can only be a path (see ``looks_local``) and does not exist is refused here,
naming the absolute path it was looked for at, instead of ending in a hub error about a
repository id.
"""

from __future__ import annotations

import json
import os

# A config.json that names no window: the Llama family's default.
DEFAULT_WINDOW = 2048

# The built-in pair's folder names: a path ending in one is never a hub id.
_BUILTIN = ("tiny-target", "tiny-draft", "tiny-eagle3")


def looks_local(path: str) -> bool:
    """Whether ``path`` can only mean a directory: it starts with ``.``, ``/`` or ``~``,
    has more than one ``/`` (a hub id is ``owner/name`` or ``name``), its parent folder
    exists here (``models/tiny-target`` beside a ``models/`` folder), or it names a model
    of the built-in pair."""
    if path.startswith((".", "/", "~", os.sep)) or path.count("/") > 1:
        return True
    parent = os.path.dirname(path)
    return bool(parent) and os.path.isdir(parent) or os.path.basename(path.rstrip("/")) in _BUILTIN


def resolve_model_path(path: str) -> str:
    """The absolute directory of a local model (``~`` expanded), or a hub id unchanged.

    Raises ValueError for a name that can only be a path and is not a directory."""
    local = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(local):
        return local
    if looks_local(path):
        name = os.path.basename(path.rstrip("/"))
        hint = f"; specray.builtin_model({name!r}) gives the built-in model's path" if name in _BUILTIN else ""
        raise ValueError(f"no such model directory: {local} (relative paths resolve from {os.getcwd()}){hint}")
    return path


def read_config(path: str) -> dict:
    """The model's ``config.json`` as a dict: a local directory's, or a hub model's (from
    the hub's cache when offline)."""
    where = resolve_model_path(path)
    if os.path.isdir(where):
        file = os.path.join(where, "config.json")
    else:
        from huggingface_hub import hf_hub_download

        try:
            file = hf_hub_download(where, "config.json")
        except Exception as e:
            raise ValueError(f"cannot load a model config from {path!r}: it is neither a directory here "
                             f"(relative paths resolve from {os.getcwd()}) nor a model the hub or its cache "
                             f"holds: {e}") from e
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a model config from {path!r}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"cannot load a model config from {path!r}: config.json is not an object")
    return config


def context_window(config: dict) -> int:
    """The longest sequence the model was made for (``max_position_embeddings``)."""
    window = config.get("max_position_embeddings") or DEFAULT_WINDOW
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"the model's max_position_embeddings must be an int >= 2, got {window!r}")
    return window


def settle_windows(model):
    """``model`` (a ``ModelConfig``) with its windows decided: ``max_model_len``, the asked
    one within the target's own; ``draft_max_model_len``, the draft's own within that (it
    serves the target's sequences), None without a draft. The driver decides them once
    (``specray.runtime.settled``) and every worker is built with the result."""
    import dataclasses

    window = context_window(read_config(model.target))
    window = min(model.max_model_len or window, window)
    draft_window = None
    if model.draft is not None:
        draft_window = min(model.draft_max_model_len or window, window, context_window(read_config(model.draft)))
    return dataclasses.replace(model, max_model_len=window, draft_max_model_len=draft_window)
