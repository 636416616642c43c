"""pytest's entry point for jaxdev's plugin ``jaxdev/testing/_plugin.py``: no ``import jaxdev``.

pytest imports every installed plugin when it starts. Importing the plugin by
its package name would run ``jaxdev/__init__`` (jax, flax, optax, orbax):
seconds added to every pytest run in the environment, and JAX would read
``JAX_ENABLE_X64``, ``JAX_PLATFORMS``, ... before a conftest can set them. So
this module loads that one file, which imports only the standard library and
pytest, and becomes it (``sys.modules``), as hypothesis's
``_hypothesis_pytestplugin`` keeps ``import hypothesis`` out of start-up.
"""

import importlib.util
import os
import sys

_NAME = "jaxdev.testing._plugin"
if _NAME not in sys.modules:
    _file = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jaxdev/testing/_plugin.py")
    _spec = importlib.util.spec_from_file_location(_NAME, _file)  # installed beside jaxdev/
    sys.modules[_NAME] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_NAME])
sys.modules[__name__] = sys.modules[_NAME]  # what `import _jaxdev_pytest` returns
