"""``specray batch``'s checkpoint: a job killed (its client, its driver, the whole node
that ran the entrypoint) and submitted again with the same ``--input``, ``--output`` and
model generates only the lines it had not finished.

Beside a local ``--output`` (a path or ``file://``) lives ``.<name>.specray-partial``: a
header naming the job (a digest of every accepted line's request and of the model, see
``fingerprint``), then one output record per finished line, appended and flushed to disk
as each chunk finishes. A run that finds a checkpoint of the same job takes its records
and skips those lines; the output file is still written whole at the end, in input order,
and the checkpoint removed. A checkpoint of another job (another input, other defaults,
another model) is replaced: the run starts over rather than mix two models' outputs. A
record cut off by the kill (the last line, half written) is dropped: that line runs again.

The file is the job's own, and is treated as untrusted all the same:

- it is never followed through a symbolic link: a checkpoint path that is a link (or
  anything but a regular file) is refused with a ValueError, and nothing is written;
- it is rewritten through a fresh ``mkstemp`` file in the same directory (mode 0600)
  renamed over it, never through a predictable temporary name, and appended to through
  that same descriptor;
- every record is checked against the input (``check_record``): one that is not an
  object, lacks a field, has a field of the wrong type, or does not fit the line it names
  (a line not in the input, another id or prompt, more tokens than asked) is ignored with
  its reason in ``ignored`` (the command prints them): its line runs again. Ignoring, not
  refusing, since the header matched: a bad record can only be damage, and running its
  line again costs time, never a wrong output.

Object-store outputs and stdout keep no checkpoint (appending there is not atomic); a run
to them starts over. Lines without their own seed draw a new one in the resumed run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import tempfile
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specray.runtime.config import RuntimeConfig
    from specray.runtime.entrypoints.batch.files import Location
    from specray.runtime.entrypoints.batch.job import Item

VERSION = 2
# What output_record always writes, with its JSON type.
_RECORD_FIELDS = {"prompt_token_ids": (list, "a list"), "token_ids": (list, "a list"), "text": (str, "a string"),
                  "finish_reason": (str, "a string"), "num_draft_tokens": (int, "an integer"),
                  "num_accepted_tokens": (int, "an integer")}


def model_identity(config: RuntimeConfig) -> dict:
    """What decides a line's output besides the line itself: the target (greedy output is
    its argmax), and for seeded samples the draft, the proposer and k, which fix the
    positions a step proposes and draws (docs/fault-tolerance.md); device and dtype (the
    numerics) and the window (where a line stops). A local model directory counts by its
    real path, a hub id as given. The sampling defaults need no place here: every line's
    params already hold them."""
    m, s = config.model, config.speculation
    return {"target": _model_name(m.target), "draft": _model_name(m.draft), "proposer": s.proposer,
            "num_speculative_tokens": s.num_speculative_tokens, "device": m.device, "dtype": m.dtype,
            "max_model_len": m.max_model_len}


def _model_name(name: str | None) -> str | None:
    return os.path.realpath(name) if name is not None and os.path.isdir(name) else name


def fingerprint(items: list[Item], model: dict) -> str:
    """The job: what the input asks for, line by line, and the model that answers. A
    different file, other defaults, or another model is another job."""
    h = hashlib.sha256(json.dumps(model, sort_keys=True).encode())
    for it in items:
        prompt = it.prompt if isinstance(it.prompt, (str, list)) else repr(it.prompt)
        # A line without an id holds a marker object, whose repr names its address.
        ident = it.id if isinstance(it.id, (str, int, float, bool, list, dict, type(None))) else "<no id>"
        h.update(json.dumps([it.line, prompt, ident, asdict(it.params)], sort_keys=True, default=repr).encode())
    return h.hexdigest()


def checkpoint_path(location: Location | None) -> str | None:
    """Where a checkpoint for this output lives; None where it keeps none."""
    if location is None or location.fs is not None:       # stdout, or another filesystem
        return None
    d, name = os.path.split(location.path)
    return os.path.join(d, f".{name}.specray-partial")


def check_record(rec: object, lines: dict[int, Item]) -> str | None:
    """Why an earlier run's record cannot stand for its line (None: it can). ``lines``:
    the input's accepted items by line number."""
    from specray.runtime.entrypoints.batch.job import _NO_ID

    if not isinstance(rec, dict):
        return f"not an object: {type(rec).__name__}"
    line = rec.get("line")
    if isinstance(line, bool) or not isinstance(line, int):
        return f"line is {line!r}, not a line number"
    item = lines.get(line)
    if item is None:
        return f"line {line} is not an accepted line of the input"
    for name, (kind, what) in _RECORD_FIELDS.items():
        value = rec.get(name)
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"line {line}: {name} is missing or not {what}"
    for name in ("prompt_token_ids", "token_ids"):
        if any(isinstance(t, bool) or not isinstance(t, int) for t in rec[name]):
            return f"line {line}: {name} holds something other than token ids"
    if rec.get("id", _NO_ID) != item.id:
        return f"line {line}: the id does not match the input's"
    if isinstance(item.prompt, list) and rec["prompt_token_ids"] != item.prompt:
        return f"line {line}: prompt_token_ids do not match the input's prompt"
    if len(rec["token_ids"]) > item.params.max_tokens:
        return f"line {line}: {len(rec['token_ids'])} tokens, more than its max_tokens {item.params.max_tokens}"
    if ("logprobs" in rec) != (item.params.logprobs is not None):
        return f"line {line}: logprobs {'present' if 'logprobs' in rec else 'missing'}, unlike what the line asks"
    return None


class Checkpoint:
    """The checkpoint at ``path`` for ``items`` answered by ``model`` (``model_identity``).
    ``records``: line -> record an earlier run finished; ``ignored``: why each damaged
    record was dropped; ``started_over``: why an existing checkpoint was replaced, or None."""

    def __init__(self, path: str, items: list[Item], model: dict) -> None:
        self.path = path
        self.digest = fingerprint(items, model)
        self.records: dict[int, dict] = {}      # line -> output record, from an earlier run
        self.ignored: list[str] = []
        self.started_over: str | None = None
        self.added = 0
        head = {"specray_checkpoint": VERSION, "input": self.digest}
        text = self._read()
        if text is not None:
            self._load(text, head, {it.line: it for it in items})
        # Rewritten whole (without a cut-off tail, so what is appended next starts on a
        # line); the new file's descriptor takes the appends.
        self._file = self._rewrite(head)

    def _read(self) -> str | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"the checkpoint {self.path} is a symbolic link, which specray does not follow: "
                                 "remove it, or write the output elsewhere") from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"the checkpoint {self.path} is not a regular file: remove it, or write the "
                                 "output elsewhere")
            return f.read().decode("utf-8", errors="replace")

    def _load(self, text: str, head: dict, lines: dict[int, Item]) -> None:
        first, *rest = text.split("\n")
        try:
            found = json.loads(first)
        except (ValueError, RecursionError):
            found = None
        if found != head:
            self.started_over = "it was kept for another input, other defaults or another model"
            return
        for i, raw in enumerate(rest):
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError):      # RecursionError: nesting past the parser's depth
                if raw.strip() and i < len(rest) - 1:    # not the record the kill cut off
                    self.ignored.append("a line that is not JSON")
                continue
            why = check_record(rec, lines)
            if why is None:
                self.records[rec["line"]] = rec
            else:
                self.ignored.append(why)

    def _rewrite(self, head: dict):
        d, name = os.path.split(self.path)
        fd, tmp = tempfile.mkstemp(prefix=f"{name}.", suffix=".tmp", dir=d)
        f = os.fdopen(fd, "w", encoding="utf-8")
        try:
            f.write(json.dumps(head) + "\n")
            for rec in self.records.values():
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(fd)
            os.replace(tmp, self.path)       # replaces a link put there meanwhile, never writes through it
        except BaseException:
            f.close()
            os.unlink(tmp)
            raise
        return f

    def _append(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")

    def add(self, records: list[dict]) -> None:
        """A chunk's records, on disk before the call returns."""
        for rec in records:
            self._append(rec)
        self.added += len(records)
        self._file.flush()
        os.fsync(self._file.fileno())

    def remove(self) -> None:
        """The output is in place: the checkpoint is done with."""
        if not self._file.closed:
            self._file.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """The run ends without its output (refused, failed or interrupted): what it
        finished stays for the next run; a checkpoint with nothing in it goes."""
        if self._file.closed:
            return
        self._file.close()
        if not self.records and not self.added:
            self.remove()
