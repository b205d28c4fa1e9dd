"""The decisions of specray: pure Python, no torch, no ray.

Glossary (one name per quantity, from config to worker):

- ``num_speculative_tokens`` (k): the most a sequence proposes in a batch of two or more.
- ``max_speculative_tokens`` (the lookahead): the most any sequence proposes in a step;
  the scheduler reserves that many lookahead slots at most. It is k unless the adaptive
  policy lets a request alone reach further.
- ``cap``: the most one sequence may propose this step, by the limits (its remaining
  ``max_tokens``, both models' windows, the lookahead, its draft worker being up).
- ``proposal_len`` (k_i): what the policy gives a sequence this step (<= its cap); a draft
  that stops early may make fewer (``Proposals.proposal_lens``).
- ``StepPlan.k``: a step's width, its longest ``proposal_len``: proposals and draft
  probabilities travel as ``[n, k]`` grids.
- ``num_computed``: tokens already in a worker's KV cache for a sequence
  (``Sequence.target_computed`` / ``draft_computed``); a step feeds ``tokens[num_computed:]``.
- accepted / bonus / emitted: see ``specray.workers.rejection_sampler``.
"""

from specray.scheduler.block_manager import BlockManager
from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.scheduler.merge import MergedProposals, merge_proposals
from specray.scheduler.messages import PROTOCOL_VERSION, ProtocolError, Proposals, StepPlan, StepResult, decode, encode
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.scheduler import Scheduler, SchedulerConfig
from specray.scheduler.sequence import Sequence, SequenceStatus
from specray.scheduler.speculation_policy import Decision, PolicyOutcome, PolicyView, SpeculationPolicy, StaticPolicy
from specray.scheduler.stats import SpecStats
from specray.scheduler.step import ScheduledStep, StepOutcome

__all__ = [
    "BlockManager", "CacheConfig", "SpeculationConfig", "MergedProposals", "merge_proposals", "PROTOCOL_VERSION",
    "ProtocolError", "Proposals", "StepPlan", "StepResult", "decode", "encode", "SamplingParams", "ScheduledStep",
    "StepOutcome", "Scheduler", "SchedulerConfig", "Sequence", "SequenceStatus", "SpecStats", "Decision",
    "PolicyOutcome", "PolicyView", "SpeculationPolicy", "StaticPolicy",
]
