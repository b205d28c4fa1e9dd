"""``specray batch``'s checkpoint: a job killed (its client, its driver, the whole node
that ran the entrypoint) and submitted again with the same ``--input`` and ``--output``
generates only the lines it had not finished.

Beside a local ``--output`` (a path or ``file://``) lives ``.<name>.specray-partial``: a
header naming the input (a digest of every accepted line's request), then one output
record per finished line, appended and flushed to disk as each chunk finishes. A run that
finds a checkpoint of the same input takes its records and skips those lines; the output
file is still written whole at the end, in input order, and the checkpoint removed. A
checkpoint of another input is set aside (replaced). A record cut off by the kill (the
last line, half written) is dropped: that line runs again.

Object-store outputs and stdout keep no checkpoint (appending there is not atomic); a run
to them starts over. Lines without their own seed draw a new one in the resumed run.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specray.runtime.batch import Item
    from specray.runtime.batch_files import Location

VERSION = 1


def fingerprint(items: list[Item]) -> str:
    """What the input asks for, line by line: a different file, or other defaults, is another job."""
    h = hashlib.sha256()
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


class Checkpoint:
    def __init__(self, path: str, items: list[Item]) -> None:
        self.path = path
        self.digest = fingerprint(items)
        self.records: dict[int, dict] = {}      # line -> output record, from an earlier run
        self.added = 0
        self._load()
        self._file = open(path, "a", encoding="utf-8")
        if not self.records:
            self._file.truncate(0)
            self._append({"specray_checkpoint": VERSION, "input": self.digest})

    def _load(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return
        try:
            head = json.loads(lines[0])
        except json.JSONDecodeError:
            return
        if head != {"specray_checkpoint": VERSION, "input": self.digest}:
            return
        for text in lines[1:]:
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                continue          # the record the kill cut off: its line runs again
            self.records[rec["line"]] = rec
        if not self.records:
            return
        # Rewrite it without a cut-off tail, so what is appended next starts on a line.
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(head) + "\n")
            for rec in self.records.values():
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, self.path)

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
