"""One model, its paged KV cache, and a packed forward pass over both."""

from __future__ import annotations

import bisect
import itertools
import logging

import torch

from specray.scheduler.config import CacheConfig
from specray.scheduler.messages import StepPlan
from specray.workers import llama_model, model_loader, step_graphs
from specray.workers.config import ModelConfig
from specray.workers.errors import PlanError
from specray.workers.kv_cache import KVCache, default_num_blocks
from specray.workers.paged_attention import build_metadata, query_tail

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, path: str, model: ModelConfig, cache: CacheConfig, window_of: str | None = None) -> None:
        """``path``: the checkpoint this runner loads (the target or the draft of ``model``);
        ``window_of``: another checkpoint whose context window also bounds this one's (the
        draft serves the target's sequences). Read here, so the driver can start workers
        before it has loaded any config itself."""
        self.path = path
        self.max_num_seqs = cache.max_num_seqs
        self.model, self.config, self.device, self.dtype = model_loader.load_model(path, model.dtype, model.device)
        self.vocab_size = self.config.vocab_size
        # The driver never plans past the smaller of its max_model_len and the models' own
        # (the draft's scheduler window included), so neither may a plan.
        windows = [model.max_model_len, model_loader.max_model_len(self.config)]
        if window_of:
            windows.append(model_loader.max_model_len(model_loader.load_config(window_of)))
        self.max_model_len = min(w for w in windows if w)
        num_blocks = cache.num_kv_blocks or default_num_blocks(
            self.config, cache.block_size, self.dtype, self.device, self.max_model_len, cache.max_num_seqs)
        self.kv = KVCache(self.config, num_blocks, cache.block_size, self.dtype, self.device)
        self.native = self._select_executor(model.executor)
        if self.native is not None:
            # The native executor holds its own fused, transposed copies: drop the modules so
            # the weights are not held twice.
            self.model = None
        self.graphs = None
        if self.native is not None and model.cuda_graphs and step_graphs.available(self.device):
            self.graphs = step_graphs.StepGraphs(self.native, self.kv, cache.max_num_seqs, self.max_model_len,
                                                 capture=self.device.type == "cuda")
            log.info("specray executor: decode and verify steps of %s replay CUDA graphs (batch buckets up to %d)",
                     path, cache.max_num_seqs)

    def _select_executor(self, choice: str):
        """specray's own executor for the families it covers, else transformers' modules
        (``choice`` was validated with its ModelConfig)."""
        why = "executor='transformers'" if choice == "transformers" else llama_model.supports(self.model)
        if why and choice == "native":
            raise ValueError(f"executor='native' cannot run {self.path}: {why}")
        if why:
            log.info("specray executor: %s runs on the transformers path (%s)", self.path, why)
            return None
        native = llama_model.NativeCausalLM.from_hf(self.model, self.max_model_len)
        log.info("specray executor: %s runs on the native %s executor", self.path, self.config.model_type)
        return native

    @property
    def executor(self) -> str:
        return "transformers" if self.native is None else "native"

    @property
    def num_blocks(self) -> int:
        return self.kv.blocks.num_blocks

    def check_plan(self, plan: StepPlan) -> None:
        """The plan's own consistency and what this worker's limits allow, before its
        state is touched; the one place every caller's plan is checked (O(batch))."""
        plan.validate()
        n = plan.num_seqs
        if n > self.max_num_seqs:
            raise PlanError(f"StepPlan.seq_ids: {n} sequences, max_num_seqs is {self.max_num_seqs}")
        # The width sizes [n, width, V] buffers whatever the proposal lengths: bound it
        # before allocating.
        if plan.width > self.max_model_len:
            raise PlanError(f"StepPlan.width = {plan.width} exceeds max_model_len {self.max_model_len}")
        if n and max(plan.num_slots) > self.max_model_len:
            i = max(range(n), key=plan.num_slots.__getitem__)
            raise PlanError(f"StepPlan.num_slots[{i}]: sequence {plan.seq_ids[i]} reserves {plan.num_slots[i]} "
                            f"slots, max_model_len is {self.max_model_len}")
        self.check_tokens(plan)

    def check_tokens(self, plan: StepPlan) -> None:
        ids = plan.token_ids
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            j = next(j for j, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            i = bisect.bisect_right(list(itertools.accumulate(plan.num_new)), j)
            sid = plan.seq_ids[i] if i < plan.num_seqs else None
            raise PlanError(f"StepPlan.token_ids[{j}] (sequence {sid}): token id {ids[j]} is outside the "
                            f"vocabulary [0, {self.vocab_size})")

    @torch.inference_mode()
    def forward(self, seq_ids: list[int], num_computed: list[int], num_new: list[int],
                input_ids: torch.Tensor, logits_index: torch.Tensor, tail: list[int] | None = None) -> torch.Tensor:
        """input_ids: [T] on the device (packed, ``num_new[i]`` per sequence);
        logits_index: [m] packed rows whose logits are wanted; ``tail`` (optional): per
        sequence, how many of its last fed rows those lie in. Where the tails are at most
        half the step (a prefill, a draft's catch-up), the native executor's last layer
        runs on them alone. Returns float32 [m, V]."""
        tables = self.kv.tables(seq_ids)
        if self.graphs is not None:
            out = self.graphs.run(tables, num_computed, num_new, input_ids, logits_index)
            if out is not None:
                return out.float()
        meta, positions = build_metadata(self.kv.layers, tables, num_computed, num_new, self.kv.block_size,
                                         self.device)
        if self.native is not None:
            tail_step = None
            # A tail longer than what its sequence feeds would reach into the one before.
            if tail is not None and 2 * sum(tail) <= input_ids.shape[0] and all(map(int.__le__, tail, num_new)):
                tail_step = query_tail(self.kv.layers, tables, num_computed, num_new, tail, logits_index,
                                       self.kv.block_size, self.device)
            return self.native.forward(input_ids, positions, meta, logits_index, tail_step).float()
        out = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                         use_cache=False, logits_to_keep=logits_index, specray_meta=meta)
        return out.logits[0].float()

    def to_device(self, values: list[int], dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)


class ModelWorker:
    """What draft and target workers share: a model runner and what the driver asks of it."""

    def __init__(self, path: str, model: ModelConfig, cache: CacheConfig, window_of: str | None = None) -> None:
        self.runner = ModelRunner(path, model, cache, window_of)

    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def vocab_size(self) -> int:
        return self.runner.vocab_size
