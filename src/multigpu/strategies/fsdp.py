"""The ``fsdp`` strategy: fully sharded data parallelism (torch's FSDP2, ``fully_shard``).

Each process still trains on its shard of the global batch, as under ddp, but holds only
``1/world_size`` of the parameters, gradients and optimizer state: a block's parameters are
all-gathered just before its forward (and again in backward), its gradients reduce-scattered after.

    with Session(strategy="fsdp", fsdp=FSDPOptions(wrap=[Block])) as session:
        model = session.setup_model(build_model())
        optimizer = torch.optim.AdamW(model.parameters())    # after setup_model: the sharded parameters

Which modules become their own all-gather group (:func:`select_blocks`):

- ``FSDPOptions(wrap=[Block, ...])``: every submodule of those classes;
- by default, top-down from the root: a submodule holding at most ``max_share`` (default 10%) of
  the model's parameters becomes one group, if it holds at least ``min_share`` (1%); a bigger one
  is split into its children; ``ModuleList``/``ModuleDict`` (which have no forward of their own)
  are always split. Everything not in a group (small layers, a module's own parameters, and
  parameters two modules share, such as tied embeddings) stays with the root's group.

The largest group is what one process holds unsharded at a time (two with prefetching), so the
default keeps that near a tenth of the model. The precision maps to FSDP2's
``MixedPrecisionPolicy`` instead of autocast: ``bf16``/``fp16`` keep float32 sharded parameters
for the optimizer, all-gather and compute in 16 bits, reduce-scatter gradients in float32 (or in
16 bits with ``FSDPOptions(reduce_fp32=False)``), and return float32 outputs from the root.

torch's FSDP modules are imported when a model is sharded (they take seconds to import), so the
launcher and the planner can ask this strategy its facts without paying for them.
"""

from __future__ import annotations

import os
import platform
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from multigpu.devices import DeviceType, get_device_type
from multigpu.errors import ConfigError
from multigpu.runtime.world import DEFAULT_TIMEOUT_S, LaunchEnv
from multigpu.strategies.base import ProcessPerDeviceStrategy
from multigpu.strategies.precision import FP16, Precision, build_precision

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

_PARAM_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """How the fsdp strategy shards the model (ignored by the other strategies).

    Attributes:
        wrap: module classes each instance of which becomes its own all-gather group (e.g. the
            transformer block); None: the share rule of the module docstring.
        max_share: default rule: the largest share of the model's parameters one group may hold
            before it is split into its children (0 < max_share <= 1).
        min_share: default rule: smaller modules stay with the root's group (0 <= min_share <= max_share).
        reshard_after_forward: free each block's gathered parameters after its forward and gather
            them again in backward (less memory); False keeps them until backward (less communication).
        reduce_fp32: under bf16/fp16 precision, reduce-scatter gradients in float32 (default); False
            reduces in the 16-bit compute dtype (half the bytes, a rounded sum).
    """

    wrap: Sequence[type[nn.Module]] | None = None
    max_share: float = 0.1
    min_share: float = 0.01
    reshard_after_forward: bool = True
    reduce_fp32: bool = True

    def __post_init__(self) -> None:
        if self.wrap is not None:
            classes = tuple(self.wrap)
            bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
            if bad or not classes:
                raise ConfigError(
                    f"FSDPOptions(wrap={self.wrap!r}) must list nn.Module classes, e.g. wrap=[Block] "
                    "(the class of the model's repeated block), or be None for the default rule"
                )
            object.__setattr__(self, "wrap", classes)  # a tuple: hashable, and no later mutation
        if not 0 < self.max_share <= 1:
            raise ConfigError(f"FSDPOptions(max_share={self.max_share}) must lie in (0, 1], e.g. 0.1")
        if not 0 <= self.min_share <= self.max_share:
            raise ConfigError(
                f"FSDPOptions(min_share={self.min_share}) must lie in [0, max_share={self.max_share}], e.g. 0.01"
            )


def select_blocks(model: nn.Module, options: FSDPOptions) -> list[nn.Module]:
    """The submodules that become their own FSDP group, children before parents (see the module docstring).

    Example:
        >>> net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(10)])
        >>> len(select_blocks(net, FSDPOptions()))
        10
    """
    if options.wrap is not None:
        chosen = [m for m in model.modules() if m is not model and isinstance(m, tuple(options.wrap))]
        return chosen[::-1]  # reversed pre-order: a nested match is sharded before its parent
    total = _count(model)
    if total == 0:
        return []
    chosen = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            count = _count(child)
            container = isinstance(child, (nn.ModuleList, nn.ModuleDict))
            if count == 0:
                continue
            if container or (count > options.max_share * total and any(True for _ in child.children())):
                visit(child)
            elif count >= options.min_share * total:
                chosen.append(child)

    visit(model)
    shared = _shared_parameter_ids(model)
    return [m for m in chosen if not any(id(p) in shared for p in m.parameters())]


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, uses in seen.items() if uses > 1}


def apply_fsdp(model: nn.Module, device: torch.device, options: FSDPOptions, precision: str) -> nn.Module:
    """``model`` (on ``device``) sharded in place with ``fully_shard``: its blocks, then the root.

    Every rank must call it, with the same model (rank 0's initial weights are not broadcast:
    seed every rank alike, as the Session does, or load the same weights first).

    Args:
        model: the bare model, on ``device``.
        device: this process's device (the mesh's device type).
        options: the :class:`FSDPOptions`.
        precision: the Session's precision name; sets the ``MixedPrecisionPolicy``.

    Returns:
        ``model`` itself, now an ``FSDPModule`` whose parameters are sharded DTensors.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    param_dtype = _PARAM_DTYPES[precision]
    reduce_dtype = torch.float32 if param_dtype is not None and options.reduce_fp32 else None
    inner = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in select_blocks(model, options):
        fully_shard(block, mesh=mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=inner)
    # Only the root casts its outputs back to float32 (the loss then sees what autocast would
    # give it); an inner block's float32 output would meet its successor's 16-bit weights.
    root = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=torch.float32 if param_dtype else None
    )
    # None lets torch keep the root's parameters gathered from forward into backward (needed first there).
    fully_shard(
        model, mesh=mesh, reshard_after_forward=None if options.reshard_after_forward else False, mp_policy=root
    )
    return model


def warn_if_started_without_sharding_env(device: torch.device, environ: Mapping[str, str]) -> None:
    """Warn when this process was started without what its device type asks for fsdp.

    ``multigpu launch --strategy fsdp`` starts its workers with it
    (:meth:`~multigpu.devices.base.DeviceType.sharded_process_env`); a process started by torchrun
    or by hand does not. On the CPU it is glibc's malloc returning freed buffers, read when the
    process starts: without it the blocks' gathered copies stay resident after they are freed.
    """
    missing = FSDPStrategy.launch_env(get_device_type(device.type), environ)
    if not missing or platform.libc_ver()[0] != "glibc":
        return
    settings = " ".join(f"{name}={value}" for name, value in missing.items())
    warnings.warn(
        f"fsdp on {device.type} in a process started without {settings}: glibc's malloc keeps the freed "
        "copies of the gathered blocks resident, and each process's peak memory can exceed ddp's (1.76x "
        "measured on CPU; 0.51x with it). Start the workers with `multigpu launch --strategy fsdp`, which "
        "sets it, or set it in the environment of torchrun; any malloc setting of your own silences this.",
        RuntimeWarning,
        stacklevel=4,
    )


def fsdp_root(model: nn.Module) -> FSDPModule | None:
    """The FSDP module under a ``torch.compile`` wrapper, or None when ``model`` is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, FSDPModule) else None


@contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """The region of an accumulating micro-step: gradients accumulate unsharded, no reduce-scatter."""
    root = fsdp_root(model)
    if root is None:
        yield
        return
    root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        root.set_requires_gradient_sync(True)


def check_optimizer(optimizer: torch.optim.Optimizer, models: Sequence[weakref.ref[nn.Module]]) -> None:
    """Fail when ``optimizer`` holds parameters that are not those of the sharded models.

    ``fully_shard`` replaces every parameter with a new sharded one; an optimizer built before
    ``setup_model`` would step the old tensors, which get no gradient: training would silently
    do nothing.

    Raises:
        ConfigError: naming how many parameters are stale and the fix.
    """
    sharded = {id(p) for ref in models if (m := ref()) is not None for p in m.parameters()}
    stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in sharded]
    if stale:
        raise ConfigError(
            f"the optimizer holds {len(stale)} parameter(s) that are not the sharded model's (the first has "
            f"shape {tuple(stale[0].shape)}): it was built before session.setup_model(...), which replaces "
            "the parameters under fsdp. Build the optimizer after it, from the model setup_model returned: "
            "model = session.setup_model(model); optimizer = torch.optim.AdamW(model.parameters())"
        )


def release_mesh_groups() -> None:
    """Drop what torch's device meshes and FSDP's states hold of the process groups, before they are destroyed.

    ``destroy_process_group`` shuts a group down, but a gloo group's threads (two workers and the
    transport's loop) end only when its last reference goes, and every ``DeviceMesh`` keeps its groups
    in a registry while DTensor's sharding caches keep the mesh for the process's life (FSDP's mesh
    infos hold the group as well). The threads then ran on at exit and, a few runs in a hundred here
    (a third under a reviewer's load), one aborted the process after the script had finished
    ("terminate called without an active exception"). Called when the Session destroys the group:
    afterwards the sharded parameters still read (``state_dict``, ``full_tensor`` no longer: it
    communicates), and torch frees the group, its threads with it, inside ``destroy_process_group`` (so in
    examples/train.py's workers; a shorter script still keeps the group through a holder not found yet).
    """
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    mesh_info: tuple[type, ...] = ()
    try:  # torch's private home of FSDP's mesh infos (2.13); elsewhere only the meshes are released
        from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshInfo

        mesh_info = (DataParallelMeshInfo,)
    except ImportError:
        pass

    gc.collect()  # models the script dropped (their FSDP states form cycles) hold no group after this
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()
        elif isinstance(obj, mesh_info):
            for name, value in list(vars(obj).items()):
                if isinstance(value, dist.ProcessGroup):
                    setattr(obj, name, None)


class _ModuleBF16(Precision):
    """bf16 under fsdp: FSDP casts the parameters (MixedPrecisionPolicy), so no autocast."""

    name: ClassVar[str] = "bf16"


class _ShardedFP16(FP16):
    """fp16 under fsdp: FSDP casts the parameters; the scaler agrees on overflow across ranks."""

    def __init__(self, device_type: str) -> None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        Precision.__init__(self, device_type)
        # ShardedGradScaler all-reduces "found inf": each rank sees only its gradient shard.
        self.scaler: Any = ShardedGradScaler(device=device_type)

    def autocast(self) -> Any:
        return nullcontext()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        with warnings.catch_warnings():
            # The scaler's one-element inf flag meets DTensor gradients; DTensor treats it as
            # replicated (right: it was all-reduced) and warns at every step.
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            return super().step(optimizer)


def build_fsdp_precision(name: str, device_type: str) -> Precision:
    """The Session's precision object under fsdp (no autocast: FSDP's policy casts instead)."""
    if name == "bf16":
        return _ModuleBF16(device_type)
    if name == "fp16":
        return _ShardedFP16(device_type)
    return build_precision(name, device_type)


class FSDPStrategy(ProcessPerDeviceStrategy):
    """One process per device, launched; parameters, gradients and optimizer state sharded by FSDP2."""

    name: ClassVar[str] = "fsdp"
    label: ClassVar[str] = "FSDP"
    options_type: ClassVar[type | None] = FSDPOptions
    options: FSDPOptions

    @classmethod
    def launch_env(cls, device_type: DeviceType, environ: Mapping[str, str]) -> dict[str, str]:
        # what the device type asks for a process that shards its model (CPU: glibc's malloc
        # returning freed buffers; see warn_if_started_without_sharding_env)
        return device_type.sharded_process_env(environ)

    def __init__(
        self,
        *,
        env: LaunchEnv,
        device: torch.device,
        options: FSDPOptions | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        precision: str = "fp32",
    ) -> None:
        super().__init__(
            env=env, device=device, options=options or FSDPOptions(), timeout_s=timeout_s, precision=precision
        )
        self._sharded: list[weakref.ref[nn.Module]] = []
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def build_precision(self) -> Precision:
        return build_fsdp_precision(self.precision_name, self.device.type)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if not self._sharded and self.is_main_process:  # once, from rank 0
            warn_if_started_without_sharding_env(self.device, os.environ)
        # the MixedPrecisionPolicy follows the strategy's precision, whenever build_precision is called
        sharded = apply_fsdp(model.to(self.device), self.device, self.options, self.precision_name)
        self._sharded.append(weakref.ref(sharded))
        return sharded

    def release_models(self) -> None:
        if self._sharded:
            release_mesh_groups()
        self._sharded.clear()

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        return gradient_sync_off(model)

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._checked:  # once per optimizer: its parameters do not change
            check_optimizer(optimizer, self._sharded)
            self._checked.add(optimizer)
