"""One model, its paged KV cache, and a packed forward pass over both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.messages import StepPlan
from workers import model_loader
from workers.kv_cache import KVCache, default_num_blocks
from workers.paged_attention import build_metadata


@dataclass
class WorkerConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 256


class ModelRunner:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.model, self.config, self.device, self.dtype = model_loader.load_model(cfg.model, cfg.dtype, cfg.device)
        self.vocab_size = self.config.vocab_size
        num_blocks = cfg.num_kv_blocks or default_num_blocks(
            self.config, cfg.block_size, self.dtype, self.device, cfg.max_model_len, cfg.max_num_seqs)
        self.kv = KVCache(self.config, num_blocks, cfg.block_size, self.dtype, self.device)

    @property
    def num_blocks(self) -> int:
        return self.kv.blocks.num_blocks

    def check_tokens(self, plan: StepPlan) -> None:
        if any(not 0 <= t < self.vocab_size for t in plan.token_ids):
            raise ValueError(f"token id outside the vocabulary [0, {self.vocab_size})")

    @torch.inference_mode()
    def forward(self, seq_ids: list[int], num_computed: list[int], num_new: list[int],
                input_ids: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] on the device (packed, ``num_new[i]`` per sequence);
        logits_index: [m] packed rows whose logits are wanted. Returns float32 [m, V]."""
        meta, positions = build_metadata(self.kv.layers, self.kv.tables(seq_ids), num_computed, num_new,
                                         self.kv.block_size, self.device)
        out = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                         use_cache=False, logits_to_keep=logits_index, specray_meta=meta)
        return out.logits[0].float()

    def to_device(self, values: list[int], dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)


class ModelWorker:
    """What draft and target workers share: a model runner and what the driver asks of it."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.runner = ModelRunner(cfg)

    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def vocab_size(self) -> int:
        return self.runner.vocab_size
