"""The configuration sections the scheduler reads: the KV cache and batch limits, and
speculation. Plain frozen dataclasses that validate themselves; ``specray.RuntimeConfig``
composes them with the model and cluster sections and hands each layer its section whole.

Each field's ``metadata["help"]`` is its documentation, and the CLI builds its flags and
their defaults from the fields (``specray.config_flags``), so no default is restated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROPOSERS = ("draft", "ngram", "suffix", "draft+suffix", "eagle3", "eagle3+suffix", "none")
# The proposers that run a draft model (and need ModelConfig.draft).
DRAFT_MODEL_PROPOSERS = ("draft", "draft+suffix")
# The proposers that run an EAGLE-3 head in the target worker (ModelConfig.draft is the head).
HEAD_PROPOSERS = ("eagle3", "eagle3+suffix")
POLICIES = ("static", "adaptive")


# The part of a worker's GPU share its memory may fill (vLLM's default): the rest is left
# to the CUDA context, the allocator's fragmentation and other tenants' small needs.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def check_int(name: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def check_number(name: str, value, positive: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (value <= 0 if positive else value < 0):
        raise ValueError(f"{name} must be a number {'>' if positive else '>='} 0, got {value!r}")


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache and batch limits, shared by the scheduler and every worker."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "KV blocks per worker (default: enough for max_num_seqs at full length, within memory)"})
    max_num_seqs: int = field(default=256, metadata={"help": "sequences in one step, at most"})
    max_num_batched_tokens: int = field(default=8192, metadata={
        "help": "tokens a step feeds at most: running sequences first, then newcomers; a prompt longer than what "
                "is left is prefilled in chunks over several steps while the others decode (docs/prefix-caching.md)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV of full blocks of a prompt prefix already computed (in every model: target and "
                "draft) instead of computing it again (docs/prefix-caching.md)"})
    gpu_memory_utilization: float | None = field(default=None, metadata={
        "help": "on CUDA, the fraction of one GPU's total memory a worker may hold: weights, KV cache, CUDA "
                "graphs, activations (co-located: the driver's workers together) (default: 0.9 times the part "
                "of a GPU it asks Ray for)"})

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks)
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")


@dataclass(frozen=True)
class SpeculationConfig:
    """What proposes, and how many tokens a sequence proposes per step. With
    ``proposer="none"`` nothing does: ``num_speculative_tokens`` is 0 there whatever was
    asked, and ``overlap`` is on only with the draft model alone (host-side proposals cost
    nothing to hide)."""

    proposer: str = field(default="draft", metadata={
        "help": "draft model, n-gram prompt lookup, suffix decoding (what earlier requests emitted), both the "
                "draft and suffix decoding (per sequence, the proposal expected to be accepted longer), an "
                "EAGLE-3 head (draft: its checkpoint; it reads the target's hidden states in the target worker), "
                "the head and suffix decoding (as draft+suffix), or none (plain decoding)", "choices": PROPOSERS})
    num_speculative_tokens: int = field(default=4, metadata={
        "help": "tokens a sequence proposes per step, at most", "flags": ("-k", "--num-speculative-tokens")})
    speculation_policy: str = field(default="static", metadata={
        "help": "num_speculative_tokens for every sequence, or each sequence's own proposal_len chosen for "
                "goodput", "choices": POLICIES, "flags": ("--policy", "--speculation-policy")})
    disable_by_batch_size: int | None = field(default=None, metadata={
        "help": "no speculation once this many sequences run"})
    policy_options: dict = field(default_factory=dict, metadata={
        "help": "the policy's own settings, JSON (adaptive: AdaptiveConfig fields, e.g. '{\"rate_spread\": false}')"})
    # None: on wherever draft actors run beside the target (resolved by the driver, which
    # knows): over its link it pays at batch 1 (docs/overlap.md).
    overlap: bool | None = field(default=None, metadata={
        "help": "draft actors pre-draft the next window while the target verifies (default: wherever draft "
                "actors run beside the target, i.e. the actor layout without compiled graphs; docs/overlap.md)"})
    ngram_max: int = field(default=3, metadata={"help": "longest n-gram the prompt lookup matches"})
    ngram_min: int = field(default=1, metadata={"help": "shortest n-gram the prompt lookup matches"})
    suffix_cache_requests: int = field(default=64, metadata={
        "help": "suffix decoding: finished requests whose tokens the global tree keeps (first in, first out; 0: "
                "each request's own tree only)"})
    suffix_max_nodes: int = field(default=1_000_000, metadata={
        "help": "suffix decoding: the global tree's node budget (about 250 bytes a node); the oldest requests "
                "leave past it"})
    suffix_max_depth: int = field(default=24, metadata={
        "help": "suffix decoding: longest path (matched context and continuation) the trees hold"})
    suffix_min_prob: float = field(default=0.1, metadata={
        "help": "suffix decoding: a continuation stops where its path's chance (child over parent counts) falls "
                "below this"})
    suffix_spec_factor: float = field(default=1.0, metadata={
        "help": "suffix decoding: a match of m tokens proposes at most m times this many"})

    def __post_init__(self) -> None:
        check_choice("proposer", self.proposer, PROPOSERS)
        check_choice("speculation_policy", self.speculation_policy, POLICIES)
        check_int("num_speculative_tokens", self.num_speculative_tokens, 0 if self.proposer == "none" else 1)
        if self.overlap is not None:
            check_bool("overlap", self.overlap)
        if not isinstance(self.policy_options, dict) or not all(isinstance(k, str) for k in self.policy_options):
            raise ValueError(f"policy_options must map option names to values, got {self.policy_options!r}")
        if self.policy_options and self.speculation_policy == "static":
            raise ValueError(f"policy_options: the static policy has no options, got {sorted(self.policy_options)}")
        if self.disable_by_batch_size is not None:
            check_int("disable_by_batch_size", self.disable_by_batch_size)
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int)
                and 1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        check_int("suffix_cache_requests", self.suffix_cache_requests, 0)
        check_int("suffix_max_nodes", self.suffix_max_nodes)
        check_int("suffix_max_depth", self.suffix_max_depth, 2)
        check_number("suffix_min_prob", self.suffix_min_prob)
        if self.suffix_min_prob > 1:
            raise ValueError(f"suffix_min_prob must be in (0, 1], got {self.suffix_min_prob}")
        check_number("suffix_spec_factor", self.suffix_spec_factor)
        if self.proposer == "none":
            object.__setattr__(self, "num_speculative_tokens", 0)
        if self.proposer != "draft":
            object.__setattr__(self, "overlap", False)

    @property
    def suffix(self) -> bool:
        """Whether suffix decoding proposes (alone or beside the draft model)."""
        return self.proposer in ("suffix", "draft+suffix", "eagle3+suffix")

    @property
    def draft_model(self) -> bool:
        """Whether a draft model proposes."""
        return self.proposer in DRAFT_MODEL_PROPOSERS

    @property
    def suffix_beside(self) -> bool:
        """Whether suffix decoding proposes beside a model (the draft's or a head's), per
        sequence the proposal expected to be accepted longer verified."""
        return self.proposer in ("draft+suffix", "eagle3+suffix")

    @property
    def head(self) -> bool:
        """Whether an EAGLE-3 head proposes (in the target worker's process)."""
        return self.proposer in HEAD_PROPOSERS
