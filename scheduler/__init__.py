"""The decisions of specray: pure Python, no torch, no ray.

Glossary: one name per quantity, from the configuration to the workers (and
``docs/architecture.md``).

- ``num_speculative_tokens``: the most tokens a sequence proposes in a step (the user's
  setting, ``SpeculationConfig``; 0 with ``proposer="none"``). Written k in formulas, and
  ``k`` names nothing else.
- ``max_model_len``, ``draft_max_model_len``: the windows in force, the target's and the
  draft model's (``specray.runtime.settled`` decides both once; past the draft's window a
  sequence decodes without proposals).
- ``proposal_limit``: the most one sequence may propose this step, by its limits: its
  remaining ``max_tokens``, both models' windows, ``num_speculative_tokens``, its draft
  worker being up, its request not decoding plainly (``SamplingParams.speculation``;
  ``Scheduler.proposal_limit``).
- ``proposal_len``: what one sequence is asked to propose this step, at most its limit:
  the policy's choice (``Decision``), lowered to 0 where its draft's KV pool is short
  (``Sequence.proposal_len``, ``StepPlan.proposal_lens``).
- ``width``: a step's longest ``proposal_len``; proposals and draft probabilities travel
  as ``[n, width]`` grids (``StepPlan.width``).
- ``num_lookahead``: the KV slots a step reserves past a sequence's tokens for its
  proposals (``proposal_len`` on the target, one fewer on the draft, more for a
  pre-draft): ``BlockManager.allocate_slots(seq_id, num_tokens, num_lookahead)``;
  ``blocks_needed(num_slots, block_size)`` is the one rounding up to blocks.
- ``num_computed``: tokens already in a worker's KV cache for a sequence
  (``Sequence.target_computed`` / ``draft_computed``); a step feeds ``tokens[num_computed:]``.
- ``step_len``: a sequence's length when its step was planned (``Sequence.step_len``):
  the position of its first scored row, so ``target_computed = step_len + accepted``.
- ``num_written``: a worker's count of a sequence's slots its last step wrote (fed tokens
  and lookahead); a plan's ``num_computed`` may never pass it (``KVCache``).
- ``chunk_len``: the tokens a prefill chunk feeds this step, 0 where a step feeds all of
  ``tokens[num_computed:]`` (``Sequence.chunk_len``; chunked prefill under
  ``max_num_batched_tokens``).
- a cached block's name: the hash chain of its prefix in the driver
  (``specray.scheduler.prefix_cache``), the mirror's block id in a plan to a worker
  (``StepPlan.hit_names``, ``cached_names``, ``evicted_names``).
- a verdict (``Verdict``), per sequence and step: ``proposed`` (proposals verified, at
  most its ``proposal_len``: a proposer may find fewer), ``accepted`` (the longest prefix
  of them the target keeps) and the emitted ``tokens``: the accepted ones, then the
  target's own next token (a correction, or the bonus token when all were accepted), so
  accepted + 1 of them. ``Sequence.apply`` holds the token accounting that follows.
"""

from specray.scheduler.block_manager import BlockManager
from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.scheduler.merge import merge_proposals
from specray.scheduler.messages import PROTOCOL_VERSION, Proposals, ProtocolError, StepPlan, StepResult, decode, encode
from specray.scheduler.sampling_params import SamplingParams
from specray.scheduler.scheduler import Scheduler
from specray.scheduler.sequence import Sequence, SequenceStatus
from specray.scheduler.speculation_policy import Decision, PolicyView, SpeculationPolicy, StaticPolicy
from specray.scheduler.stats import SpecStats
from specray.scheduler.step import ScheduledStep, StepOutcome, Verdict
from specray.scheduler.token_logprob import TokenLogprob

__all__ = [
    "BlockManager", "CacheConfig", "SpeculationConfig", "merge_proposals", "PROTOCOL_VERSION", "ProtocolError",
    "Proposals", "StepPlan", "StepResult", "decode", "encode", "SamplingParams", "ScheduledStep", "StepOutcome",
    "Verdict", "Scheduler", "Sequence", "SequenceStatus", "SpecStats", "Decision", "PolicyView",
    "SpeculationPolicy", "StaticPolicy", "TokenLogprob",
]
