"""What a worker is built from: the model section of ``RuntimeConfig``, handed to every
worker whole with the cache section (``specray.scheduler.config.CacheConfig``). Plain
types without torch, so the driver's side (the client process that defines the actors)
can name them cheaply."""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.scheduler.config import check_choice, check_int

DEVICES = ("auto", "cpu", "cuda")
EXECUTORS = ("auto", "native", "transformers")


@dataclass(frozen=True)
class ModelConfig:
    """The model pair and how it runs: the section of ``RuntimeConfig`` every worker reads."""

    target: str = field(default="", metadata={"help": "target model: a local Hugging Face directory or hub id"})
    draft: str | None = field(default=None, metadata={
        "help": "draft model (proposer 'draft'): a local directory or hub id"})
    device: str = field(default="auto", metadata={"help": "cuda when present, else cpu", "choices": DEVICES})
    dtype: str = field(default="auto", metadata={
        "help": "auto (the checkpoint's on CUDA, float32 on CPU), float32, bfloat16 or float16"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context window (default: the target's max_position_embeddings)"})
    draft_max_model_len: int | None = field(default=None, metadata={
        "help": "the draft model's context window, within max_model_len (default: its max_position_embeddings); "
                "past it a sequence decodes without proposals"})
    executor: str = field(default="auto", metadata={
        "help": "forward path: auto (specray's own for Llama/Mistral/Qwen2/Qwen3, else transformers), "
                "native (refuse other models) or transformers", "choices": EXECUTORS})
    torch_threads: int = field(default=0, metadata={
        "help": "torch threads of each worker process (0: Ray's default, one a process; a co-located "
                "runtime's one process may take every core)"})
    cuda_graphs: bool = field(default=True, metadata={
        "help": "on CUDA, replay decode and verify steps of the native executor as CUDA graphs "
                "(every batch bucket captured at start-up); off: every step eager"})
    cuda_graph_query_lens: tuple = field(default=(), metadata={
        "help": "tokens per sequence of the uniform steps captured as CUDA graphs (default: the steps the "
                "runtime sends: 1 and num_speculative_tokens + 1 on the target, decode and verify windows; 1 and "
                "2 on the draft, its passes and its catch-up after a fully accepted window)", "cli": False})

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError("target must be a model path or hub id")
        if self.draft is not None and (not isinstance(self.draft, str) or not self.draft):
            raise ValueError(f"draft must be a model path or hub id, got {self.draft!r}")
        check_choice("device", self.device, DEVICES)
        if not isinstance(self.dtype, str):
            raise ValueError(f"dtype must be a string, got {self.dtype!r}")
        for name in ("max_model_len", "draft_max_model_len"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 2)
        check_choice("executor", self.executor, EXECUTORS)
        check_int("torch_threads", self.torch_threads, 0)
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        lens = self.cuda_graph_query_lens
        if not isinstance(lens, tuple) or any(isinstance(q, bool) or not isinstance(q, int) or q < 1 for q in lens):
            raise ValueError(f"cuda_graph_query_lens must be a tuple of ints >= 1, got {lens!r}")
