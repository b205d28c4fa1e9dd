"""Command-line flags built from ``RuntimeConfig``'s fields, shared by ``specray generate``,
``serve``, ``batch`` and ``bench``: each flag's name, type, choices, help and default come
from the field (its ``metadata``), so the CLI never restates a default."""

from __future__ import annotations

import argparse
import dataclasses
import json

from specray.runtime.config import FIELD_SECTION, SECTIONS, RuntimeConfig

# Flags of fields that are not plain values of a section: the models default to the
# built-in pair, and the top-level fields.
_MODEL_PATHS = ("target", "draft")
_TOP_HELP = {"seed": "the runtime's generator: requests without their own seed draw from it",
             "max_pending": "unfinished requests the driver holds; online submits past it are refused (Overloaded)"}


def sampling_default(name: str):
    """A SamplingParams field's default: the CLI's sampling flags take theirs from it, so
    ``specray generate``, ``specray batch`` and the Python API sample alike."""
    from specray.scheduler.sampling_params import SamplingParams

    return SamplingParams.__dataclass_fields__[name].default


def installed_builtin(name: str) -> str | None:
    """Path of a model of the built-in pair (``tiny-target``, ``tiny-draft``), or None
    where it is not installed (the commands then ask for ``--target``)."""
    from specray.runtime.model_store import ModelNotFound
    from specray.runtime.model_store import builtin_model as find

    try:
        return find(name)
    except ModelNotFound:
        return None


def _fields():
    for cls in SECTIONS.values():
        yield from dataclasses.fields(cls)


def _value_type(f: dataclasses.Field):
    """The argparse type of a field from its annotation (``int | None`` -> int)."""
    kind = str(f.type).replace(" ", "").split("|")[0]
    return {"int": int, "float": float, "str": str, "dict": json.loads}[kind]


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def add_field_arg(p, f: dataclasses.Field, **override) -> None:
    """One flag for one field: ``--block-size`` for ``block_size`` unless its metadata names
    the flags; booleans get ``--x / --no-x``."""
    meta = f.metadata
    flags = meta.get("flags", ("--" + f.name.replace("_", "-"),))
    default = _default(f)
    kw = dict(dest=f.name, default=default, help=meta.get("help", ""))
    if isinstance(default, bool) or str(f.type).startswith("bool"):     # bool | None: unset means auto
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = _value_type(f)
        if "choices" in meta:
            kw["choices"] = list(meta["choices"])
    if default is not None and not isinstance(default, bool):
        kw["help"] += f" (default: {json.dumps(default) if isinstance(default, dict) else default})"
    kw.update(override)
    p.add_argument(*flags, **kw)


def add_model_args(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """Every runtime flag (or those of the fields in ``only``)."""
    for f in _fields():
        if only is not None and f.name not in only:
            continue
        if f.metadata.get("cli", True) is False:
            continue
        if f.name in _MODEL_PATHS:
            add_field_arg(p, f, default=None, help=f.metadata["help"] + " (default: the built-in pair)")
        else:
            add_field_arg(p, f)
        if f.name == "layout":
            p.add_argument("--colocate", dest="layout", action="store_const", const="colocated",
                           help="the same as --layout colocated")
    defaults = {f.name: f.default for f in dataclasses.fields(RuntimeConfig) if f.name in _TOP_HELP}
    for name, help_text in _TOP_HELP.items():
        if only is None or name in only:
            p.add_argument("--" + name.replace("_", "-"), type=int, default=defaults[name],
                           help=f"{help_text} (default: {defaults[name]})")


def runtime_config(args, **extra) -> RuntimeConfig:
    """A RuntimeConfig from ``add_model_args`` flags; the built-in pair fills in models."""
    values = {name: getattr(args, name) for name in list(FIELD_SECTION) + list(_TOP_HELP) if hasattr(args, name)}
    values.update(extra)
    target = values.get("target") or installed_builtin("tiny-target")
    if target is None:
        raise ValueError("no --target given and the built-in pair is missing under models/")
    values["target"] = target
    if values.get("proposer", "draft") == "draft":
        own_target = getattr(args, "target", None) is not None
        draft = values.get("draft") or (None if own_target else installed_builtin("tiny-draft"))
        if draft is None:
            raise ValueError("--proposer draft needs --draft")
        values["draft"] = draft
    elif values.get("proposer") not in ("eagle3", "eagle3+suffix"):
        values["draft"] = None      # eagle3: --draft is the head (default: tiny-eagle3 for the built-in target)
    return RuntimeConfig(**values)
