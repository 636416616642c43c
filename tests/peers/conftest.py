"""Skips, saying why, the vendored tests that need a newer peer than the one installed, and
orbax's multi-process tests beyond two unless ``JAXDEV_PEERS_ALL=1`` (CI time)."""

import inspect
import os

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
ORBAX_RUN = {  # each test of 4 processes x 2 devices starts them afresh: ~18 s on 2 cores
    "MultihostUtilsTestDistributedId::test_sync_global_processes",
    "MultihostUtilsTestDistributedId::test_broadcast_one_to_all",
}
ORBAX_WHY = "4 fresh processes per test (~18 s on 2 cores): run all with JAXDEV_PEERS_ALL=1"


def pytest_collection_modifyitems(items):
    run_all = os.environ.get("JAXDEV_PEERS_ALL") == "1"
    for item in items:
        if item.path.parent.name != "peers":
            continue
        applies, why = NEEDS.get(item.name, (False, ""))
        if not applies and item.get_closest_marker("processes") and not run_all:
            applies, why = item.nodeid.split(".py::")[-1] not in ORBAX_RUN, ORBAX_WHY
        if applies:
            item.add_marker(pytest.mark.skip(reason=why))


def pytest_configure(config):
    """As orbax's own conftest (checkpoint/orbax/checkpoint/conftest.py): absltest's
    ``create_tempdir`` and ``flagsaver`` read absl flags, which pytest never parses."""
    flags.FLAGS.mark_as_parsed()
