"""How the engine reaches a worker, wherever it runs: a ``WorkerCall``. (Proposers are
reached through their own contract, ``specray.scheduler.proposers.proposer.Proposer``;
the draft model's ranks are WorkerCalls beneath it.)

``submit`` starts a step call and returns a handle, ``wait`` returns its result or raises
``WorkerLost``. In-process workers (``LocalCall``) simply run in ``submit``; actor
handles (``specray.runtime.transport.draft_actor.DraftHandle``, ``target_actor.TargetHandle``)
return Ray references, so every draft worker (then every target worker) computes at once.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from specray.scheduler.messages import Predraft, StepPlan


class WorkerLost(Exception):
    """A worker died or restarted empty; ``WorkerCall.wait`` raises it."""


class WorkerCall(Protocol):
    def submit(self, plan: StepPlan, *args: Any) -> Any: ...
    def wait(self, handle: Any) -> Any: ...
    def alive(self) -> bool: ...
    def gone(self) -> bool: ...
    def close(self) -> None: ...


class PredraftCall(Protocol):
    """A draft worker that can pre-draft while the target verifies. Its calls run in the
    order submitted, each after the one before, and do not hold up the caller."""

    def submit_predraft(self, step_id: int) -> Any: ...
    def submit_adopt(self, plan: StepPlan, chosen: list[int]) -> Any: ...
    def wait_predraft(self, handle: Any) -> tuple[Predraft, Any]: ...


class LocalCall:
    """An in-process worker method as a WorkerCall. It computes in ``submit`` (``inline``):
    the engine submits every remote worker's step first, so those compute meanwhile."""

    inline = True

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def submit(self, plan: StepPlan, *args: Any) -> Any:
        return self.fn(plan, *args)

    def wait(self, handle: Any) -> Any:
        return handle

    def alive(self) -> bool:
        return True

    def gone(self) -> bool:
        return False

    def close(self) -> None:
        pass


class LocalDraftCall(LocalCall):
    """An in-process draft worker that pre-drafts: the same calls as the actor's, run at
    once (nothing overlaps in one thread; tests use it to check what overlap computes)."""

    def __init__(self, worker) -> None:
        super().__init__(worker.propose)
        self.worker = worker

    def submit_predraft(self, step_id: int):
        return self.worker.predraft(step_id)

    def submit_adopt(self, plan: StepPlan, chosen: list[int]):
        return self.worker.adopt(plan, chosen)

    def wait_predraft(self, handle):
        return handle
