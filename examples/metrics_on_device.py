"""d2l exercise 3: keep the log on the device, transfer only the final result.

Run: ``python examples/metrics_on_device.py``. 1000 matrix products of
100x100 matrices, logging the Frobenius norm of each result: first with a
``float()`` per step (a host sync every step), then with a
``jaxdev.metrics.DeviceLog`` fetched once, and a ``jaxdev.metrics.Collection`` of running
metrics (mean, max, non-finite count) merged on device. ``count_transfers``
shows the difference in host syncs.
"""

import jaxdev

jaxdev.testing.use_fake_cpu_devices(8)  # before JAX starts; only touches the CPU backend

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

STEPS, N = 1000, 100
SPEC = {"norm": jaxdev.metrics.Mean, "largest": jaxdev.metrics.Max, "bad": jaxdev.metrics.NonFinite}


@jax.jit
def matmul_norm(x, w):
    y = x @ w
    norm = jnp.linalg.norm(y)
    return y / norm, norm


@jax.jit
def logged_step(x, w, log, metrics):
    x, norm = matmul_norm(x, w)
    batch = jaxdev.metrics.Collection.from_values(
        SPEC, {"norm": norm, "largest": norm, "bad": norm}
    )
    return x, log.record(norm), metrics.merge(batch)


def on_host(x, w):
    norms = []
    for _ in range(STEPS):
        x, norm = matmul_norm(x, w)
        norms.append(float(norm))  # one device-to-host sync per step
    return np.asarray(norms)


def on_device(x, w):
    log, metrics = jaxdev.metrics.DeviceLog.create(STEPS), jaxdev.metrics.Collection.empty(SPEC)
    for _ in range(STEPS):
        x, log, metrics = logged_step(x, w, log, metrics)
    return log.fetch(), metrics.fetch()  # the only two transfers


def main() -> None:
    dev = jax.local_devices()[0]
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jaxdev.to_device((jax.random.normal(kx, (N, N)), jax.random.normal(kw, (N, N))), dev)
    on_host(x, w), on_device(x, w)  # compile both outside the measurement

    with jaxdev.count_transfers() as host_count:
        t0 = time.perf_counter()
        host_norms = on_host(x, w)
        host_s = time.perf_counter() - t0
    with jaxdev.count_transfers() as dev_count:
        t0 = time.perf_counter()
        dev_norms, summary = on_device(x, w)
        dev_s = time.perf_counter() - t0

    np.testing.assert_allclose(host_norms, dev_norms, rtol=1e-4)
    print(f"{STEPS} matmuls {N}x{N} on {dev.platform}:{dev.id}")
    print(f"  float() per step: {host_s * 1e3:7.1f} ms, {host_count.device_to_host} host syncs")
    print(f"  DeviceLog:        {dev_s * 1e3:7.1f} ms, {dev_count.device_to_host} host syncs")
    print(
        f"  running metrics:  mean norm {summary['norm']:.3f}, max {summary['largest']:.3f}, "
        f"non-finite {summary['bad']}"
    )
    print("  (on a CPU a host sync is cheap; on a GPU each one stalls the device queue)")
    assert host_count.device_to_host == STEPS and dev_count.device_to_host <= 2
    print("metrics on device: ok")


if __name__ == "__main__":
    main()
