"""Testing multi-device code: a pytest plugin and :func:`assert_strategies_agree`.

The plugin (``jaxdev/testing/_plugin.py``) is registered through pytest's
``pytest11`` entry point when jaxdev is installed and does nothing until a
test is marked ``@pytest.mark.devices(1, 2, 8)`` or
``@pytest.mark.processes(2, devices=4)``, or pytest is given
``--jaxdev-devices N``. See the README section "Testing your own code".
"""

from .._devices import use_fake_cpu_devices as use_fake_cpu_devices
from .._errors import DisagreementError as DisagreementError
from ._agree import assert_strategies_agree as assert_strategies_agree

__all__ = ["DisagreementError", "assert_strategies_agree", "use_fake_cpu_devices"]
