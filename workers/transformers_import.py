"""Entering transformers from threads: one thread at a time in a process.

transformers' lazy modules are not safe to import from two threads at once (a driver
loads its tokenizer while a thread builds the target and its EAGLE-3 head: the second
importer got "cannot import name 'LlamaConfig'"), and ``from_pretrained`` builds on
process-wide state (its meta-device init), so two threads loading at once (the ranks of a
tensor-parallel group in one process) can meet each other's half-built modules. Every
import of transformers (or of a module that imports it) and every load through it holds
``LOCK``; it is reentrant, so a holder may call another entry.
"""

from __future__ import annotations

import importlib
import threading

LOCK = threading.RLock()


def attr(module: str, name: str):
    """``name`` of ``module`` (transformers', or one that imports it), imported under ``LOCK``."""
    with LOCK:
        return getattr(importlib.import_module(module), name)
