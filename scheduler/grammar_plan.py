"""What a step's plan carries for its constrained sequences (``StepPlan.grammar_lens`` and
the fields after it): each one's ``StructuredOutput.key`` and its whole output so far.

The output travels whole, not as a delta against what a worker is believed to hold: a
worker's matcher is then right after anything that resets or moves a sequence (a
preemption, a worker restart, a driver's fail-over resuming the request from its tokens,
a prefix-cache hit), because the worker brings its matcher to exactly these tokens
(``specray.workers.grammar.GrammarBook.sync``), rolling back or advancing as needed.
"""

from __future__ import annotations

from specray.scheduler.messages import StepPlan
from specray.scheduler.sequence import Sequence


def add_grammars(plan: StepPlan, seqs: list[Sequence]) -> None:
    """``plan``'s structured-output fields for ``seqs`` (its sequences, in its order), whose
    ``step_len`` is set."""
    for seq in seqs:
        spec = seq.params.structured_output
        key = spec.key.encode() if spec is not None else b""
        plan.grammar_lens.append(len(key))
        plan.grammar_bytes.extend(key)
        out = seq.tokens[seq.prompt_len:seq.step_len] if spec is not None else []
        plan.output_lens.append(len(out))
        plan.output_token_ids.extend(out)
