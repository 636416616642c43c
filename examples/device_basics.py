"""The d2l "GPUs" section replayed with jaxdev: devices, arrays on devices, copies, params.

Run: ``python examples/device_basics.py``. On a CPU-only machine JAX gets 8
fake CPU devices so that "the second device" exists; on a GPU host the same
code uses the GPUs (the fake count only affects JAX's CPU backend).
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def main() -> None:
    # 6.7.1 Computing devices: d2l's cpu(), gpu(i), num_gpus(), try_gpu(), try_all_gpus().
    print("cpu():", jaxdev.d2l.cpu(), "| num_gpus():", jaxdev.d2l.num_gpus())
    print("try_gpu():", jaxdev.d2l.try_gpu(), "| try_gpu(10):", jaxdev.d2l.try_gpu(10))
    print("try_all_gpus():", jaxdev.d2l.try_all_gpus())
    try:
        jaxdev.device("cpu:-1")  # JAX would silently give the last device
    except jaxdev.UsageError as err:
        print("refused:", str(err).split(". ")[0])

    # 6.7.2 Tensors and GPUs: where does an array live?
    devices = jax.local_devices()  # the GPUs, or the 8 fake CPUs
    first, second = devices[0], devices[1 % len(devices)]
    x = jnp.ones((2, 3))
    print("x lives on", jaxdev.device_of(x))
    X = jaxdev.to_device(jnp.ones((2, 3)), first)
    Y = jaxdev.to_device(jax.random.uniform(jax.random.key(0), (2, 3)), second)

    # Copying: X and Y are on different devices, so move one before combining (d2l's copyto).
    Z = jaxdev.copy_to(X, second)
    print("Y + Z on", jaxdev.device_of(Y + Z))
    # as_in_ctx: already there -> the same object, no copy; copy_to always copies.
    assert jaxdev.to_device(Z, second) is Z
    assert jaxdev.copy_to(Z, second) is not Z

    # 6.7.3 Neural networks and GPUs: a model's params on a device.
    net = nn.Dense(1)
    params = jaxdev.to_device(net.init(jax.random.key(0), X), first)
    out = net.apply(params, X)
    print("net output on", jaxdev.device_of(out))
    print(jaxdev.placement(params))
    jaxdev.assert_on_device(params, first)
    print("device basics: ok")


if __name__ == "__main__":
    main()
