"""``RuntimeConfig.layout``: the one name of the choice, the values refused, and what
"auto" picks from the cluster it meets (decided without Ray)."""

from __future__ import annotations

import pytest

from specray import RuntimeConfig
from specray.runtime.layout import choose


def cfg(**kw) -> RuntimeConfig:
    return RuntimeConfig(target="t", draft="d", **kw)


def test_layout_is_the_one_name_of_the_choice():
    assert cfg().cluster.layout == "auto" and cfg(layout="colocated").cluster.layout == "colocated"
    with pytest.raises(ValueError, match="layout"):
        cfg(layout="spread")
    for gone in ("colocate", "compiled_graph"):
        with pytest.raises(TypeError, match=gone):
            cfg(**{gone: True})


def test_colocate_stays_a_cli_alias_of_the_colocated_layout():
    import argparse

    from specray.runtime.entrypoints.cli_args import add_model_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert p.parse_args(["--colocate"]).layout == "colocated"
    assert p.parse_args([]).layout == "auto"
    assert p.parse_args(["--layout", "actors"]).layout == "actors"


@pytest.mark.parametrize("kw, nodes, gpus, want", [
    ({}, 1, 0, "colocated"),                                          # one machine's CPUs
    ({"device": "cpu"}, 1, 1, "colocated"),
    ({}, 1, 1, "colocated"),                                          # one GPU, shared
    ({}, 1, 2, "actors"),                                             # a GPU each
    ({"device": "cpu"}, 1, 2, "colocated"),                           # CPUs, GPUs unused
    ({}, 3, 0, "actors"),                                             # nodes of their own
    ({"draft_resources": {"specray_draft": 1}}, 1, 0, "actors"),
    ({"target_resources": {"CPU": 1}}, 1, 0, "actors"),
    ({"layout": "actors"}, 1, 0, "actors"),
    ({"layout": "colocated", "draft_resources": {"x": 1}}, 4, 8, "colocated"),
])
def test_auto_co_locates_only_where_draft_and_target_would_share_hardware(kw, nodes, gpus, want):
    layout, why = choose(cfg(**kw), nodes, gpus)
    assert layout == want and why


def test_auto_without_a_draft_model_co_locates():
    c = RuntimeConfig(target="t", proposer="ngram")
    assert choose(c, 4, 8)[0] == "colocated"
    assert choose(c.replace(target_resources={"specray_target": 1}), 4, 8)[0] == "actors"
