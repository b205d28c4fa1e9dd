"""The Python standard library's own sources as a corpus: on every machine, no download.

The built-in model pair trains on it and ``specray bench`` takes its prompts from the
files the training held out, so both must agree on the split; it lives here, once.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Sequence

EVAL_EVERY = 20  # every 20th file (sorted order) goes to the held-out split

# Directories (any path component) and file name prefixes left out of the corpus.
SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib",
    "lib2to3", "ensurepip",
    "encodings",     # mostly generated charmap tables
    "pydoc_data",    # one huge generated string literal
    "turtledemo",
})
SKIP_FILE_PREFIXES = ("_sysconfigdata", "test_")


def default_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(stdlib_dir: str | os.PathLike | None = None) -> list[Path]:
    """All corpus ``.py`` files under ``stdlib_dir``, sorted by relative POSIX path."""
    root = Path(stdlib_dir) if stdlib_dir is not None else default_stdlib_dir()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if any(p in SKIP_DIRS or p.startswith("config-") for p in rel_dir.parts):
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in filenames:
            if not name.endswith(".py") or name.startswith(SKIP_FILE_PREFIXES):
                continue
            path = Path(dirpath) / name
            if path.is_file():
                found.append(((rel_dir / name).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [p for _, p in found]


def split_files(files: Sequence[Path], eval_every: int = EVAL_EVERY) -> tuple[list[Path], list[Path]]:
    """Split a sorted file list: file i goes to eval iff ``i % eval_every == eval_every - 1``."""
    train, held_out = [], []
    for i, path in enumerate(files):
        (held_out if i % eval_every == eval_every - 1 else train).append(path)
    return train, held_out


def held_out_prompts(count: int, num_bytes: int = 160, stdlib_dir=None) -> list[str]:
    """``count`` code snippets from held-out files, each starting at a line start about a
    third of the way into its file and cut at ``num_bytes`` (mid-code, so the model has
    something to continue)."""
    _, held = split_files(list_source_files(stdlib_dir))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in held]
    texts = [t for t in texts if len(t) > 4 * num_bytes]
    if not texts:
        raise ValueError("no held-out standard-library sources found for prompts")
    prompts = []
    for j in range(count):
        text = texts[j % len(texts)]
        rounds = j // len(texts)
        start = text.find("\n", (len(text) * (1 + 2 * rounds) // 7) % (len(text) - 2 * num_bytes)) + 1
        prompts.append(text[start:start + num_bytes])
    return prompts
