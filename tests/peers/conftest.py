"""Skips the vendored tests that need a newer peer than the one installed, saying which."""

import inspect

import pytest
from flax import nnx

NEEDS = {  # test name: (applies, why)
    "test_out_sharding_mha": (
        "out_sharding" not in inspect.signature(nnx.MultiHeadAttention.__call__).parameters,
        "needs flax's MultiHeadAttention(out_sharding=) (a newer flax than installed)",
    ),
}


def pytest_collection_modifyitems(items):
    for item in items:
        applies, why = NEEDS.get(item.name, (False, ""))
        if applies and item.path.parent.name == "peers":
            item.add_marker(pytest.mark.skip(reason=why))
