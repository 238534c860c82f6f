"""bench memory_load's --variants: each variant's levels set against the first variant's."""

from __future__ import annotations

import argparse

import pytest

from bench.memory_load import _variant, against_first


def _line(concurrency: int, throughput: float, itl: float) -> dict:
    return {"concurrency": concurrency, "output_token_throughput": throughput, "median_itl_ms": itl}


def test_each_variant_is_set_against_the_first_at_each_level():
    levels = {
        "plain": [_line(1, 20.0, 10.0), _line(8, 22.0, 20.0)],
        "cad": [_line(1, 16.0, 12.5), _line(8, 11.0, 30.0)],
    }
    out = against_first(levels)
    assert out["against"] == "plain"
    assert out["cad"] == {
        "1": {"throughput": 0.8, "median_itl": 1.25},
        "8": {"throughput": 0.5, "median_itl": 1.5},
    }


def test_a_variant_is_a_name_and_json_knobs():
    assert _variant('cad={"contrast": 0.5}') == ("cad", {"contrast": 0.5})
    assert _variant("plain={}") == ("plain", {})
    with pytest.raises(argparse.ArgumentTypeError):
        _variant('{"contrast": 0.5}')
