"""The decisions of specray: pure Python, no torch, no ray."""

from scheduler.block_manager import BlockManager
from scheduler.merge import MergedProposals, merge_proposals
from scheduler.messages import PROTOCOL_VERSION, ProtocolError, Proposals, StepPlan, StepResult, decode, encode
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.stats import SpecStats

__all__ = [
    "BlockManager", "MergedProposals", "merge_proposals", "PROTOCOL_VERSION", "ProtocolError",
    "Proposals", "StepPlan", "StepResult", "decode", "encode", "SamplingParams", "ScheduledStep",
    "Scheduler", "SchedulerConfig", "Sequence", "SequenceStatus", "SpecStats",
]
