"""The driver as a Ray actor: ``DriverCore`` with its restarts counted and a refused
configuration kept for the client to raise."""

from __future__ import annotations

import os

import ray

from specray.runtime.config import RuntimeConfig
from specray.runtime.driver.core import DriverCore
from specray.runtime.driver.replies import DriverInfo
from specray.runtime.driver.restarts import RestartLog
from specray.scheduler.sequence import Sequence


class Driver(DriverCore):
    """The driver actor. Threaded, so stream polls and submits are answered while the
    step loop waits on workers."""

    def __init__(self, config: RuntimeConfig, export_metrics: bool) -> None:
        # Ray hands the client only the text of an error raised while an actor is created,
        # so a refused configuration is kept and reported by info(), for the client to
        # raise as the ValueError it is.
        self.refused: str | None = None
        # Ray reruns this constructor when it restarts the actor (``driver_restarts``).
        self.restarts = RestartLog()
        try:
            super().__init__(config, export_metrics)
        except ValueError as e:
            self.refused = str(e)
        self.restarts.ready()

    def info(self) -> DriverInfo | str:
        """The driver's info, or why it refused its configuration."""
        return self.refused if self.refused is not None else super().info()

    def pid(self) -> int:
        """This incarnation's process (tests kill it)."""
        return os.getpid()

    def metrics(self, workers: bool = True) -> dict:
        return {**super().metrics(workers), **self.restarts.metrics()}

    def _match_stops(self, stepped: list[tuple[Sequence, list[int]]]) -> None:
        super()._match_stops(stepped)
        if stepped:
            self.restarts.first_token()

    def shutdown(self) -> None:
        super().shutdown()
        self.restarts.clear()


RemoteDriver = ray.remote(max_concurrency=256)(Driver)
