"""proposer="eagle3" in the actor layout, on Ray (the built-in target and its default head
tiny-eagle3, in the driver's actor): greedy output is the target's. (A driver's fail-over
is tested in process, test_eagle3_runtime: a resumed request recomputes on a fresh driver.)"""

from __future__ import annotations

from specray_testing import hf_greedy

import specray
from specray import RuntimeConfig, SamplingParams, SpecRuntime

PROMPTS = ["def add(a, b):", "class Stack:\n", "for i in range(10):"]


def test_actor_layout_output_is_the_targets(ray_module):
    target = specray.builtin_model("tiny-target")
    rt = SpecRuntime(RuntimeConfig(target=target, proposer="eagle3", num_speculative_tokens=3, device="cpu",
                                   dtype="float32", layout="actors"))
    try:
        outs = rt.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
        m = rt.metrics()
        assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] > 0
        want = hf_greedy(target, [list(o.prompt_token_ids) for o in outs], 24)
        assert [list(o.token_ids) for o in outs] == want
    finally:
        rt.shutdown()
