"""Worker calls a step sent and has not waited for yet.

The engine sends every draft worker's call (then every target worker's) before it waits
for any, and pre-drafts stay out while the target verifies. A step that fails half-way
leaves some of those unanswered: on a worker's link their replies would pile up behind
the next calls, on a compiled graph's channel they would hold its buffers, and a Ray
reference would keep its draft probabilities alive. So each call is sent through
``OpenCalls``, and a failed step's are waited for (``drain``), their answers dropped and
the workers lost on the way named, for the scheduler to deal with as in any step.
"""

from __future__ import annotations

from typing import Any, Callable

from specray.runtime.transport.worker_call import WorkerLost


class OpenCalls:
    def __init__(self) -> None:
        # ticket -> (step id, "draft" | "target", worker rank, its wait, the call's handle)
        self._open: dict[int, tuple[int, str, int, Callable[[Any], Any], Any]] = {}
        self._tickets = 0

    def __len__(self) -> int:
        return len(self._open)

    def sent(self, step_id: int, kind: str, rank: int, wait: Callable[[Any], Any], handle: Any) -> int:
        """A call sent for step ``step_id``; returns its ticket for ``wait``."""
        self._tickets += 1
        self._open[self._tickets] = (step_id, kind, rank, wait, handle)
        return self._tickets

    def wait(self, ticket: int) -> Any:
        """The call's answer (or its error: ``WorkerLost``, or whatever the worker raised)."""
        _, _, _, wait, handle = self._open.pop(ticket)
        return wait(handle)

    def drain(self, step_id: int) -> list[tuple[str, int]]:
        """Wait for step ``step_id``'s unanswered calls, dropping their answers; returns
        (kind, rank) of each worker found lost."""
        lost = []
        for ticket in [t for t, call in self._open.items() if call[0] == step_id]:
            _, kind, rank, wait, handle = self._open.pop(ticket)
            try:
                wait(handle)
            except WorkerLost:
                lost.append((kind, rank))
            except Exception:  # noqa: BLE001, S110 - the step failed already: this call's error adds nothing
                pass
        return lost
