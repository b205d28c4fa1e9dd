"""RuntimeConfig: one explicit flat constructor over four sections, each validated once."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from specray.runtime.config import FIELD_SECTION, SECTIONS, ClusterConfig, RuntimeConfig
from specray.scheduler.config import CacheConfig, SpeculationConfig
from specray.workers.config import ModelConfig


def test_the_constructor_names_every_section_field_once():
    params = inspect.signature(RuntimeConfig.__init__).parameters
    flat = [p for p in params if p not in ("self", *SECTIONS, "seed", "max_pending")]
    assert sorted(flat) == sorted(FIELD_SECTION)
    assert len(FIELD_SECTION) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())


def test_flat_keywords_land_in_their_sections():
    cfg = RuntimeConfig(target="t", draft="d", num_speculative_tokens=3, block_size=8, num_target_workers=2,
                        dtype="float32", seed=5)
    assert cfg.model == ModelConfig(target="t", draft="d", dtype="float32")
    assert cfg.cache == CacheConfig(block_size=8)
    assert cfg.speculation == SpeculationConfig(num_speculative_tokens=3)
    assert cfg.cluster == ClusterConfig(num_target_workers=2)
    assert cfg.seed == 5 and cfg.max_pending == 4096
    # Flat names are not attributes: every reader goes through the section.
    assert not hasattr(cfg, "block_size")


def test_whole_sections_and_flat_overrides():
    cache = CacheConfig(block_size=4, max_num_seqs=8)
    cfg = RuntimeConfig(target="t", proposer="none", cache=cache, max_num_seqs=2)
    assert cfg.cache == CacheConfig(block_size=4, max_num_seqs=2)
    again = cfg.replace(block_size=16, seed=1)
    assert again.cache == CacheConfig(block_size=16, max_num_seqs=2) and again.seed == 1
    assert again.model == cfg.model and again.speculation == cfg.speculation
    with pytest.raises(ValueError, match="cache must be a CacheConfig"):
        RuntimeConfig(target="t", proposer="none", cache={"block_size": 4})
    with pytest.raises(TypeError, match="blok_size"):
        RuntimeConfig(target="t", proposer="none", blok_size=4)


@pytest.mark.parametrize("kw,field", [
    (dict(block_size=0), "block_size"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(proposer="magic"), "proposer"),
    (dict(device="tpu"), "device"),
    (dict(num_target_workers=0), "num_target_workers"),
    (dict(seed=-1), "seed"),
    (dict(proposer="none"), "draft must be None"),
    (dict(draft=None), "draft must be set"),
    (dict(worker_link="yes"), "worker_link"),
])
def test_bad_fields_are_refused_naming_them(kw, field):
    args = {"target": "t", "draft": "d", **kw}
    with pytest.raises(ValueError, match=field):
        RuntimeConfig(**args)


def test_what_is_in_force_is_what_the_config_says():
    # No proposer: nothing proposed; overlap only with the draft model (settled.py decides
    # what follows from the layout; test_overlap checks it).
    assert RuntimeConfig(target="t", proposer="none").speculation.num_speculative_tokens == 0
    assert RuntimeConfig(target="t", draft="d", overlap=True).speculation.overlap
    assert not RuntimeConfig(target="t", proposer="ngram", overlap=True).speculation.overlap
