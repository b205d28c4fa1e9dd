"""One emitted token's log-probability, as a request that asked for logprobs receives it.

The figure is the target's raw log-softmax at the position that emitted the token
(before temperature, top-k and top-p): what plain decoding reports for that token,
whether the token was an accepted proposal, a correction or the bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # The n most likely tokens at that position (n = SamplingParams.logprobs), by logprob
    # descending; they may include token_id itself.
    top: list[tuple[int, float]] = field(default_factory=list)
