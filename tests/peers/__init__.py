"""The test suites of jaxdev's peers, run as written under jaxdev's pytest plugin.

Vendored unmodified but for ``@pytest.mark.devices`` markers (and ``import pytest``), each
line marked ``# jaxdev: marker added``; each file's first line names its source and commit:

- ``flax_jax_utils_test.py`` (flax ``tests/jax_utils_test.py``): ``devices(4)`` on its two
  classes (the file asks for 4 devices through ``XLA_FLAGS``; ``min_device_batch`` assumes 4:
  at 2 devices 4 tests fail).
- ``flax_nnx_spmd_test.py`` (flax ``tests/nnx/spmd_test.py``): ``devices(4)`` on its class
  (its meshes are 2 x 2; below 4 devices every test skips itself).
- ``chex_fake_test.py`` (chex ``chex/_src/fake_test.py``): ``devices(2)`` on every method,
  above absl's ``@parameterized.*`` on half of them and below it on the other half (the
  suite passes on any count; chex's own default is 1).

- ``orbax_multihost_test.py`` (orbax ``checkpoint/orbax/checkpoint/_src/multihost/
  multihost_test.py``): ``processes(4, devices=2)``, ``multiprocess`` and ``slow`` on its two
  multi-process classes; its import of orbax's launcher module (not in the pip package, used
  only under ``__main__``) is commented out. Its 18 multi-process tests share 4 warm
  processes (~23 s in all on 2 cores; ~20 s a test when each started its own).

The session runs on 8 devices (``tests/conftest.py``): every test here but orbax's
``ReachedPreemptionTest`` runs in a jaxdev worker or as jaxdev processes. ``conftest.py``
marks absl's flags parsed (as orbax's own conftest does) and skips, with the reason, the
tests that need a newer flax or orbax than the oldest ones jaxdev supports.
"""
