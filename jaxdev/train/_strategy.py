"""Where and how a train step runs: one device, ``jax.pmap``, or sharded ``jit``.

Each :class:`Strategy` subclass decides, for the step and the memory modules,
the state's layout (a new state is built in it), the batch's, and how the step's
body is compiled; nothing reads which kind it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from .._batches import (
    Padded,
    batch_rows,
    detach_host,
    lead_spec,
    pad_rows,
    place_rows,
    row_multiple,
    to_global,
)
from .._devices import DeviceSpec, device_list
from .._devices import device as resolve_device
from .._errors import ShardingError, UsageError, short
from .._leaves import checked_leaves, is_jax_array, key_strings, raise_leaves, same_layout
from .._mesh import (
    DEFAULT_AXIS,
    MODEL_AXES,
    AxisName,
    MeshBound,
    axis_size,
    batch_axis,
    batch_layout,
    check_mesh,
    mesh_of,
    named_sharding,
    outside_mesh,
    under_mesh,
)
from .._placement import copy_to, place_tree, refuse_unreduced_leaves, to_device
from .._pmap_layout import is_stacked
from .._rules import check_rules, step_shardings, unbox
from .._target import refuse
from ..memory import check_offload, offloaded, streamed
from ._train import TrainState


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Where and how a step runs: make one with :meth:`single`, :meth:`pmap` or :meth:`sharded`.

    Attributes:
      kind: ``'single'``, ``'pmap'`` or ``'sharded'``.
      mesh: the mesh of the state and batch (one device for ``single``).
      axis: the mesh axis (or tuple of axes) the batch is split over.
      rules: the :data:`jaxdev.Rules` placing params and optimizer state (not hashed).
      rule_options: ``(name, value)`` pairs of the rules' options (:attr:`options`: a dict).
      offload: the train-state fields kept in host memory between steps.
    """

    kind: str
    devices: tuple[jax.Device, ...]
    mesh: Mesh
    axis: AxisName = DEFAULT_AXIS
    shard_map: bool = False
    rules: Any = dataclasses.field(default="replicate", hash=False)
    rule_options: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), hash=False)
    offload: tuple[str, ...] = ()

    @classmethod
    def single(cls, device: DeviceSpec | None = None) -> Strategy:
        """Run on one device with ``jax.jit`` (a ``jax.Device``, spec or index; default: the first).

        Example:
          >>> import jaxdev
          >>> jaxdev.Strategy.single("cpu:0").devices == (jaxdev.d2l.cpu(0),)
          True
        """
        dev = resolve_device(0 if device is None else device)
        return _Single("single", (dev,), mesh_of((dev,), DEFAULT_AXIS))

    @classmethod
    def pmap(cls, devices: Any = None, axis: str = DEFAULT_AXIS) -> Strategy:
        """Run on local devices with ``jax.pmap`` (all, the first ``n``, a platform or a list).

        Example:
          >>> import jaxdev
          >>> len(jaxdev.Strategy.pmap(2).devices)
          2
        """
        devs = tuple(device_list(devices))
        if not isinstance(axis, str) or not axis:
            raise UsageError(f"`axis` must be a non-empty string such as 'data', got {axis!r}.")
        if jax.process_count() > 1 and set(devs) != set(jax.local_devices()):
            raise UsageError(  # jax.pmap needs the same devices in every process
                f"`devices`: under {jax.process_count()} processes, pmap maps over every "
                f"process's local devices and averages over all of them; got {len(devs)} of "
                f"this process's {jax.local_device_count()}. Pass devices=None."
            )
        return _Pmap("pmap", devs, mesh_of(devs, axis), axis)

    @classmethod
    def sharded(
        cls,
        mesh: Mesh | None = None,
        axis: AxisName | None = None,
        *,
        rules: Any = "replicate",
        shard_map: bool = False,
        min_size: int | None = None,
        fsdp_axis: AxisName | None = None,
        logical_axis_rules: Any = None,
        indivisible: str | None = None,
        offload: Any = None,
        params: Any = None,
    ) -> Strategy:
        """Run with ``jax.jit`` + ``NamedSharding``: batch split, params placed by ``rules``.

        ``"replicate"`` is data parallel; other :data:`jaxdev.Rules` shard the
        params with the optimizer state following, the same numbers.

        Args:
          mesh: default :func:`jaxdev.data_mesh`.
          axis: the axis (or axes) the batch is split over; default every mesh
            axis but ``'model'`` / ``'tensor'``.
          rules: as :func:`jaxdev.param_shardings`; ``min_size``, ``fsdp_axis``,
            ``logical_axis_rules`` and ``indivisible`` are its options.
          shard_map: run under ``jax.shard_map`` with explicit collectives
            (replicated params only).
          offload: ``"opt_state"``, ``"params"`` or both: kept in host memory
            between steps, streamed in by the compiled step.
          params: the old name of ``rules`` (deprecated, warns).

        Raises:
          UsageError: ``shard_map=True`` with sharded params or offloading.
          ShardingError: ``axis`` is not a mesh axis, or is needed (model axes only).

        Example:
          >>> import jaxdev
          >>> jaxdev.Strategy.sharded(jaxdev.data_mesh(1)).axis
          'data'
          >>> s = jaxdev.Strategy.sharded(jaxdev.make_mesh({"data": 2, "fsdp": 4}), rules="fsdp")
          >>> s.axis, s.n_devices
          (('data', 'fsdp'), 8)
        """
        mesh = check_mesh(mesh)
        params = _hashable_rules(rules if params is None else _renamed(rules, params))
        named = dict(min_size=min_size, fsdp_axis=fsdp_axis, indivisible=indivisible)
        named["logical_axis_rules"] = _hashable_rules(logical_axis_rules)
        options = {k: v for k, v in named.items() if v is not None}
        check_rules(params, mesh, **options)  # a typo fails here, not at the first init_state
        offload = check_offload(offload, mesh.devices.flat)
        if shard_map and offload:
            raise UsageError(
                f"`offload`={offload} runs under jax.jit only, not `shard_map`=True: drop one."
            )
        if shard_map and not _replicates(params):
            raise UsageError(
                f"`shard_map`=True trains replicated params only, got `rules`={short(params)}. "
                "Sharded params run under jax.jit, where XLA inserts the gathers: drop "
                "`shard_map=True` (the numbers are the same)."
            )
        if axis is None and not _replicates(params) and set(mesh.axis_names) <= set(MODEL_AXES):
            raise ShardingError(
                f"`axis` is needed: every axis of the mesh {dict(mesh.shape)} is a model axis "
                f"{MODEL_AXES} that `rules` may split, so the batch would split over the same "
                "devices by default. Pass `axis=` with the axis the batch is split over, or add "
                "a 'data' axis."
            )
        axis = batch_axis(mesh, axis)
        devices = tuple(mesh.devices.flat)
        options = tuple(sorted(options.items()))
        return _Sharded("sharded", devices, mesh, axis, bool(shard_map), params, options, offload)

    def replace(self, **changes: Any) -> Strategy:
        """This strategy with ``changes`` (keywords of :meth:`sharded`), always a sharded one.

        Example:
          >>> import jaxdev
          >>> jaxdev.Strategy.pmap(2).replace(rules="fsdp").rules
          'fsdp'
        """
        kwargs = {"axis": self.axis, "rules": self.rules, "shard_map": self.shard_map}
        kwargs.update(self.options, offload=self.offload or None)
        return Strategy.sharded(check_mesh(self.mesh), **{**kwargs, **changes})

    def state_layout(self, state: Any, **options: Any) -> Any:
        """The shardings of ``state`` (or its shapes): the step's and :func:`jaxdev.memory.plan`'s.

        Params by the rules (``options`` override), the optimizer state following,
        offloaded fields in host memory.

        Example:
          >>> import jax.numpy as jnp, jaxdev
          >>> s = jaxdev.Strategy.sharded(jaxdev.make_mesh({"fsdp": 8}), rules="fsdp")
          >>> s.state_layout({"w": jnp.ones((1024, 4))})["w"].spec
          P('fsdp', None)
        """
        layout = step_shardings(state, self.mesh, self.rules, **{**self.options, **options})
        # under rules="flax", a leaf's own (NNX out_sharding) sharding: unseen where built
        refuse_unreduced_leaves(layout, jax.tree.leaves(unbox(state)), "state")
        return offloaded(layout, state, self.offload)

    def place_state(self, tree: Any) -> Any:
        """A copy of ``tree`` (a train state, params, metrics) where this strategy keeps state.

        Example:
          >>> import jax.numpy as jnp, jaxdev
          >>> jaxdev.Strategy.single().place_state(jnp.ones(2)).committed
          True
        """
        return copy_to(tree, self.state_target)

    def batch_spec(self, k: int = 1, m: int = 1, ndim: int | None = None) -> P:
        """The spec of a placed batch leaf for ``steps_per_call=k``, ``accumulate=m``.

        Example:
          >>> import jax, jaxdev
          >>> jaxdev.Strategy.sharded().batch_spec(k=4) == jax.sharding.PartitionSpec(None, "data")
          True
        """
        return lead_spec(self.axis, self.row_axis(k, m), ndim)

    def mask_spec(self, k: int = 1, m: int = 1) -> P:
        """The spec of a padded batch's mask: split like the rows, unless the program can
        count the real rows without a collective (a jit step on one process: replicated).

        Example:
          >>> import jax, jaxdev
          >>> jaxdev.Strategy.sharded().mask_spec() == jax.sharding.PartitionSpec()
          True
        """
        return self.batch_spec(k, m)

    def batch_shape(self, rows: int, k: int = 1, m: int = 1) -> tuple[int, ...]:
        """The leading shape :meth:`put_batch` gives ``rows`` global rows per update.

        Example:
          >>> import jaxdev
          >>> jaxdev.Strategy.sharded().batch_shape(64, k=4, m=2)
          (4, 2, 32)
        """
        return ((k,) if k > 1 else ()) + ((m,) if m > 1 else ()) + (rows // m,)

    @property
    def replicated(self) -> bool:
        """Whether every device holds the whole state (``rules="replicate"``)."""
        return _replicates(self.rules)

    @property
    def options(self) -> dict[str, Any]:
        """The rule options as keywords for :func:`jaxdev.param_shardings`."""
        return dict(self.rule_options)

    @functools.cached_property
    def n_devices(self) -> int:
        """How many ways the batch is split (read at every call: kept)."""
        return axis_size(self.mesh, self.axis)

    @property
    def collective_axis(self) -> AxisName | None:
        """The axis name bound inside the step (``lax.pmean``, BatchNorm's ``axis_name``).

        ``None`` where the step sees the whole batch (``single``, sharded ``jit``).

        Example:
          >>> import jaxdev
          >>> jaxdev.Strategy.pmap(2).collective_axis, jaxdev.Strategy.sharded().collective_axis
          ('data', None)
        """
        return self.axis if self.shard_map else None

    # ------------------------------------------------------------ behaviour (for the step)

    @property
    def by_rules(self) -> bool:
        """Whether the state is laid out by rules (sharded params), not replicated."""
        return False

    @property
    def state_target(self) -> Any:
        """Where an unsharded state lives: the device, or the mesh (replicated)."""
        return self.mesh

    def new_state(self, params: Any, tx: Any, rng: Any, model_state: Any) -> Any:
        """A new train state (or params, without ``tx``, ``rng`` and ``model_state``), placed."""
        refuse("init_state", self.state_target)  # a target: named, before jnp.zeros fails bare
        if tx is not None:
            state = TrainState.create(params, tx, rng, model_state)
        elif model_state is not None or rng is not None:
            state = TrainState(jnp.zeros((), jnp.int32), params, None, rng, model_state)
        else:
            state = params
        return self.place_state(state)

    def mesh_context(self) -> contextlib.AbstractContextManager:
        """The context user code is traced in: ``jax.set_mesh`` under ``sharded``, else none."""
        return outside_mesh()

    def local_shards(self) -> int:
        """How many batch shards this process's rows are split into."""
        return self.n_devices

    def put_rows(self, batch: Any, pad: bool | None) -> Any:
        """Place a (not grouped) batch, padded and masked when ``pad`` (None: when the rows
        need it): rows and mask in one ``jax.device_put``, host leaves copied (a loader may
        refill them), the checks run once per structure, shapes and dtypes."""
        sharding, n, mask = self._row_layout
        return place_rows(batch, sharding, n, pad, mask)

    @functools.cached_property
    def _row_layout(self) -> tuple[Any, int, Any]:
        """The rows' sharding, the ways it splits them, the mask's sharding (kept)."""
        return *batch_layout(self.mesh, self.axis), named_sharding(self.mesh, self.mask_spec())

    def put_batch(self, batch: Any, k: int = 1, m: int = 1) -> Any:
        """Place a batch for ``steps_per_call=k``, ``accumulate=m``; uneven rows come back Padded.

        Example:
          >>> import numpy as np, jaxdev
          >>> jaxdev.Strategy.sharded().put_batch(np.zeros((13, 2))).batch.shape
          (16, 2)
        """
        if k > 1 or m > 1:
            return _put_grouped(self, batch, k, m)
        return self.put_rows(batch, None)

    def check_even(self, batch: Any, axis: int = 0) -> None:
        """Refuse a raw batch whose rows (along ``axis``) the devices do not divide."""
        n = self.local_shards()
        if n == 1 or jax.process_count() > 1:
            return
        leaves = jax.tree.leaves(batch)
        shape = np.shape(leaves[0]) if leaves else ()
        if len(shape) > axis and shape[axis] % n:
            rows = shape[axis]
            raise UsageError(
                f"`batch` has {rows} rows (leaf shape {shape}), which the {n} devices of this "
                f"step do not divide. Place it with `step.put_batch(batch)`: it pads to "
                f"{rows + -rows % n} rows and masks the {-rows % n} padded rows, so they never "
                f"count; or give a multiple of {n} rows."
            )

    def place_raw(self, batch: Any) -> Any:
        """A raw (not ``put_batch``'ed, not grouped) batch as the step takes it: as it is
        (jit places host rows by the program's input shardings)."""
        return batch

    def splits_raw(self, batch: Any) -> bool:
        """Whether :meth:`place_raw` splits a raw batch's rows over the devices itself."""
        return False

    def place_padded(self, batch: Any, mask: Any) -> tuple[Any, Any]:
        """A Padded batch's rows and mask as the step takes them: as they are (jit moves
        committed leaves laid out otherwise to the program's layout)."""
        return batch, mask

    @functools.cached_property
    def stacked_sizes(self) -> frozenset[int]:
        """Leading sizes a raw batch in ``jax.pmap``'s stacked layout has: the host's device
        count (``common_utils.shard`` splits over it), and under pmap the step's."""
        return frozenset({jax.local_device_count()} - {1})

    def placed(self, x: Any) -> bool:
        """Whether batch leaf ``x`` is taken as placed, not read as rows: committed, and not
        stacked on another mesh (flax's ``prefetch_to_device``: the rows of a device are one)."""
        if not (is_jax_array(x) and x.committed):
            return False
        s = x.sharding
        return len(s.device_set) == 1 or getattr(s, "mesh", None) == self.mesh or not is_stacked(x)

    def check_layout(self, batch: Any, at: int = 0) -> None:
        """Refuse a raw batch that reads both as rows and as ``jax.pmap``'s stacked layout:
        every leaf ``(n, m, ...)`` from axis ``at`` (after its group axes), one ``m``, ``n`` in
        :attr:`stacked_sizes`."""
        probe = _a_leaf(batch)
        lead = _shape(probe)[at : at + 2]
        if len(lead) < 2 or lead[0] not in self.stacked_sizes or self.placed(probe):
            return  # at every call: one leaf's shape read, the tree not flattened
        leaves = jax.tree.leaves(batch)
        if any(np.shape(x)[at : at + 2] != lead or self.placed(x) for x in leaves):
            return  # a 1-D leaf, or two row counts per device: rows
        (n, m), shape, path = lead, np.shape(leaves[0]), key_strings(batch)[0]
        whose = "this step's" if n == self.n_devices else "this host's"
        axes = f"axes {shape[:at]} then" if at else "leading axes"
        rows, stacked = "it with `step.put_batch(batch)`", "`jaxdev.pmap.unshard_from_pmap(batch)`"
        if at:  # grouped (steps_per_call / accumulate)
            rows = "the rows with `step.put_batch` (it groups them)"
            stacked = "apply `jaxdev.pmap.unshard_from_pmap` to each batch before grouping: it"
        raise ShardingError(
            f"`batch` reads two ways and jaxdev does not guess: every leaf has {axes} "
            f"({n}, {m}) (batch{'' if path == '<root>' else path}: shape {shape}), and {n} is "
            f"{whose} device count. As rows it is {n} examples of shape {shape[at + 1 :]}; in "
            f"`jax.pmap`'s stacked layout (what `flax.training.common_utils.shard` makes) it is "
            f"{n} devices x {m} rows of shape {shape[at + 2 :]}. Rows: place {rows}. Stacked: "
            f"{stacked} gives the {n * m} rows"
            + (self._split_fix if n == self.n_devices and not at else "")
            + "."
        )

    _split_fix = ""  # pmap: the placed form of the stacked layout, which it takes

    def check_shapes(self, batch: Any) -> None:
        """Refuse ``ShapeDtypeStruct`` s ``lower`` cannot read as this strategy's batch."""

    def check_params(self, tree: Any, arg: str) -> None:
        """Refuse leaves in ``jax.pmap``'s stacked layout (one copy per device) that are not
        this strategy's own layout: the step keeps one copy of the state and places it."""
        leaves = jax.tree.leaves(tree)
        bad = [i for i, x in enumerate(leaves) if is_stacked(x)]
        if bad and self.by_rules:  # a leaf the rules split one row per device is theirs
            own, mine = jax.tree.leaves(self.state_layout(tree)), self.mesh
            bad = [i for i in bad if not _laid_as(leaves[i], own[i], mine)]
        raise_leaves(
            tree,
            bad,
            f"`{arg}` is in `jax.pmap`'s stacked layout: one copy per device on a leading "
            "axis (what `flax.jax_utils.replicate`, `jaxdev.pmap.stack_for_pmap` and "
            "`jax.pmap`'s outputs are). The step keeps one copy and places it itself, so it "
            "would train the device axis as part of each leaf. Take one copy first: "
            + (
                f"`flax.jax_utils.unreplicate({arg})` or `jaxdev.pmap.unstack_from_pmap({arg})`."
                if len(bad) == len(leaves)  # else unreplicate cuts the others to their row 0
                else "`jaxdev.pmap.unstack_from_pmap(part)` of the part of "
                f"`{arg}` that holds them (only the leaves below are stacked)."
            )
            + " Leaves:",
            lambda i: f"shape {leaves[i].shape}, one row on each of {leaves[i].shape[0]} devices",
        )

    def group(self, xp: Any, x: Any, axis: int, m: int) -> Any:
        """Split the row axis ``axis`` of ``x`` into ``(M, r)`` micro-batches."""
        shape = np.shape(x)
        lead = shape[:axis] + ((m,) if m > 1 else ())
        return xp.reshape(x, lead + (shape[axis] // m,) + shape[axis + 1 :])

    def row_axis(self, k: int, m: int) -> int:
        """The axis of a placed batch that is split over the devices (group axes first)."""
        return (k > 1) + (m > 1)

    def place_grouped(self, grouped: Any, k: int, m: int) -> Any:
        """Place a batch grouped for ``steps_per_call=k`` / ``accumulate=m`` (and its mask)."""
        rows = named_sharding(self.mesh, self.batch_spec(k, m))
        if grouped[1] is None:  # even rows: no mask to place
            return to_device(grouped, rows)
        mask = named_sharding(self.mesh, self.mask_spec(k, m))  # in the same one device_put
        return to_device(grouped, (jax.tree.map(lambda _: rows, grouped[0]), mask))

    def input_shardings(self, group: tuple[int, int], has_mask: bool, has_acc: bool, layout: Any):
        """What a compiled program expects of each argument, or None (no check needed)."""
        return None

    def pads_shapes(self) -> bool:
        """Whether ``lower`` pads the shapes of an uneven raw batch (as put_batch would)."""
        return False

    def compile(
        self,
        run: Callable,
        group: tuple[int, int],
        has_mask: bool,
        has_acc: bool,
        train: bool,
        donate: tuple[int, ...],
        layout: Any = None,
    ) -> Any:
        """Compile ``run(axis, state, batch[, mask][, acc])``; ``layout``: None when replicated."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _Single(Strategy):
    """``jax.jit`` on one device."""

    @property
    def state_target(self) -> Any:
        return self.devices[0]

    @functools.cached_property
    def _row_layout(self) -> tuple[Any, int, Any]:  # rows stay whole: never a mask
        return SingleDeviceSharding(self.devices[0]), 1, None

    def place_grouped(self, grouped: Any, k: int, m: int) -> Any:
        return to_device(grouped, self.devices[0])

    def input_shardings(self, group: tuple[int, int], has_mask: bool, has_acc: bool, layout: Any):
        # a leaf committed to another device is moved, as under sharded (jit refuses it)
        return [self._row_layout[0]] * (2 + has_mask + has_acc)

    def compile(self, run, group, has_mask, has_acc, train, donate, layout=None):
        return MeshBound(jax.jit(functools.partial(run, None), donate_argnums=donate), None)


@dataclasses.dataclass(frozen=True)
class _Pmap(Strategy):
    """``jax.pmap`` over local devices; the batch's leading axis is the device axis."""

    @property
    def collective_axis(self) -> AxisName | None:
        return self.axis

    def put_rows(self, batch: Any, pad: bool | None) -> Any:  # as shard_for_pmap splits rows
        return place_rows(batch, self._stacked, self.n_devices, pad, self._stacked, pmap=True)

    @functools.cached_property
    def _stacked(self) -> NamedSharding:
        return named_sharding(mesh_of(self.devices, DEFAULT_AXIS), P(DEFAULT_AXIS))

    _split_fix = (
        ", or feed the batches through flax's `jax_utils.prefetch_to_device(iterator, 2)`, "
        "whose arrays the step takes as already split"
    )

    @functools.cached_property
    def stacked_sizes(self) -> frozenset[int]:
        return frozenset({jax.local_device_count(), self.n_devices})

    def check_shapes(self, batch: Any) -> None:  # shapes are the program's: split already
        leaves, n = jax.tree.leaves(batch), self.n_devices
        raise_leaves(
            batch,
            [i for i, x in enumerate(leaves) if np.shape(x)[:1] != (n,)],
            f"`batch`'s ShapeDtypeStructs are lowered as the pmap program takes them, split "
            f"over its {n} devices: (n_devices, rows per device, ...), what `step.put_batch` "
            "makes. For rows (B, ...) give the arrays, or split the shapes: "
            f"`jax.ShapeDtypeStruct(({n}, B // {n}, ...), dtype)`. Leaves:",
            lambda i: f"shape {np.shape(leaves[i])}",
        )

    def placed(self, x: Any) -> bool:  # split over the step's devices, one row on each
        n = self.n_devices
        if not (is_jax_array(x) and x.committed and x.shape[:1] == (n,)):
            return False
        s = x.sharding
        return s.device_set == self._device_set and (n == 1 or not s.is_fully_replicated)

    @functools.cached_property
    def _device_set(self) -> frozenset[jax.Device]:
        return frozenset(self.devices)

    def splits_raw(self, batch: Any) -> bool:
        # rows, as on the other strategies, unless every leaf is already split over the devices
        # with one row count per device (a 1-D leaf, or two counts: rows placed one per device)
        leaves = jax.tree.leaves(batch)
        m = _shape(leaves[0])[1:2] if leaves else ()
        placed = m and all(self.placed(x) and x.shape[1:2] == m for x in leaves)
        return bool(leaves) and not placed

    def place_raw(self, batch: Any) -> Any:
        if self.splits_raw(batch):
            return self.put_rows(batch, pad=False)
        # the same tree when laid out as put_batch lays it (flax's prefetch_to_device too);
        # a mesh's explicit axes (jax.make_mesh's default) re-laid: pmap raised KeyError on them
        return to_device(batch, named_sharding(self.mesh, P(self.axis)))

    def place_padded(self, batch: Any, mask: Any) -> tuple[Any, Any]:
        # a 1-D mask: padded rows (shard_batch, a sharded put_batch), split as rows are; else
        # put_batch's layout (n, rows / n), each leaf moved there if committed elsewhere
        if np.ndim(mask) == 1:
            return self.put_rows((batch, mask), pad=False)
        return to_device((batch, mask), self._stacked)

    def group(self, xp: Any, x: Any, axis: int, m: int) -> Any:
        x = super().group(xp, x, axis, m)  # then move the device split in front
        shape, at = np.shape(x), axis + (m > 1)
        n = self.n_devices
        x = xp.reshape(x, shape[:at] + (n, shape[at] // n) + shape[at + 1 :])
        return xp.moveaxis(x, at, 0)

    def row_axis(self, k: int, m: int) -> int:
        return 0  # the device axis leads

    def batch_shape(self, rows: int, k: int = 1, m: int = 1) -> tuple[int, ...]:
        return (self.n_devices,) + super().batch_shape(rows // self.n_devices, k, m)

    def compile(self, run, group, has_mask, has_acc, train, donate, layout=None):
        in_axes = (None, 0) + ((0,) if has_mask else ()) + ((None,) if has_acc else ())
        pmapped = jax.pmap(
            functools.partial(run, self.axis),
            axis_name=self.axis,  # several processes: each its local devices, the axis all
            devices=list(self.devices) if jax.process_count() == 1 else None,
            in_axes=in_axes,
            out_axes=(None, None, None) if train else None,
            donate_argnums=donate,
        )
        return MeshBound(pmapped, None)  # a user's jax.set_mesh is not pmap's


@dataclasses.dataclass(frozen=True)
class _Sharded(Strategy):
    """``jax.jit`` + ``NamedSharding`` on a mesh (optionally through ``jax.shard_map``)."""

    @property
    def by_rules(self) -> bool:
        return not self.replicated or bool(self.offload)  # offloading has a layout too

    def mesh_context(self) -> contextlib.AbstractContextManager:
        return under_mesh(self.mesh)

    def local_shards(self) -> int:
        if jax.process_count() == 1:
            return self.n_devices
        sharding, n = batch_layout(self.mesh, self.axis)
        return row_multiple(sharding, n)

    def check_even(self, batch: Any, axis: int = 0) -> None:
        leaves = jax.tree.leaves(batch)  # a scalar leaf named: jit's in_shardings split it
        batch_rows(batch, [np.shape(x)[axis:] for x in leaves], "batch")
        super().check_even(batch, axis)

    def mask_spec(self, k: int = 1, m: int = 1) -> P:
        # replicated, jit counts the real rows on each device: the loss's denominator
        # needs no all-reduce before the backward pass (uneven batches: 2 all-reduces -> 1)
        if self.shard_map or jax.process_count() > 1:  # per-device code / per-process rows
            return self.batch_spec(k, m)
        return P()

    def place_grouped(self, grouped: Any, k: int, m: int) -> Any:
        if jax.process_count() > 1:  # each process's local rows -> global arrays
            return to_global(grouped, named_sharding(self.mesh, self.batch_spec(k, m)), None)
        return super().place_grouped(grouped, k, m)

    def pads_shapes(self) -> bool:
        return True

    def place_state(self, tree: Any) -> Any:
        return copy_to(tree, self.state_layout(tree) if self.by_rules else self.state_target)

    def new_state(self, params: Any, tx: Any, rng: Any, model_state: Any) -> Any:
        """Under rules, every leaf built or copied in the step's own layout (under "flax",
        params already on the mesh keep theirs); the optimizer state made by
        ``jax.jit(tx.init)`` directly in the shardings that follow the params."""
        refuse("init_state", self.mesh)
        if not self.by_rules:
            return super().new_state(params, tx, rng, model_state)
        opt = None if tx is None else jax.eval_shape(tx.init, unbox(params))
        shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, opt, rng, model_state)
        layout = step_shardings(shapes, self.mesh, self.rules, **self.options)
        params = place_tree(unbox(params), layout.params, copy=True, arg="params")
        if tx is None and model_state is None and rng is None:
            state, layout = params, layout.params
        else:
            step = place_tree(jnp.zeros((), jnp.int32), layout.step, copy=True)
            rng = place_tree(rng, layout.rng, copy=True, arg="rng")  # None: None
            model_state = place_tree(model_state, layout.model_state, copy=True, arg="model_state")
            if tx is not None:  # no replicated copy of anything big; jit's outputs never alias
                opt = jax.jit(tx.init, out_shardings=layout.opt_state)(params)  # the params
            state = TrainState(step, params, opt, rng, model_state)
        if not self.offload:
            return state
        # the offloaded fields moved to host memory (the device copies go with the last reference)
        return jax.device_put(state, offloaded(layout, state, self.offload))

    def input_shardings(self, group: tuple[int, int], has_mask: bool, has_acc: bool, layout: Any):
        rows = named_sharding(self.mesh, self.batch_spec(*group))
        replicated = named_sharding(self.mesh, P())
        mask = named_sharding(self.mesh, self.mask_spec(*group))
        out = [replicated if layout is None else layout, rows]
        return out + ([mask] if has_mask else []) + ([replicated] if has_acc else [])

    def compile(self, run, group, has_mask, has_acc, train, donate, layout=None):
        mesh, axis = self.mesh, self.axis
        ins = self.input_shardings(group, has_mask, has_acc, layout)
        if layout is not None:  # sharded params: jit only (sharded() refuses shard_map)
            run = streamed(run, layout, train)  # offloaded fields: to the devices and back
        if self.shard_map:
            # check_vma=False: the step's own psum sums replicated params' gradients, as
            # under pmap (with vma checks JAX would sum them too: n times the gradient)
            specs = tuple(s.spec for s in ins)
            out_specs = (P(), P(), P()) if train else P()
            inner = jax.shard_map(
                functools.partial(run, axis),
                mesh=mesh,
                in_specs=specs,
                out_specs=out_specs,
                check_vma=False,
            )
        else:
            inner = functools.partial(run, None)
        replicated = named_sharding(mesh, P())
        outs = (ins[0], replicated, replicated) if train else replicated
        jitted = jax.jit(inner, in_shardings=tuple(ins), out_shardings=outs, donate_argnums=donate)
        return MeshBound(jitted, mesh)  # model code may name bare PartitionSpecs


# ---------------------------------------------------------------- grouped batches


def _put_grouped(strategy: Strategy, batch: Any, k: int, m: int) -> Any:
    """Place rows grouped as ``(K?, M?, rows, ...)``, padded to ``M * devices`` and masked."""
    leaves, treedef = checked_leaves(batch, "batch")  # named as given, not as grouped
    row_axis = int(k > 1)
    raise_leaves(  # then the rows of one step, checked as an ungrouped batch's
        batch,
        [i for i, x in enumerate(leaves) if k > 1 and np.shape(x)[:1] != (k,)],
        f"with `steps_per_call`={k} every `batch` leaf needs shape (K={k}, B, ...): the rows "
        f"of {k} steps stacked (`np.stack` of {k} batches' leaves). Leaves:",
        lambda i: f"shape {np.shape(leaves[i])}",
    )
    rows = batch_rows(batch, [np.shape(x)[row_axis:] for x in leaves], "batch")
    extra = -rows % (m * strategy.local_shards())
    xp = jnp if any(isinstance(x, jax.Array) for x in leaves) else np
    out = [strategy.group(xp, pad_rows(x, extra, row_axis), row_axis, m) for x in leaves]
    lead, mask = (k,) if k > 1 else (), None  # even rows: no mask to place
    if extra:
        mask = np.broadcast_to(np.arange(rows + extra) < rows, lead + (rows + extra,))
        mask = strategy.group(np, mask, row_axis, m)
    grouped = detach_host((jax.tree.unflatten(treedef, out), mask))
    placed, mask = strategy.place_grouped(grouped, k, m)
    return Padded(placed, mask, rows) if extra else placed


def _renamed(rules: Any, params: Any) -> Any:
    """``params=``, the old name of ``rules=`` (warns; both given: refused)."""
    if rules != "replicate":
        raise UsageError(
            "pass the params rules once, as `rules=` (`params=` is its old name), "
            f"got both `rules`={short(rules)} and `params`={short(params)}."
        )
    warnings.warn(
        "`Strategy.sharded(params=...)` is now `rules=...` (the keyword of "
        "param_shardings and plan); `params=` will be removed.",
        DeprecationWarning,
        stacklevel=3,
    )
    return params


def _a_leaf(tree: Any) -> Any:
    """One leaf of ``tree`` (a raw batch reads two ways only if every leaf does: any leaf
    decides that it does not), read down dicts, lists and tuples without flattening the tree
    (a 200-leaf batch: 36 us per call) or sorting its keys (4 us)."""
    x = tree
    while isinstance(x, (dict, list, tuple)) and x:
        x = next(iter(x.values())) if isinstance(x, dict) else x[0]
    if hasattr(x, "shape"):  # an array: a leaf
        return x
    leaves = jax.tree.leaves(tree)  # another node (or None): flattened
    return leaves[0] if leaves else None


def _shape(x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)  # np.shape takes 10x as long on a jax.Array
    return np.shape(x) if shape is None else shape


def _laid_as(x: jax.Array, want: Any, mesh: Mesh) -> bool:
    """Whether ``x`` is on ``mesh`` laid out as ``want`` (flax's replicate has its own mesh)."""
    return getattr(x.sharding, "mesh", None) == mesh and same_layout(x.sharding, want, x.ndim)


def _replicates(rules: Any) -> bool:
    return isinstance(rules, str) and rules == "replicate"


def _hashable_rules(rules: Any) -> Any:
    """A list of ``(regex, spec)`` pairs as a tuple of tuples; anything else as given."""
    if isinstance(rules, list) and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in rules):
        return tuple((pattern, spec) for pattern, spec in rules)
    return rules


def as_strategy(strategy: Any) -> Strategy:
    if strategy is None:
        return Strategy.single()
    if isinstance(strategy, Strategy):
        return strategy
    raise UsageError(
        "`strategy` must be made by jaxdev.Strategy.single(...), Strategy.pmap(...) or "
        f"Strategy.sharded(...) (or None for one device), got {strategy!r}."
    )
