"""``specray serve --http``'s own flags (the server itself: test_serve.py, test_http.py)."""

from __future__ import annotations

import argparse

import pytest

from specray.runtime.http_serve import replicas, served_name


def test_http_replicas_take_n_or_min_max():
    assert replicas("3") == (3, 3)
    assert replicas("1,4") == (1, 4)
    for bad in ("0", "4,2", "a", "1,2,3", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--http-replicas"):
            replicas(bad)


def test_the_served_name_is_the_target_directorys_or_the_hub_id(tmp_path):
    (tmp_path / "SmolLM2-135M").mkdir()
    assert served_name(f"{tmp_path}/SmolLM2-135M/") == "SmolLM2-135M"
    assert served_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
