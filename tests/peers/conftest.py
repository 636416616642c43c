"""Skips, saying why, the vendored tests that need a newer peer than the one installed."""

import inspect

import pytest
from absl import flags
from flax import nnx
from orbax.checkpoint._src.multihost import multihost  # what orbax's own test imports

NEEDS = {  # test name: (applies, why)
    "test_out_sharding_mha": (
        "out_sharding" not in inspect.signature(nnx.MultiHeadAttention.__call__).parameters,
        "needs flax's MultiHeadAttention(out_sharding=) (a newer flax than installed)",
    ),
    "test_returns_false_when_service_disabled": (
        not hasattr(multihost, "is_proxy_pathways_backend"),
        "needs orbax's multihost.is_proxy_pathways_backend (a newer orbax than installed)",
    ),
}


def pytest_collection_modifyitems(items):
    for item in items:
        applies, why = NEEDS.get(item.name, (False, ""))
        if applies and item.path.parent.name == "peers":
            item.add_marker(pytest.mark.skip(reason=why))


def pytest_configure(config):
    """As orbax's own conftest (checkpoint/orbax/checkpoint/conftest.py): absltest's
    ``create_tempdir`` and ``flagsaver`` read absl flags, which pytest never parses."""
    flags.FLAGS.mark_as_parsed()
