"""The live memory ledger (issue 20): exact per-device totals, attribution by path, a PNG."""

from __future__ import annotations

import gc
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdev


def _expected_per_device() -> dict:
    """Sum of every live array's addressable_shards bytes, each buffer once."""
    live = jax.live_arrays()
    seen, out = set(), {}
    for x in live:
        for s in x.addressable_shards:
            ptr = (s.device, s.data.unsafe_buffer_pointer())
            if ptr in seen:  # a per-device view of an array counted already
                continue
            seen.add(ptr)
            out[s.device] = out.get(s.device, 0) + s.data.on_device_size_in_bytes()
    return out


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)(h)
        x = x + h
        return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))


class TinyTransformer(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(50, 32)(tokens)
        x = Block()(Block()(x))
        return nn.Dense(50)(x)


def _transformer_loop(strategy, steps=3):
    model = TinyTransformer()
    tx = optax.adam(1e-3)

    def loss(params, batch):
        logits = model.apply({"params": params}, batch["t"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["t"]).mean(-1)

    step = jaxdev.make_train_step(loss, tx, strategy)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    state, metrics = step.init_state(params, tx), None
    rng = np.random.default_rng(0)
    for _ in range(steps):
        batch = step.put_batch({"t": rng.integers(0, 50, (16, 8)).astype(np.int32)})
        state, metrics = step(state, batch, metrics)
    jax.block_until_ready(state)
    return state, batch, metrics


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: jaxdev.Strategy.single(),
        lambda: jaxdev.Strategy.sharded(jaxdev.make_mesh({"data": 2, "fsdp": 4}), rules="fsdp"),
    ],
    ids=["single", "fsdp"],
)
def test_totals_are_exact_and_a_training_loop_is_attributed(strategy):
    state, batch, metrics = _transformer_loop(strategy())
    # earlier tests' arrays held only by reference cycles (tracebacks) would otherwise be freed
    # by a collection between the ledger and the sum below (CI: 48 bytes a device, once)
    gc.collect()
    ledger = jaxdev.memory.ledger(state=state, batch=batch, metrics=metrics)
    # reading the ledger creates nothing: a second one agrees
    assert (
        jaxdev.memory.ledger(state=state, batch=batch, metrics=metrics).per_device
        == ledger.per_device
    )
    assert ledger.per_device == _expected_per_device()  # exact, every device
    assert ledger.attributed >= 0.9, str(ledger)
    paths = {e.path: e for e in ledger.entries}
    kernel = "state.params['Block_0']['Dense_0']['kernel']"
    assert paths[kernel].category == "params"
    mu = "state.opt_state[0].mu['Block_0']['Dense_0']['kernel']"
    assert paths[mu].category == "opt_state"
    assert paths[mu].bytes_per_device == paths[kernel].bytes_per_device  # follows the params
    assert any(e.category == "batch" for e in ledger.entries)
    text = str(ledger)
    assert "attributed to named trees" in text and "largest arrays" in text


def test_a_registered_dataclass_state_is_attributed_by_field():
    """A pure-JAX state (``jax.tree_util.register_dataclass``, no ``replace``) is a state
    to the ledger too: 09010e2 listed its params and optimizer state as other."""
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class State:
        step: jax.Array
        params: dict
        opt_state: tuple

    params = {"w": jnp.ones((64, 32))}
    state = State(jnp.zeros((), jnp.int32), params, optax.adam(1e-3).init(params))
    got = {e.path: e.category for e in jaxdev.memory.ledger(state=state).entries}
    assert got["state.params['w']"] == "params"
    assert got["state.opt_state[0].mu['w']"] == "opt_state"
    assert got["state.step"] == "other"


def test_a_buffer_is_counted_once_after_to_host_and_an_aliasing_device_put():
    x = jnp.ones((256, 256))  # one device
    jaxdev.to_host(x)  # JAX keeps a per-shard view of x alive: the same buffer
    y = jax.device_put(x, x.devices().pop())  # a new object, the same buffer
    ledger = jaxdev.memory.ledger(params={"x": x})
    assert ledger.per_device == _expected_per_device()  # was 3x x.nbytes, 33% attributed
    assert [e.total for e in ledger.entries if e.path == "params['x']"] == [x.nbytes]
    assert not [e for e in ledger.unattributed if e.shape == x.shape], str(ledger)
    del y


def test_an_array_whose_computation_ran_out_of_memory_counts_nothing():
    sharded = jax.NamedSharding(jaxdev.data_mesh(), jax.P("data"))
    out = jax.jit(lambda: jnp.ones((2**39,)), out_shardings=sharded)()  # 256 GiB per device
    ledger = jaxdev.memory.ledger(out=out)  # asking its buffer's pointer aborted the process
    assert not [e for e in ledger.entries + ledger.unattributed if e.shape == out.shape]


def test_a_leaked_old_state_is_unattributed_with_its_shapes():
    tx = optax.sgd(0.1)
    step = jaxdev.make_train_step(lambda p, b: (b @ p["w"]) ** 2, tx, donate=False)
    state = step.init_state({"w": jnp.ones(1000)}, tx)
    history = [state]  # the classic leak: every old state kept
    for _ in range(3):
        state, _ = step(state, step.put_batch(np.ones((4, 1000), np.float32)))
        history.append(state)
    ledger = jaxdev.memory.ledger(state=state)
    leaked = [e for e in ledger.unattributed if e.shape == (1000,)]
    assert len(leaked) == 3  # the three old params, each named by its shape
    assert ledger.attributed < 0.5
    assert {e.like for e in leaked} == {"state.params['w']"}  # flagged as old copies
    rows = [r for r in str(ledger).splitlines() if r.startswith("(1000,)")]
    note = "looks like an old copy of state.params['w']"
    assert len(rows) == 3 and all(r.endswith(note) for r in rows), str(ledger)


def test_print_lists_the_unattributed_arrays_with_shape_dtype_bytes_device():
    params = {f"w{i}": jnp.ones((64, 64)) for i in range(13)}  # 13 named arrays, larger
    stray = jax.device_put(jnp.ones((300, 7)), jax.devices()[3])
    text = str(jaxdev.memory.ledger(params=params))
    title, *rows = text.split("unattributed arrays")[1].splitlines()
    assert "of live bytes" in title
    row = next(r.split() for r in rows if r.startswith("(300, 7)"))
    assert row[:5] == ["(300,", "7)", "float32", "8.2", "KiB"] and row[5] == "cpu:3", text
    del stray


def test_plot_is_a_labelled_chart_a_person_can_read(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    state, batch, metrics = _transformer_loop(jaxdev.Strategy.sharded(), steps=1)
    stray = jnp.ones((300, 7))  # unattributed
    ledger = jaxdev.memory.ledger(state=state, batch=batch)
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    ledger.plot(str(tmp_path / "memory.png"), limit=4 * max(ledger.per_device.values()))
    (ax,) = figures[0].axes
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"cpu:{i}" for i in range(8)]
    assert "KiB" in ax.get_ylabel() and "memory" in ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [  # top-down, as stacked
        *("free (up to the limit)", "unattributed", "other named trees"),
        *("batch", "optimizer state", "params"),
    ]
    monkeypatch.undo()
    path = pathlib.Path(ledger.plot(str(tmp_path / "memory.png")))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    del stray


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(jaxdev.UsageError, match=r"pip install 'jaxdev\[plot\]'"):
        jaxdev.memory.ledger().plot(str(tmp_path / "m.png"))


def test_memory_refuses_tracers():
    @jax.jit
    def f(x):
        with pytest.raises(jaxdev.UsageError, match="outside `jit`"):
            jaxdev.memory.ledger(x=x)
        return x

    f(jnp.ones(2))


def test_jaxdev_memory_command_prints_the_ledger_and_draws_it(tmp_path):
    import subprocess
    import sys

    from conftest import clean_env

    png = tmp_path / "m.png"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdev", "memory", "--plot", str(png)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "8 fake CPU devices" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if "attributed to named trees" in x)
    share = float(line.split(":")[1].split("%")[0])
    assert share >= 90.0, proc.stdout
    assert "state.params['Dense_0']['kernel']" in proc.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_an_old_copy_is_named_after_a_device_leaf_on_its_sharding_and_others_are_counted():
    sharded = jax.NamedSharding(jaxdev.data_mesh(), jax.P("data"))
    state = {"b": np.ones((96, 8), np.float32), "w": jnp.ones((96, 8))}
    old = state["w"] + 1
    (like,) = [e.like for e in jaxdev.memory.ledger(state=state).unattributed if e.shape == (96, 8)]
    assert like == "state['w'] (or 1 other of that shape)"  # was state['b'], a numpy leaf
    tree = {"a": old, "s": jax.device_put(state["w"], sharded)}
    old_s = tree["s"] + 1
    ledger = jaxdev.memory.ledger(tree=tree)
    likes = {len(e.bytes_per_device): e.like for e in ledger.unattributed if e.shape == (96, 8)}
    assert likes[8] == "tree['s'] (or 1 other of that shape)", str(ledger)  # was tree['a']
    del old, old_s


def test_the_tables_are_largest_first_by_the_bytes_they_show():
    replicated = jax.NamedSharding(jaxdev.data_mesh(), jax.P())
    wide = jax.device_put(jnp.ones(100), replicated)  # 400 B on each of 8 devices
    tall = jax.device_put(jnp.ones(150), jax.devices()[1])  # 600 B on one
    strays = jax.device_put(jnp.ones(101), replicated), jnp.ones(151, device=jax.devices()[2])
    ledger = jaxdev.memory.ledger(params={"wide": wide, "tall": tall})
    assert [e.path for e in ledger.entries] == ["params['tall']", "params['wide']"]
    shown = [e.shape for e in ledger.unattributed if e.shape in ((101,), (151,))]
    assert shown == [(151,), (101,)], str(ledger)  # was by bytes summed over devices
    del strays


def test_plot_returns_the_file_written_and_refuses_a_missing_folder_or_a_bad_limit(tmp_path):
    ledger = jaxdev.memory.ledger(params={"w": jnp.ones(4)})
    path = ledger.plot(str(tmp_path / "noext"))
    assert path == str(tmp_path / "noext.png") and pathlib.Path(path).is_file()
    with pytest.raises(jaxdev.UsageError, match=r"`path`.*'[^']*missing' does not exist"):
        ledger.plot(str(tmp_path / "missing" / "m.png"))  # was a raw FileNotFoundError
    with pytest.raises(jaxdev.UsageError, match=r"`path` must be a file path .*got 123"):
        ledger.plot(123)  # was pathlib's bare TypeError (a meter report's plot too)
    assert pathlib.Path(ledger.plot(tmp_path / "p")).is_file()  # a PathLike
    for name in ("memory.xyz", "memory.step1000"):  # was matplotlib's bare ValueError
        with pytest.raises(jaxdev.UsageError, match=r"`path`.*matplotlib writes no '\.\w+' files"):
            ledger.plot(str(tmp_path / name))
    assert pathlib.Path(ledger.plot(str(tmp_path / "m.SVG"))).is_file()
    for bad in (0, -5, "1GiB", True, float("inf")):  # drawn as no limit, raw TypeError, a NaN bar
        with pytest.raises(jaxdev.UsageError, match=f"`limit`.*got {bad!r}"):
            ledger.plot(str(tmp_path / "m.png"), limit=bad)


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_plot_path_is_refused_not_a_hidden_file(path, tmp_path, monkeypatch):
    """Before: `ledger.plot("")` and a meter report's `plot("")` wrote the hidden file
    `.png.png` in the working folder and returned `.png`, a file that does not exist."""
    monkeypatch.chdir(tmp_path)
    with jaxdev.meter.StepMeter() as m:
        pass
    for plot in (jaxdev.memory.ledger(params={"w": jnp.ones(4)}).plot, m.report().plot):
        with pytest.raises(jaxdev.UsageError, match=r"`path` must be a file path .*got '\s*'"):
            plot(path)
    assert list(tmp_path.iterdir()) == []


def test_typed_prng_keys_show_their_key_shape_and_dtype_and_old_copies_are_flagged():
    rng, old = jax.random.split(jax.random.key(0), 8), jax.random.split(jax.random.key(1), 8)
    ledger = jaxdev.memory.ledger(state={"rng": rng})
    (entry,) = [e for e in ledger.entries if e.path == "state['rng']"]
    assert (entry.shape, entry.dtype) == ((8,), "key<fry>")  # was (8, 2) uint32
    assert "state['rng']" in {e.like for e in ledger.unattributed}, str(ledger)
    del old


@pytest.mark.parametrize("spec", [None, jax.P(), jax.P("data")])
def test_sub_byte_arrays_count_the_packed_bytes_xla_holds(spec):
    """The bytes each buffer holds: jax 0.12 packs two int4 a byte on CPU (an odd count
    rounded up), jax 0.10.2 a byte each; the ledger counted a byte each (JAX's ``nbytes``)."""
    x = jnp.arange(8 * 1023, dtype=jnp.int4)
    if spec is not None:
        x = jax.device_put(x, jax.NamedSharding(jaxdev.data_mesh(), spec))
    ledger = jaxdev.memory.ledger(params={"x": x})
    want = [s.data.on_device_size_in_bytes() for s in x.addressable_shards]
    if jax.__version_info__ >= (0, 12):
        assert want == [-(-s.data.size // 2) for s in x.addressable_shards]
    assert [e.total for e in ledger.entries if e.path == "params['x']"] == [sum(want)]
