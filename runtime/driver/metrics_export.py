"""Driver metrics on Ray's metrics API: they appear on the Ray dashboard and its
Prometheus endpoint as ``ray_specray_*``. Updated from the step loop at most every
``interval_s``, so exporting costs nothing per step."""

from __future__ import annotations

import time

GAUGES = {
    "acceptance_rate": "accepted / proposed draft tokens over the runtime's life",
    "mean_accepted_length": "tokens emitted per sequence-step",
    "system_efficiency": "emitted / (sequence-steps * (num_speculative_tokens + 1)): of the most a step could emit",
    "mean_proposal_len": "mean proposal_len of the last step",
    "tokens_per_s": "emitted tokens per second of step time",
    "num_running": "sequences running",
    "num_waiting": "requests waiting for admission",
    "mean_step_s": "mean wall time of a step",
    "mean_draft_s": "mean time of a draft call",
    "mean_verify_s": "mean time of a verify call",
    "mean_overhead_s": "mean time of a step outside the workers' own compute (schedule, merge, messaging, driver)",
    "mean_mask_s": "mean host time per step of structured output's grammar masks (draft and target)",
}
COUNTERS = {
    "num_draft_tokens": "draft tokens proposed",
    "num_accepted_tokens": "draft tokens accepted",
    "num_emitted_tokens": "tokens emitted",
    "num_steps": "steps run",
    "num_spec_off_steps": "steps in which no sequence speculated",
    "num_preemptions": "sequences preempted",
    "num_requests_finished": "requests finished",
    "num_requests_aborted": "requests their clients abandoned (freed before the next step)",
}


class RayMetrics:
    def __init__(self, driver_name: str, interval_s: float = 0.5) -> None:
        from ray.util.metrics import Counter, Gauge

        self.tags = {"driver": driver_name}
        self.interval_s = interval_s
        self._last = 0.0
        self._counted: dict[str, float] = {}
        self.gauges = {k: Gauge(f"specray_{k}", description=d, tag_keys=("driver",)) for k, d in GAUGES.items()}
        self.counters = {k: Counter(f"specray_{k}_total", description=d, tag_keys=("driver",))
                         for k, d in COUNTERS.items()}
        self.kv_used = Gauge("specray_kv_blocks_used", description="KV blocks in use per worker",
                             tag_keys=("driver", "worker"))
        self.by_position = Gauge("specray_acceptance_by_position",
                                 description="of the proposals at draft position j, the share accepted",
                                 tag_keys=("driver", "position"))

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.interval_s

    def update(self, m: dict) -> None:
        self._last = time.monotonic()
        for k, g in self.gauges.items():
            g.set(float(m[k]), tags=self.tags)
        for k, c in self.counters.items():
            delta = m[k] - self._counted.get(k, 0)
            if delta > 0:
                c.inc(float(delta), tags=self.tags)
                self._counted[k] = m[k]
        for j, rate in enumerate(m["acceptance_by_position"], 1):
            self.by_position.set(float(rate), tags={**self.tags, "position": str(j)})
        for kind in ("target", "draft"):
            for i, used in enumerate(m[f"{kind}_kv_blocks_used"]):
                self.kv_used.set(float(used), tags={**self.tags, "worker": f"{kind}{i}"})
