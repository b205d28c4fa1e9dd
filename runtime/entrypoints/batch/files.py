"""Where ``specray batch`` reads and writes: a local path, or a URI of any filesystem
pyarrow knows (``file://``, ``s3://``, ``gs://``, ``hdfs://``), through
``pyarrow.fs.FileSystem.from_uri``.

The output never appears half-written. On the local filesystem a temporary file beside
the target is renamed over it; elsewhere the lines are spooled to a local temporary file
and sent whole at ``commit()``: an object store's single upload is atomic, and other
filesystems get a temporary name moved into place.

Inside ``ray job submit --working-dir ...`` the entrypoint runs in a temporary copy of
the working directory under Ray's session directory on the head: a relative ``--output``
would land there, out of sight and deleted with the job's environment, so it is refused.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import sys
import tempfile
from dataclasses import dataclass

# Set by Ray's job supervisor for the entrypoint (ray._private.runtime_env.constants).
_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
_OBJECT_STORES = ("s3", "gcs")


@dataclass
class Location:
    """A file as pyarrow reaches it; ``fs`` None for the local filesystem."""

    spec: str          # as the user gave it
    fs: object | None
    path: str          # absolute (local) or the filesystem's own path

    @property
    def shown(self) -> str:
        if self.fs is None:
            return self.path
        return self.spec


def is_uri(spec: str) -> bool:
    scheme, sep, _ = spec.partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


def locate(spec: str, flag: str) -> Location:
    """``spec`` as a Location; ValueError naming ``flag`` when pyarrow cannot reach it."""
    if not is_uri(spec):
        return Location(spec, None, os.path.abspath(spec))
    from pyarrow import fs as pafs

    try:
        filesystem, path = pafs.FileSystem.from_uri(spec)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a URI it cannot use
        raise ValueError(f"{flag} {spec}: {e}") from None
    if isinstance(filesystem, pafs.LocalFileSystem):
        return Location(spec, None, path)
    return Location(spec, filesystem, path)


def job_working_dir() -> str | None:
    """The temporary working directory of the Ray job this process runs in, or None
    outside a job (or in a job started without ``--working-dir``)."""
    raw = os.environ.get(_JOB_CONFIG_ENV)
    if raw is None:
        return None
    cwd = os.getcwd()
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        runtime_env = {}
    if runtime_env.get("working_dir") or f"{os.sep}runtime_resources{os.sep}" in cwd:
        return cwd
    return None


def check_output_place(spec: str) -> None:
    """Refuse a relative output path inside a job's temporary working directory."""
    if spec == "-" or is_uri(spec) or os.path.isabs(spec):
        return
    wd = job_working_dir()
    if wd is not None:
        raise ValueError(
            f"--output {spec} is a relative path, and this runs inside a Ray job whose working directory is "
            f"a temporary copy on the head ({wd}), removed with the job's environment: give an absolute path, "
            "a file://, s3:// or gs:// URI, or - (the job's log)")


def where(loc: Location) -> str:
    """Where a written output is, for the user: a local path also names the node."""
    if loc.fs is not None:
        return loc.shown
    return f"{loc.path} on {socket.gethostname()}" + (" (the Ray head, inside a job)" if job_working_dir() else "")


def read_bytes(loc: Location) -> bytes:
    if loc.fs is None:
        with open(loc.path, "rb") as f:
            return f.read()
    with loc.fs.open_input_stream(loc.path) as f:
        return f.read()


def _create_beside(path: str) -> tuple[int, str]:
    """A new file under a random name in ``path``'s directory, open for writing: (fd, its
    path). Unlike ``mkstemp`` (mode 0600) it is created 0666 less the umask, as a plain
    open() of ``path`` would make the output, the kernel applying the umask (reading it
    would mean setting it, for the whole process)."""
    directory, name = os.path.split(path)
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {path}")


class Output:
    """``-``: stdout, line by line. Anything else: a temporary file, put in place whole on
    ``commit()``, so a crash never leaves a half-written output."""

    def __init__(self, spec: str, location: Location | None = None) -> None:
        self.path = spec
        self.location = location if location is not None or spec == "-" else locate(spec, "--output")
        if spec == "-":
            self.file, self.tmp = sys.stdout, None
            return
        loc = self.location
        if loc.fs is None:
            if os.path.isdir(loc.path):
                raise IsADirectoryError(errno.EISDIR, "it is a directory")
            fd, self.tmp = _create_beside(loc.path)
        else:
            from pyarrow import fs as pafs

            if loc.fs.get_file_info(loc.path).type == pafs.FileType.Directory:
                raise IsADirectoryError(errno.EISDIR, "it is a directory")
            fd, self.tmp = tempfile.mkstemp(prefix="specray-batch.", suffix=".jsonl")   # the local spool
        self.file = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        if self.tmp is None:
            self.file.flush()

    def commit(self) -> None:
        if self.tmp is None:
            return
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        loc = self.location
        if loc.fs is None:
            os.replace(self.tmp, loc.path)
        else:
            self._upload(loc)
            os.unlink(self.tmp)
        self.tmp = None

    def _upload(self, loc: Location) -> None:
        parent = loc.path.rsplit("/", 1)[0] if "/" in loc.path else ""
        if loc.fs.type_name in _OBJECT_STORES:
            target = loc.path                 # one upload, visible only once complete
        else:
            if parent:
                loc.fs.create_dir(parent, recursive=True)
            target = f"{parent}/.{loc.path.rsplit('/', 1)[-1]}.{os.getpid()}.tmp" if parent else f".{loc.path}.tmp"
        with open(self.tmp, "rb") as src, loc.fs.open_output_stream(target) as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        if target != loc.path:
            loc.fs.move(target, loc.path)

    def discard(self) -> None:
        if self.tmp is not None:
            self.file.close()
            os.unlink(self.tmp)
            self.tmp = None
