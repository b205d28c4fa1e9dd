"""Stop strings, matched on a request's decoded text (OpenAI's ``stop``).

A step may emit several tokens, and a stop string may end inside any of them; the output
then ends with the token that completed it, as plain decoding would have stopped there.
While a request runs, the tail of its text that could still grow into a stop string is
held back from streams, so no client ever sees the beginning of a stop string.
"""

from __future__ import annotations

from typing import Callable


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, int] | None:
    """(where the earliest stop string begins, where it ends) in ``text``, searching
    matches that end after ``start``; None without one."""
    best: tuple[int, int] | None = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, i + len(s))
    return best


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` are a proper prefix of a stop string.

    Only the tail a prefix could fill is read, and only where it holds the stop string's
    first character (found by ``str.find``): a few comparisons of at most ``len(s)``
    characters each, where trying every length was ``len(s)`` slices and comparisons
    on every poll, whatever the text."""
    held = 0
    for s in stops:
        tail = text[len(text) - min(len(s) - 1, len(text)):]
        i = tail.find(s[0]) if s else -1
        # The leftmost start whose rest of the tail begins s is the longest prefix.
        while 0 <= i < len(tail) - held:
            if s.startswith(tail[i:]):
                held = len(tail) - i
                break
            i = tail.find(s[0], i + 1)
    return held


def stop_cut(decode: Callable[[list[int]], str], tokens: list[int], checked: int, stops: list[str]
             ) -> tuple[int, int] | None:
    """Where a stop string first completes in the output ``tokens``, of which the first
    ``checked`` were searched before: (output tokens to keep, where the string begins in
    the kept text), or None."""
    text = decode(tokens)
    start = len(decode(tokens[:checked])) if checked else 0
    hit = find_stop(text, stops, start)
    if hit is None:
        return None
    begin, end = hit
    # The fewest tokens whose text holds the whole match: tokens after it were never
    # part of plain decoding's output.
    for n in range(max(checked, 1), len(tokens) + 1):
        if len(decode(tokens[:n])) >= end:
            return n, begin
    return len(tokens), begin
