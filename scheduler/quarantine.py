"""Which request made a step fail: the failed step's sequences, tried in halves.

A step that raises keeps nothing (no verdicts); its sequences go back to the queue with
every token they had, and they become suspects. Until none is left, each step runs only
suspects, the first group of them with no step in flight (a "probe"); the other running
sequences wait, their KV kept. A probe that passes clears its sequences (and they advance: each was verified).
A probe that fails splits in two, and so on down to one sequence, whose step failing alone
makes it the culprit: that request alone fails. So one bad request among ``n`` costs about
``2 log2(n)`` failed or probing steps, and its neighbours' outputs do not change (a retried
step feeds what the failed one fed)::

    step [a b c d] fails  ->  probes [a b] [c d]
    [a b] passes          ->  a, b cleared
    [c d] fails           ->  probes [c] [d]
    [c] fails             ->  c fails (its own error); [d] is probed next

A fault that is no one request's ends too: if every step fails, every probe does, and
each suspect ends as a culprit; if only larger steps fail, each probe that passes emits
tokens, so every round moves its sequences toward their ends.
"""

from __future__ import annotations

from collections.abc import Iterable


class Quarantine:
    def __init__(self) -> None:
        self.groups: list[list[int]] = []     # suspects, next probe first

    def __bool__(self) -> bool:
        return bool(self.groups)

    def probe(self, alive: set[int], busy: frozenset[int] = frozenset()) -> frozenset[int] | None:
        """The sequences the next step may run: those of the first group still unfinished
        (``alive``) that have no step in flight (``busy``: the other group of two in
        flight may be probing one already); None when there is none to probe."""
        self.groups = [g for g in ([s for s in group if s in alive] for group in self.groups) if g]
        for group in self.groups:
            free = frozenset(s for s in group if s not in busy)
            if free:
                return free
        return None

    def passed(self, seq_ids: Iterable[int]) -> None:
        """A step of these sequences ran: they are cleared."""
        self._discard(set(seq_ids))

    def failed(self, seq_ids: list[int]) -> int | None:
        """A step of these sequences (in step order) failed. Returns the culprit when the
        step ran one sequence; otherwise its two halves are the next probes."""
        self._discard(set(seq_ids))
        if len(seq_ids) <= 1:
            return seq_ids[0] if seq_ids else None
        half = (len(seq_ids) + 1) // 2
        self.groups[:0] = [list(seq_ids[:half]), list(seq_ids[half:])]
        return None

    def _discard(self, ids: set[int]) -> None:
        self.groups = [g for g in ([s for s in group if s not in ids] for group in self.groups) if g]
