"""``RuntimeConfig.layout``: the alias, the choices refused, and what "auto" picks from
the cluster it meets (decided without Ray)."""

from __future__ import annotations

import pytest

from specray import RuntimeConfig
from specray.runtime.layout import BACKENDS, choose


def cfg(**kw) -> RuntimeConfig:
    return RuntimeConfig(target="t", draft="d", **kw)


def test_colocate_is_an_alias_of_the_colocated_layout():
    assert cfg(colocate=True).cluster.layout == "colocated"
    assert cfg(layout="colocated").cluster.colocate
    assert cfg().cluster.layout == "auto" and not cfg().cluster.colocate
    with pytest.raises(ValueError, match="contradicts"):
        cfg(colocate=True, layout="actors")
    with pytest.raises(ValueError, match="layout"):
        cfg(layout="spread")
    with pytest.raises(ValueError, match="compiled_graph"):
        cfg(layout="colocated", compiled_graph=True)
    # Pre-drafting needs a draft actor beside the target: co-located, it is off.
    assert not cfg(layout="colocated", overlap=True).speculation.overlap
    assert cfg(layout="actors", overlap=True).speculation.overlap


@pytest.mark.parametrize("kw, nodes, gpus, want", [
    ({}, 1, 0, "colocated"),                                          # one machine's CPUs
    ({"device": "cpu"}, 1, 1, "colocated"),
    ({}, 1, 1, "colocated"),                                          # one GPU, shared
    ({}, 1, 2, "actors"),                                             # a GPU each
    ({"device": "cpu"}, 1, 2, "colocated"),                           # CPUs, GPUs unused
    ({}, 3, 0, "actors"),                                             # nodes of their own
    ({"draft_resources": {"specray_draft": 1}}, 1, 0, "actors"),
    ({"target_resources": {"CPU": 1}}, 1, 0, "actors"),
    ({"compiled_graph": True}, 1, 0, "actors"),
    ({"layout": "actors"}, 1, 0, "actors"),
    ({"layout": "colocated", "draft_resources": {"x": 1}}, 4, 8, "colocated"),
    ({"colocate": True}, 4, 8, "colocated"),
])
def test_auto_co_locates_only_where_draft_and_target_would_share_hardware(kw, nodes, gpus, want):
    layout, why = choose(cfg(**kw), nodes, gpus)
    assert layout == want and why
    assert layout in BACKENDS


def test_auto_without_a_draft_model_co_locates():
    c = RuntimeConfig(target="t", proposer="ngram")
    assert choose(c, 4, 8)[0] == "colocated"
    assert choose(c.replace(target_resources={"specray_target": 1}), 4, 8)[0] == "actors"
