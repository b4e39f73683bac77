"""slime.observability.metric_utils (upstream's path) equals upstream's functions on recorded cases
(tests/data/upstream_metric_utils_cases.json, from upstream's file at the commit it names); floats within 1e-12."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest

from slime.observability import metric_utils

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_metric_utils_cases.json")) as f:
    RECORD = json.load(f)


def _decode(x):
    return SimpleNamespace(**x["namespace"]) if isinstance(x, dict) and "namespace" in x else x


@pytest.mark.parametrize("case", RECORD["cases"], ids=lambda c: c["fn"])
def test_equals_upstream(case):
    out = getattr(metric_utils, case["fn"])(*[_decode(a) for a in case["args"]], **case.get("kwargs", {}))
    expected = case["out"]
    if isinstance(expected, dict):
        assert out.keys() == expected.keys()
        for k in expected:
            assert out[k] == pytest.approx(expected[k], rel=1e-12, abs=1e-12), k
    elif isinstance(expected, list):
        assert all((math.isinf(a) and math.isinf(b)) or a == pytest.approx(b, rel=1e-12) for a, b in zip(out, expected))
    else:
        assert out == expected


def test_bad_inputs():
    with pytest.raises(ValueError, match="Unsupported algorithm"):
        metric_utils.compression_ratio("abc", algorithm="zstd")
    with pytest.raises(ValueError, match="not 2 groups of 4"):
        metric_utils.compute_pass_rate([1.0] * 7, 4, 2)
