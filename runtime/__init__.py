"""Ray wiring: actors, the driver loop, the client handle and the CLI."""

from runtime.client import SpecRuntime
from runtime.config import RuntimeConfig
from runtime.driver import Overloaded
from runtime.request_output import RequestOutput
from scheduler.sampling_params import SamplingParams

__all__ = ["SpecRuntime", "RuntimeConfig", "RequestOutput", "SamplingParams", "Overloaded"]
