#!/usr/bin/env bash
# The GPU checks, one call on a lent GPU machine (its python3 has jax, flax, optax, orbax):
#   bash benchmarks/gpu_check.sh   (writes under $OUT, or ./gpu_out)
set -u
export PYTHONUNBUFFERED=1 OUT="${OUT:-gpu_out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
timeout 60 python3 -m jaxdev info 2>&1 | tee "$OUT/info.txt" | head -30
echo "== demo"; timeout 150 python3 -m jaxdev demo 2>&1 | tee "$OUT/demo.txt" | tail -12
echo "== gpu tests"; JAXDEV_TEST_GPU=1 timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -4
echo "== gpu_bench"; (cd benchmarks && timeout 200 python3 gpu_bench.py --repeats 5 --json "$OUT/gpu_bench.json" 2>&1 | tail -12)
echo "== bench"; timeout 120 python3 -m jaxdev bench --quick --json "$OUT/bench.json" 2>&1 | tail -14
echo "== suite parts with the GPU as default backend"
JAXDEV_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 60 \
  tests/test_devices.py tests/test_placement.py tests/test_oom.py tests/test_memory.py > "$OUT/gpu_suite.txt" 2>&1
tail -25 "$OUT/gpu_suite.txt"
