"""The runtime's one validated configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

PROPOSERS = ("draft", "ngram", "none")
PLACEMENT_STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class RuntimeConfig:
    target: str
    draft: str | None = None
    proposer: str = "draft"                 # "draft" | "ngram" | "none"
    num_speculative_tokens: int = 4
    block_size: int = 16
    num_kv_blocks: int | None = None         # per worker; None: from memory
    max_model_len: int | None = None         # None: the target's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_pending: int = 4096                  # accepted, unfinished requests; a submit past it is refused
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    num_draft_workers: int = 1
    num_target_workers: int = 1
    draft_resources: dict[str, float] = field(default_factory=dict)
    target_resources: dict[str, float] = field(default_factory=dict)
    max_worker_restarts: int = 3             # Ray restarts a dead worker actor this many times
    target_down_timeout_s: float = 120.0     # requests fail once every target worker is gone this long
    colocate: bool = False                   # draft and target run inside the driver's actor: no hops
    compiled_graph: bool = False             # driver <-> worker steps over Ray Compiled Graph channels
    placement_strategy: str = "SPREAD"
    placement_timeout_s: float = 300.0       # an autoscaler may need minutes to add nodes
    ray_address: str | None = None
    name: str | None = None                  # a named driver can be attached with SpecRuntime.connect
    namespace: str = "specray"
    detached: bool = False
    ngram_max: int = 3
    ngram_min: int = 1
    speculation_policy: str = "static"      # "static" | "adaptive" (per-sequence k_i by goodput)
    disable_by_batch_size: int | None = None # no speculation once this many sequences run
    draft_early_stop: bool = True            # adaptive, batch 1: the draft stops where a proposal would not pay
    # Adaptive with draft_early_stop: a sequence alone in the batch proposes up to this
    # many, its draft stopping where the next proposal would not pay (None: twice
    # num_speculative_tokens); batches of two or more stay within num_speculative_tokens.
    max_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError("target must be a model path or hub id")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.proposer!r}")
        if self.proposer == "draft" and not self.draft:
            raise ValueError("draft must be set when proposer='draft'")
        if self.proposer != "draft" and self.draft:
            raise ValueError(f"draft must be None when proposer={self.proposer!r}")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens, allow_zero=self.proposer == "none")
        _positive_int("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
            if self.max_model_len < 2:
                raise ValueError("max_model_len must be >= 2")
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_pending", self.max_pending)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        _positive_int("seed", self.seed, allow_zero=True)
        _positive_int("num_draft_workers", self.num_draft_workers)
        _positive_int("num_target_workers", self.num_target_workers)
        _positive_int("max_worker_restarts", self.max_worker_restarts, allow_zero=True)
        if not isinstance(self.target_down_timeout_s, (int, float)) or self.target_down_timeout_s <= 0:
            raise ValueError(f"target_down_timeout_s must be > 0, got {self.target_down_timeout_s!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {self.placement_strategy!r}")
        if not isinstance(self.placement_timeout_s, (int, float)) or self.placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s must be > 0, got {self.placement_timeout_s!r}")
        for name in ("draft_resources", "target_resources"):
            res = getattr(self, name)
            if not isinstance(res, dict) or any(not isinstance(v, (int, float)) or v < 0 for v in res.values()):
                raise ValueError(f"{name} must map resource names to non-negative amounts")
        if self.speculation_policy not in ("static", "adaptive"):
            raise ValueError(f"speculation_policy must be 'static' or 'adaptive', got {self.speculation_policy!r}")
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if not isinstance(self.draft_early_stop, bool):
            raise ValueError(f"draft_early_stop must be True or False, got {self.draft_early_stop!r}")
        if self.max_speculative_tokens is not None:
            _positive_int("max_speculative_tokens", self.max_speculative_tokens)
            if not self._stops:
                raise ValueError("max_speculative_tokens applies to speculation_policy='adaptive' with "
                                 "proposer='draft' and draft_early_stop=True (a draft that stops early)")
            if self.max_speculative_tokens < self.num_speculative_tokens:
                raise ValueError(f"max_speculative_tokens {self.max_speculative_tokens} must be >= "
                                 f"num_speculative_tokens {self.num_speculative_tokens}")
        if self.compiled_graph and self.colocate:
            raise ValueError("compiled_graph needs worker actors; colocate=True runs the workers in the driver")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")

    @property
    def k(self) -> int:
        return 0 if self.proposer == "none" else self.num_speculative_tokens

    @property
    def _stops(self) -> bool:
        return self.speculation_policy == "adaptive" and self.proposer == "draft" and self.draft_early_stop

    @property
    def alone_k(self) -> int | None:
        """The cap of a sequence alone in the batch, where its draft may stop early; None
        where no draft stops (every sequence is within ``k``)."""
        if not self._stops:
            return None
        return self.max_speculative_tokens or 2 * self.num_speculative_tokens

    @property
    def widest_k(self) -> int:
        """The longest proposal of any step: the lookahead a step may write."""
        return self.alone_k or self.k


def _positive_int(name: str, value, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise ValueError(f"{name} must be an int >= {0 if allow_zero else 1}, got {value!r}")
