"""The runtime's one validated configuration, in sections by concern.

``RuntimeConfig`` holds four sections, each a frozen dataclass that validates itself and
is handed whole to the layer that reads it:

- ``model`` (``ModelConfig``): the target, the draft, device, dtype, window;
- ``cache`` (``CacheConfig``): KV blocks and batch limits;
- ``speculation`` (``SpeculationConfig``): proposer, k, policy;
- ``cluster`` (``ClusterConfig``): workers, placement, Ray;

plus ``seed`` and ``max_pending``. Users name fields flat, as documented:
``RuntimeConfig(target=..., draft=..., num_speculative_tokens=4, block_size=16)``: the
constructor takes every section's fields as keywords and hands each to the section that
declares it; the code reads them back through their section
(``config.cache.block_size``). Field names are unique across sections, so a flat name is
never ambiguous.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specray.scheduler.config import CacheConfig, SpeculationConfig, check_bool, check_choice, check_int, check_number
from specray.workers.config import ModelConfig

PLACEMENT_STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
LAYOUTS = ("auto", "actors", "colocated")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the workers run and how the runtime reaches Ray."""

    num_draft_workers: int = field(default=1, metadata={"help": "draft worker actors (data parallel shards)"})
    num_target_workers: int = field(default=1, metadata={"help": "target worker actors (data parallel)"})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks of each target worker (tensor parallel): its rank 0 in the driver's process, the others "
                "Ray actors on the driver's node, one device each (gloo on CPU, float32 only; NCCL on CUDA)"})
    draft_tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks of each draft worker (tensor parallel): its rank 0 the draft actor, the others actors it "
                "starts on its node; needs the actor layout"})
    tensor_parallel_timeout_s: float = field(default=60.0, metadata={
        "help": "a tensor-parallel rank waits this long for its peers in a collective before its group is "
                "taken down and formed again (s)"})
    draft_resources: dict = field(default_factory=dict, metadata={
        "help": 'what each draft worker asks Ray for, JSON, e.g. \'{"specray_draft": 1}\''})
    target_resources: dict = field(default_factory=dict, metadata={
        "help": 'what each target worker asks Ray for, JSON, e.g. \'{"specray_target": 1}\''})
    max_worker_restarts: int = field(default=3, metadata={"help": "Ray restarts a dead worker this many times"})
    max_driver_restarts: int = field(default=10, metadata={
        "help": "Ray restarts a dead driver this many times (-1: always); its requests resume"})
    driver_restart_timeout_s: float = field(default=300.0, metadata={
        "help": "a client waits this long for a dead driver to serve again before failing its calls (s)"})
    target_down_timeout_s: float = field(default=120.0, metadata={
        "help": "requests fail once every target worker has been gone this long (s)"})
    layout: str = field(default="auto", metadata={
        "help": "actors: draft workers on actors of their own, the target in the driver's process (one hop a "
                "step); colocated: draft and target in the driver's process; auto: colocated where they would "
                "share one device or one machine's CPUs and nothing asks for separate resources",
        "choices": LAYOUTS})
    groups_in_flight: int = field(default=2, metadata={
        "help": "in the actor layout at batch >= 2, the draft proposes for one group of sequences while the "
                "target verifies the other (2), or each step runs alone (1)", "choices": (1, 2)})
    worker_link: bool = field(default=True, metadata={
        "help": "the driver reaches worker actors (drafts, data-parallel targets) on a socket of their own instead "
                "of Ray actor calls, which cost a task submission each; Ray calls where the socket cannot be "
                "reached or Ray runs with TLS"})
    placement_strategy: str = field(default="SPREAD", metadata={
        "help": "placement group strategy of the workers", "choices": PLACEMENT_STRATEGIES})
    placement_timeout_s: float = field(default=300.0, metadata={
        "help": "seconds to wait for the cluster (or its autoscaler) to place every worker",
        "flags": ("--placement-timeout", "--placement-timeout-s")})
    ray_address: str | None = field(default=None, metadata={
        "help": "cluster to join (default: this process's Ray, else RAY_ADDRESS, else a private local Ray)"})
    ray_connect_timeout_s: float = field(default=30.0, metadata={
        "help": "seconds to wait for the cluster at ray_address to answer before refusing it",
        "flags": ("--ray-connect-timeout", "--ray-connect-timeout-s")})
    name: str | None = field(default=None, metadata={
        "help": "a named driver can be attached with SpecRuntime.connect", "cli": False})
    namespace: str = field(default="specray", metadata={"help": "Ray namespace of the driver", "cli": False})
    detached: bool = field(default=False, metadata={"help": "the driver outlives its creator", "cli": False})

    def __post_init__(self) -> None:
        check_int("num_draft_workers", self.num_draft_workers)
        check_int("num_target_workers", self.num_target_workers)
        check_int("tensor_parallel_size", self.tensor_parallel_size)
        check_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size)
        check_number("tensor_parallel_timeout_s", self.tensor_parallel_timeout_s)
        check_int("max_worker_restarts", self.max_worker_restarts, 0)
        check_int("max_driver_restarts", self.max_driver_restarts, -1)
        check_number("driver_restart_timeout_s", self.driver_restart_timeout_s)
        check_number("target_down_timeout_s", self.target_down_timeout_s)
        check_number("placement_timeout_s", self.placement_timeout_s)
        check_number("ray_connect_timeout_s", self.ray_connect_timeout_s)
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address):
            raise ValueError(f"ray_address must be None, 'auto' or host:port, got {self.ray_address!r}")
        check_choice("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        check_choice("layout", self.layout, LAYOUTS)
        check_choice("groups_in_flight", self.groups_in_flight, (1, 2))
        for name in ("worker_link", "detached"):
            check_bool(name, getattr(self, name))
        for name in ("draft_resources", "target_resources"):
            res = getattr(self, name)
            if not isinstance(res, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
                                                for v in res.values()):
                raise ValueError(f"{name} must map resource names to non-negative amounts")


SECTIONS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "speculation": SpeculationConfig,
                             "cluster": ClusterConfig}
# flat field name -> the section declaring it
FIELD_SECTION: dict[str, str] = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}

# A flat keyword left out: its section's default (or the given section's value) stands.
_UNSET: Any = dataclasses.MISSING


@dataclass(init=False, frozen=True)
class RuntimeConfig:
    model: ModelConfig
    cache: CacheConfig
    speculation: SpeculationConfig
    cluster: ClusterConfig
    seed: int = 0              # the runtime's generator: requests without their own seed draw from it
    max_pending: int = 4096    # accepted, unfinished requests; an online submit past it is refused

    def __init__(
        self, target: str = _UNSET, draft: str | None = _UNSET, *,
        # ModelConfig
        device: str = _UNSET, dtype: str = _UNSET, max_model_len: int | None = _UNSET,
        draft_max_model_len: int | None = _UNSET, executor: str = _UNSET,
        torch_threads: int = _UNSET,
        cuda_graphs: bool = _UNSET, cuda_graph_query_lens: tuple = _UNSET,
        # CacheConfig
        block_size: int = _UNSET, num_kv_blocks: int | None = _UNSET, max_num_seqs: int = _UNSET,
        max_num_batched_tokens: int = _UNSET, gpu_memory_utilization: float | None = _UNSET,
        enable_prefix_caching: bool = _UNSET,
        # SpeculationConfig
        proposer: str = _UNSET, num_speculative_tokens: int = _UNSET, speculation_policy: str = _UNSET,
        disable_by_batch_size: int | None = _UNSET, policy_options: dict = _UNSET, overlap: bool = _UNSET,
        ngram_max: int = _UNSET, ngram_min: int = _UNSET, suffix_cache_requests: int = _UNSET,
        suffix_max_nodes: int = _UNSET, suffix_max_depth: int = _UNSET, suffix_min_prob: float = _UNSET,
        suffix_spec_factor: float = _UNSET,
        # ClusterConfig
        num_draft_workers: int = _UNSET, num_target_workers: int = _UNSET, tensor_parallel_size: int = _UNSET,
        draft_tensor_parallel_size: int = _UNSET, tensor_parallel_timeout_s: float = _UNSET,
        draft_resources: dict = _UNSET,
        target_resources: dict = _UNSET, max_worker_restarts: int = _UNSET, target_down_timeout_s: float = _UNSET,
        max_driver_restarts: int = _UNSET, driver_restart_timeout_s: float = _UNSET,
        layout: str = _UNSET, groups_in_flight: int = _UNSET,
        worker_link: bool = _UNSET, placement_strategy: str = _UNSET,
        placement_timeout_s: float = _UNSET, ray_address: str | None = _UNSET,
        ray_connect_timeout_s: float = _UNSET, name: str | None = _UNSET, namespace: str = _UNSET,
        detached: bool = _UNSET,
        # whole sections (the flat keywords above override their fields) and the top level
        model: ModelConfig | None = None, cache: CacheConfig | None = None,
        speculation: SpeculationConfig | None = None, cluster: ClusterConfig | None = None,
        seed: int = 0, max_pending: int = 4096,
    ) -> None:
        args = dict(locals())
        flat = {k: v for k, v in args.items() if k in FIELD_SECTION and v is not _UNSET}
        given = {"model": model, "cache": cache, "speculation": speculation, "cluster": cluster}
        for section, cls in SECTIONS.items():
            mine = {k: v for k, v in flat.items() if FIELD_SECTION[k] == section}
            base = given[section]
            if base is not None and not isinstance(base, cls):
                raise ValueError(f"{section} must be a {cls.__name__}, got {type(base).__name__}")
            value = (dataclasses.replace(base, **mine) if mine else base) if base is not None else cls(**mine)
            object.__setattr__(self, section, value)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "max_pending", max_pending)
        self.__post_init__()

    def __post_init__(self) -> None:
        check_int("seed", self.seed, 0)
        check_int("max_pending", self.max_pending)
        proposer = self.speculation.proposer
        if self.speculation.head:
            self._settle_head()
        if self.speculation.draft_model and not self.model.draft:
            raise ValueError(f"draft must be set when proposer={proposer!r}")
        if not (self.speculation.draft_model or self.speculation.head) and self.model.draft:
            raise ValueError(f"draft must be None when proposer={proposer!r}")
        for name in ("tensor_parallel_size", "draft_tensor_parallel_size"):
            tp = getattr(self.cluster, name)
            if tp > 1 and self.model.executor == "transformers":
                raise ValueError(f"{name}={tp} needs the native executor; executor='transformers' "
                                 "runs whole models only")
        dtp = self.cluster.draft_tensor_parallel_size
        if dtp > 1 and not self.speculation.draft_model:
            raise ValueError(f"draft_tensor_parallel_size={dtp} needs a draft model (proposer={proposer!r})")
        if dtp > 1 and self.cluster.layout == "colocated":
            raise ValueError(f"draft_tensor_parallel_size={dtp} runs the draft on actors of its own: "
                             "layout='actors' (or 'auto')")

    def _settle_head(self) -> None:
        """An EAGLE-3 head is ``draft``; the built-in target's default is ``tiny-eagle3``.
        The head runs in the target worker, so each target worker has its own."""
        from specray.runtime.model_store import default_head

        proposer = self.speculation.proposer
        if not self.model.draft:
            head = default_head(self.model.target)
            if head is None:
                raise ValueError(f"draft: proposer={proposer!r} needs an EAGLE-3 head (its directory or hub id); "
                                 "only the built-in target has a default one (tiny-eagle3)")
            object.__setattr__(self, "model", dataclasses.replace(self.model, draft=head))
        if self.cluster.num_target_workers != 1:
            raise ValueError(f"num_target_workers: proposer={proposer!r} runs its head beside one target worker; "
                             f"{self.cluster.num_target_workers} data-parallel targets are not supported with it yet")
        if self.cluster.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size: proposer={proposer!r} runs its head beside an unsplit target; "
                             f"a target split in {self.cluster.tensor_parallel_size} is not supported with it yet")

    def replace(self, **changes) -> "RuntimeConfig":
        """A copy with flat fields (or whole sections, ``seed``, ``max_pending``) changed."""
        kwargs = {s: getattr(self, s) for s in SECTIONS}
        kwargs.update(seed=self.seed, max_pending=self.max_pending)
        kwargs.update(changes)
        return RuntimeConfig(**kwargs)
