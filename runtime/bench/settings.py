"""What one ``specray bench`` run measures: its settings, one configuration's figures
(``Run``), and the phases a step's time is split into."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.workers.config import ModelConfig


@dataclass
class BenchSettings:
    target: str
    draft: str | None                 # None: no draft runs (n-gram and plain decoding only)
    head: str | None = None           # an EAGLE-3 head: eagle3 runs beside the other proposers
    k: int = SpeculationConfig.num_speculative_tokens
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    max_tokens: int = 64
    repeats: int = 3
    temperature: float = 0.8          # for the sampled runs
    device: str = ModelConfig.device
    dtype: str = ModelConfig.dtype
    executor: str = ModelConfig.executor      # specray's forward path (native or transformers)
    out_dir: str = "bench_out"
    prompt_bytes: int = 160
    block_size: int = CacheConfig.block_size
    progress: bool = True
    policies: tuple[str, ...] = ("static",)   # speculation policies of the specray draft and n-gram runs
    colocate: bool = False                    # specray's workers inside the driver's process
    # Layouts the draft runs in (RuntimeConfig.layout); every configuration runs in the
    # first, the first draft policy in the others too, side by side. Empty: "colocated"
    # with ``colocate``, else "actors". "colocated" among several also brings
    # "colocated-all-cores": co-located with every core given to its one process.
    layouts: tuple[str, ...] = ()
    # Each repeat's batch of b takes the next b held-out prompts, so batch 1 meets a new
    # text every repeat (see ``batch_prompts``).
    rotate_prompts: bool = False
    # The order configurations run in is drawn per repeat from this seed (None: a fresh
    # one each bench, recorded in the JSON), see ``run.run_order``.
    order_seed: int | None = None
    # More fixed k's for the draft at batch 1, where adaptive is held to the best of them.
    static_ks: tuple[int, ...] = ()
    # Adaptive policies with other options (name -> policy_options), run beside the
    # adaptive one at every batch size: each mechanism's worth, measured side by side.
    variants: dict[str, dict] = field(default_factory=dict)
    prompt_set: str = "code"                  # bench_prompts.PROMPT_SETS
    # Each draft policy also runs with overlap on (policy "<name>+overlap"), side by side
    # with it off; not co-located (overlap needs draft actors of their own).
    overlap: bool = True


SPECULATING = ("draft", "ngram", "suffix", "draft+suffix", "eagle3")      # the proposers held to plain decoding

# Step-time breakdown: name in the report -> metrics() counter; together they make up a step.
PHASES = {"schedule": "schedule_s", "draft": "draft_compute_s", "merge": "merge_s",
          "verify": "verify_compute_s", "messaging": "messaging_s", "driver": "driver_overhead_s"}


@dataclass
class Run:
    system: str                        # "specray" | "hf"
    proposer: str                      # "draft" | "ngram" | "none" | "assisted" | "lookup" (HF prompt lookup)
    batch_size: int
    mode: str = "greedy"               # "greedy" | "sampled"
    policy: str = "static"
    k: int | None = None               # an extra static run's fixed k (static_ks); None: the bench's k
    tokens_per_s: float = 0.0
    tokens_per_s_min: float = 0.0
    tokens_per_s_max: float = 0.0
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    samples: list[float] = field(default_factory=list)
    accepted: int = 0
    drafted: int = 0
    emitted: int = 0
    seq_steps: int = 0
    steps: int = 0
    phase_s: dict[str, float] = field(default_factory=dict)
    # Per step (specray runs): where the time went, in ms; ``overhead`` is everything but
    # the workers' own compute.
    step_ms: dict[str, float] | None = None
    overlap: bool = False              # draft actors pre-draft while the target verifies
    # Overlap runs: windows pre-drafted, taken and dropped, and the draft time that ran
    # behind verification, over all repeats.
    predrafted: int = 0
    predraft_used: int = 0
    predraft_dropped: int = 0
    draft_hidden_s: float = 0.0
    layout: str | None = None          # specray runs: RuntimeConfig.layout (or colocated-all-cores)
    torch_threads: int = 1             # torch threads of each process computing the run

    @property
    def key(self) -> tuple:
        return (self.system, self.proposer, self.batch_size, self.mode, self.policy, self.k)

    @property
    def label(self) -> str:
        return (self.proposer + (f"/{self.policy}" if self.proposer in SPECULATING else "")
                + (f"/k{self.k}" if self.k is not None else ""))

    def finish(self) -> None:
        self.tokens_per_s = statistics.median(self.samples)
        self.tokens_per_s_min, self.tokens_per_s_max = min(self.samples), max(self.samples)
        if self.drafted:
            self.acceptance_rate = self.accepted / self.drafted
        if self.seq_steps:
            self.mean_accepted_length = self.emitted / self.seq_steps
        if self.steps:
            ms = {name: self.phase_s[key] / self.steps * 1e3 for name, key in PHASES.items()}
            ms["step"] = sum(ms.values())
            ms["overhead"] = ms["step"] - ms["draft"] - ms["verify"]
            self.step_ms = ms
