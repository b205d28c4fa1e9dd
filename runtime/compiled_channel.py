"""One worker method behind a Ray Compiled Graph of its own.

A classic actor call pays for task submission on every step, and a reply past Ray's
inline limit (draft probabilities at batch 32) goes through the object store; a compiled
graph keeps a shared-memory channel open to an actor loop that is already waiting.

Each worker gets a one-node graph rather than the step as one graph: an actor can
belong to one graph at a time, and the engine calls only the workers that have work in
a step (no draft call while speculation is off, none for a rank without sequences).
The driver's actor builds every graph at startup and runs an empty step through it (a
fresh graph's first execution takes seconds). A worker that dies takes its graph with
it: the graph is torn down, and the first step after Ray has restarted the worker builds
a new one. A graph that cannot be built at all leaves that worker on classic calls.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class CompiledChannel:
    def __init__(self, method) -> None:
        """``method``: an actor method taking one argument and returning one value."""
        self._method = method
        self._dag = None
        self.failed = False      # this Ray could not compile it: classic calls for good

    def execute(self, arg: Any):
        """A CompiledDAGRef, or None when the graph cannot be built (``failed``)."""
        if self._dag is None:
            from ray.dag import InputNode

            try:
                with InputNode() as inp:
                    node = self._method.bind(inp)
                self._dag = node.experimental_compile()
            except Exception as e:   # noqa: BLE001 - any reason means the same: use classic calls
                log.warning("compiled graph unavailable, using classic actor calls: %s: %s", type(e).__name__, e)
                self.failed = True
                return None
        return self._dag.execute(arg)

    @property
    def live(self) -> bool:
        return self._dag is not None

    @staticmethod
    def is_ref(handle) -> bool:
        from ray.experimental.compiled_dag_ref import CompiledDAGRef

        return isinstance(handle, CompiledDAGRef)

    @staticmethod
    def get(ref) -> Any:
        # Block as long as the step takes (a long prefill may pass Ray's 10 s default):
        # a dead actor ends the wait with an error, not a timeout.
        return ref.get(timeout=-1)

    def close(self) -> None:
        dag, self._dag = self._dag, None
        if dag is not None:
            try:
                dag.teardown()
            except Exception:   # noqa: BLE001 - Ray may have torn it down already after a death
                pass
