"""The decisions of specray: pure Python, no torch, no ray."""

from specray.scheduler.block_manager import BlockManager
from specray.scheduler.merge import MergedProposals, merge_proposals
from specray.scheduler.messages import PROTOCOL_VERSION, ProtocolError, Proposals, StepPlan, StepResult, decode, encode
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from specray.scheduler.sequence import Sequence, SequenceStatus
from specray.scheduler.stats import SpecStats

__all__ = [
    "BlockManager", "MergedProposals", "merge_proposals", "PROTOCOL_VERSION", "ProtocolError",
    "Proposals", "StepPlan", "StepResult", "decode", "encode", "SamplingParams", "ScheduledStep",
    "Scheduler", "SchedulerConfig", "Sequence", "SequenceStatus", "SpecStats",
]
