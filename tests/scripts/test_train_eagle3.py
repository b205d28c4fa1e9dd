"""scripts/train_eagle3.py, in a few steps: what it writes is a head in the published layout
(no embedding: the target's is shared) that specray loads for the built-in target."""

from __future__ import annotations

import json
import sys

import torch
from specray_testing import ROOT, worker_configs

import specray


def test_a_few_steps_write_a_head_specray_loads(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_eagle3
    from transformers import AutoConfig

    from specray.workers.eagle3_loader import REQUIRED, fit_target, load_eagle3
    from specray.workers.target_worker import TargetWorker

    n = torch.get_num_threads()
    try:
        stats = train_eagle3.main(["--out", str(tmp_path / "head"), "--num-prompts", "4", "--eval-prompts", "2",
                                   "--prompt-len", "8", "--gen-len", "8", "--corpus-windows", "2", "--steps", "2",
                                   "--batch", "2", "--intermediate-size", "32"])
    finally:
        torch.set_num_threads(n)
    assert len(stats["held_out_accuracy"]) == 3 and stats["num_sequences"] == 6
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert set(REQUIRED) <= keys and not any(k.startswith("embed_tokens") for k in keys)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    target = specray.builtin_model("tiny-target")
    ckpt = fit_target(load_eagle3(str(tmp_path / "head")), AutoConfig.from_pretrained(target))
    assert ckpt.aux_inputs == tuple(i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    worker = TargetWorker(*worker_configs(target), head=str(tmp_path / "head"))
    assert worker.head.draft_vocab_size == config["draft_vocab_size"]
