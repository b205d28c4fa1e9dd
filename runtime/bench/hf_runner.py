"""Hugging Face's side of the bench: transformers' ``generate`` on the same models
(the target alone, assisted generation, prompt lookup), and a deliberately bad draft."""

from __future__ import annotations

import time

import torch

from specray.runtime.bench.settings import BenchSettings


def _strip(tokens: list[int], eos: set[int], pad: int | None) -> list[int]:
    out = []
    for t in tokens:
        out.append(t)
        if t in eos:
            break
    return out


class HFRunner:
    """transformers' generate: the target alone (padded batches), assisted generation (with
    a draft) and prompt lookup (``prompt_lookup_num_tokens = k``, batch 1)."""

    def __init__(self, s: BenchSettings):
        from transformers import AutoModelForCausalLM

        from specray.workers.model_loader import load_config, resolve_device, resolve_dtype

        self.device = resolve_device(s.device)
        dtype = resolve_dtype(s.dtype, self.device, load_config(s.target))
        self.target = AutoModelForCausalLM.from_pretrained(s.target, dtype=dtype).to(self.device).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(s.draft, dtype=dtype).to(self.device).eval() \
            if s.draft else None
        eos = self.target.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad = self.target.generation_config.pad_token_id
        if self.pad is None:
            self.pad = 0
        self.calls = 0
        self.target.register_forward_pre_hook(self._count)
        self.k = s.k

    def _count(self, *_):
        self.calls += 1

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int, assisted: bool, temperature: float,
                 seed: int, lookup: bool = False) -> tuple[list[list[int]], float, int]:
        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):       # left padding, as generate expects
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kw = dict(max_new_tokens=max_tokens, pad_token_id=self.pad)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kw.update(do_sample=False)
        if assisted:
            self.draft.generation_config.num_assistant_tokens = self.k
            self.draft.generation_config.num_assistant_tokens_schedule = "constant"
            self.draft.generation_config.assistant_confidence_threshold = 0.0
            kw.update(assistant_model=self.draft)
        if lookup:
            kw.update(prompt_lookup_num_tokens=self.k)
        self.calls = 0
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.target.generate(ids.to(self.device), attention_mask=mask.to(self.device), **kw)
        _sync(self.device)
        dt = time.perf_counter() - t0
        gen = [_strip(row[width:].tolist(), self.eos, self.pad) for row in out.cpu()]
        return gen, dt, self.calls


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_copy(model_dir: str, out_dir: str, seed: int = 0) -> str:
    """The same architecture with freshly initialised weights: a deliberately bad draft."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(out_dir)
    return out_dir
