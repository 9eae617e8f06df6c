"""The device mesh a run is laid out on: named axes ``pp``, ``dp``, ``sp``, ``tp`` (DESIGN.md §4b).

Ranks are laid out as torchtitan's and DeepSpeed's grids: ``pp`` outermost, then ``dp``, ``sp``, and ``tp``
innermost (a tensor-parallel group's ranks are neighbours), so with ``sp = tp = 1`` a rank is
``stage * dp + replica`` as :mod:`dsfunc.pipeline.topology` has it. The mesh is built once, from the config
(``tensor_parallel.autotp_size``, ``sequence_parallel_size``, ``pipeline.stages``; the rest is ``dp``) or from
a torch ``DeviceMesh`` the user gives, and the program carries it; every collective is then given one of its
:class:`~dsfunc.distributed.comm.Group` s. ZeRO shards and reduces over ``dp x sp`` (parameters are replicated
over ``sp``, as DeepSpeed folds sequence parallelism into ZeRO's group; [Note: the gradient over sp] says what the
sum is divided by); the config's batch sizes count ``dp``.
``ep`` is no axis of this mesh: experts are laid out on one of their own over the same ranks, as DeepSpeed's
AutoEP+AutoTP "folding" lays them out (``module_inject/auto_ep_folding.py``): ep groups are blocks of
``expert_parallel.autoep_size`` consecutive ranks and each expert is replicated over the strided rest (its
expert-data-parallel ranks; :mod:`dsfunc.experts.groups`), whatever tp and dp are. With tp innermost an ep group
of tp's size is a tp group; one may also span tp groups or sit inside one, since a tp group's ranks share their
tokens out before dispatch ([Note: experts under tensor parallelism] in :mod:`dsfunc.experts.ep_block`).
A pipelined run's mesh is ``pp x dp x tp`` (:func:`pipeline_mesh`): each
stage's layers are split over its tp ranks as an unpipelined model's are; ``sp`` is refused there by name.

[Note: the gradient over sp] DeepSpeed 0.19.8 sums each parameter's gradient over ZeRO's dp x sp group and divides
by dp at ZeRO 0-2 (``stage_1_and_2.py``, the engine's allreduce: ``div_(world / sequence_parallel_size)``) but by
dp x sp at ZeRO-3 (its default reduce-scatter averages over the whole group; 0.20.2 divides by dp there too, and
Hugging Face's Trainer multiplies its sp loss by sp at ZeRO-3 for DeepSpeed below 0.20.2, the version dsfunc
answers as). dsfunc divides as DeepSpeed 0.19.8 (:meth:`Mesh.sp_summed`), so a script's loss gets DeepSpeed's
gradient at every stage. Measured against one process at sp 2 (and sp 2 x dp 2), SGD: a loss whose backward gives
each sp rank its own tokens' share of the mean (Trainer's) trains like one process at ZeRO 0-2, at 1/sp of its
gradient at ZeRO-3 (Trainer's factor restores it); the ALST tutorial's loss (the ranks' sums combined by a
differentiable all-gather or all-reduce, whose backward gives every rank the whole mean's gradient) gets sp times
one process's gradient at ZeRO 0-2 and one process's at ZeRO-3. dsfunc's own sp loss backpropagates the share or
the whole to match (:func:`~dsfunc.parallel.sequence.sequence_parallel_loss`): one process's gradient at every
stage (``tests/parallel/test_ulysses_against_deepspeed.py``). DeepSpeed 0.19.8's ZeRO-3 with ``reduce_scatter:
false`` divides by dp on its contiguous-gradients path (Trainer refuses that configuration); dsfunc divides as the
default reduce-scatter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dsfunc.config import mesh_sections
from dsfunc.distributed import comm
from dsfunc.errors import InputError, NotSupportedError

AXES = ("pp", "dp", "sp", "tp")  # outermost first
ZERO = "dp_sp"  # the flattened dp x sp axis ZeRO runs over (a torch DeviceMesh dimension name)


@dataclasses.dataclass(frozen=True, eq=False)
class Mesh:
    """The run's axes: their sizes, torch's ``DeviceMesh`` over the axes larger than one (and ``dp``; None in a
    process without a process group), and this rank's group along each axis and along ZeRO's ``dp x sp``."""

    sizes: Mapping[str, int]
    device_mesh: DeviceMesh | None
    groups: Mapping[str, comm.Group]  # axis (or ZERO) -> this rank's group along it

    def size(self, axis: str) -> int:
        """The ranks along ``axis`` (1 for an axis the run does not split)."""
        _check_axis(axis)
        return self.sizes.get(axis, 1)

    def group(self, axis: str) -> comm.Group:
        """This rank's group along ``axis`` (``"dp_sp"``: ZeRO's); this rank alone along an axis of size 1."""
        if axis != ZERO:
            _check_axis(axis)
        return self.groups.get(axis) or comm.Group.lone()

    def __getitem__(self, axis: str) -> DeviceMesh:
        """torch's one-dimensional mesh along ``axis`` (``mesh["sp"].get_group()`` is the sp process group)."""
        if self.device_mesh is None or axis not in (self.device_mesh.mesh_dim_names or ()):
            raise InputError(f"the mesh has no torch DeviceMesh dimension {axis!r} (its sizes: {dict(self.sizes)}; "
                             "an axis of size 1 in a run without a process group has none): use mesh.group(axis)")
        return self.device_mesh[axis]

    @property
    def zero(self) -> comm.Group:
        """The ranks ZeRO shards each unit over and reduces its gradients over: ``dp x sp``."""
        return self.group(ZERO)

    def sp_summed(self, stage: int) -> int:
        """The sp ranks whose gradients ZeRO stage ``stage`` adds up, not averages, as DeepSpeed 0.19.8 does: all at
        ZeRO 0-2 (the dp x sp sum divided by dp), one at ZeRO-3 (divided by dp x sp): [Note: the gradient over sp]."""
        return 1 if stage == 3 else self.size("sp")

    @property
    def batch_ranks(self) -> int:
        """The data-parallel ranks the config's batch sizes count (``dp``)."""
        return self.size("dp")

    def describe(self) -> str:
        """The axes and their sizes, ``pp 1 x dp 2 x sp 1 x tp 2``."""
        return " x ".join(f"{a} {self.size(a)}" for a in AXES)

    def check_same(self, other: Mesh | DeviceMesh) -> None:
        """Raise unless ``other`` is this mesh (or torch's mesh it was made of): a state is laid out on one."""
        same = other is self or (self.device_mesh is not None and other is self.device_mesh)
        if not same and isinstance(other, Mesh):
            same = dict(other.sizes) == dict(self.sizes) and other.zero.ranks == self.zero.ranks
        if not same:
            shown = other.describe() if isinstance(other, Mesh) else f"a DeviceMesh {other.mesh_dim_names}"
            raise InputError(f"the mesh given ({shown}) is not the state's ({self.describe()}): a state is laid "
                             "out on the mesh init_state(mesh=...) was given; pass that one, or none")


def _check_axis(axis: str) -> None:
    if axis == "ep":
        raise NotSupportedError("the mesh has no ep axis: experts are split over groups of their own over the same "
                                "ranks (expert_parallel.autoep_size consecutive ranks, as DeepSpeed folds them "
                                "beside tp; dsfunc.experts.groups); set expert_parallel.autoep_size, and leave ep "
                                "out of the mesh")
    if axis not in AXES:
        raise InputError(f"no mesh axis {axis!r}: the axes are {', '.join(AXES)} (and {ZERO!r}, ZeRO's dp x sp)")


def make_mesh(*, tp: int = 1, sp: int = 1, pp: int = 1, device_type: str = "cpu") -> Mesh:
    """The mesh over the current world with ``tp`` x ``sp`` x ``pp`` ranks per data-parallel replica (a
    collective: every rank builds it, in the same order)."""
    for name, n in (("tensor_parallel.autotp_size", tp), ("sequence_parallel_size", sp), ("pipeline stages", pp)):
        if n < 1:
            raise InputError(f"{name} must be at least 1, got {n}")
    world = comm.world_size()
    per_replica = tp * sp * pp
    if world % per_replica:
        raise InputError(
            f"the world size {world} is not divisible by the mesh's tp {tp} x sp {sp} x pp {pp} = {per_replica} "
            f"ranks per data-parallel replica: launch a multiple of {per_replica} ranks or change "
            "tensor_parallel.autotp_size / sequence_parallel_size / pipeline.stages")
    sizes = {"pp": pp, "dp": world // per_replica, "sp": sp, "tp": tp}
    if not comm.is_distributed():
        return Mesh(sizes, None, {})
    key = (id(dist.group.WORLD), device_type, tuple(sizes.values()))
    if key not in _MADE:  # once per process group: each mesh's groups live as long as it
        names = tuple(a for a in AXES if sizes[a] > 1 or a == "dp")
        device_mesh = init_device_mesh(device_type, tuple(sizes[a] for a in names), mesh_dim_names=names)
        _MADE.clear()
        _MADE[key] = from_device_mesh(device_mesh, flatten=True)
    return _MADE[key]


_MADE: dict[tuple[Any, ...], Mesh] = {}  # the last mesh make_mesh built, by its world and shape


def from_device_mesh(device_mesh: DeviceMesh, *, flatten: bool = True) -> Mesh:
    """The mesh of a torch ``DeviceMesh`` whose dimensions are named among pp, dp, sp, tp (an axis it does not
    name has size 1); ``flatten`` makes ZeRO's dp x sp dimension when sp is larger than one (a collective)."""
    names = tuple(device_mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in (*AXES, ZERO)]
    if not names or unknown:
        raise InputError(f"a mesh for dsfunc names its dimensions among {', '.join(AXES)}, got {names or 'none'}: "
                         'e.g. init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))')
    if "ep" in names:
        _check_axis("ep")
    sizes = {a: device_mesh.size(names.index(a)) if a in names else 1 for a in AXES}
    if math.prod(sizes.values()) != comm.world_size():
        raise InputError(f"the mesh {sizes} holds {math.prod(sizes.values())} ranks but the world has "
                         f"{comm.world_size()}: a mesh for init_state spans every rank")
    groups = {a: comm.Group.of(device_mesh.get_group(a)) for a in names if a in AXES}
    if sizes["sp"] > 1 and flatten:
        zero_dims = tuple(a for a in ("dp", "sp") if a in names)
        groups[ZERO] = comm.Group.of(device_mesh[zero_dims]._flatten(ZERO).get_group())
    else:
        groups[ZERO] = groups.get("dp") or comm.Group.lone()
    return Mesh(sizes, device_mesh, groups)


def pipeline_mesh(stages: int, config: Any, given: Mesh | DeviceMesh | None, device_type: str) -> Mesh:
    """The mesh of a pipelined run: ``stages`` pipeline ranks outermost, each stage's ranks ``dp x tp`` (the config's
    ``tensor_parallel.autotp_size``), or ``given`` (checked against the stages and the config's tp)."""
    tensor, sp, _ = mesh_sections(config)
    mesh = _checked(given, config) if given is not None else None
    if sp > 1 or (mesh is not None and mesh.size("sp") > 1):
        raise NotSupportedError(
            f"pipeline stages with sequence parallelism (sequence_parallel_size {sp}, or a mesh with an sp axis) are "
            "not supported by dsfunc yet: the pipelined step would have to split each micro-batch's inputs and labels "
            "along the sequence and average the last stage's loss over the sp ranks, which it does not. Drop "
            "sequence_parallel_size, or the pipeline (dp x tp x sp composes with ZeRO 1-3, and so does pp x dp x tp)")
    mesh = mesh or make_mesh(tp=tensor.size, pp=stages, device_type=device_type)
    if mesh.size("pp") != stages:
        raise InputError(f"the mesh given has pp {mesh.size('pp')} but the pipeline has {stages} pipeline ranks per "
                         "replica (pipeline.stages / stages_per_rank): make them agree")
    return mesh


def run_mesh(config: Any, given: Mesh | DeviceMesh | None, device: torch.device) -> Mesh:
    """The mesh of an unpipelined run: ``given`` (checked against the config's axes), or the one the config
    describes over the current world."""
    tensor, sp, _ = mesh_sections(config)
    if given is None:
        return make_mesh(tp=tensor.size, sp=sp, device_type=device.type)
    mesh = _checked(given, config)
    if mesh.size("pp") > 1:
        raise InputError(f"the mesh given has pp {mesh.size('pp')} but the run has no pipeline: give the config a "
                         "pipeline section (or init_state(pipeline=...)) with that many stages, or a mesh without pp")
    return mesh


def _checked(given: Mesh | DeviceMesh, config: Any) -> Mesh:
    """``given`` as a :class:`Mesh`, checked against the config's tp and sp where it names them."""
    tensor, sp, _ = mesh_sections(config)
    mesh = given if isinstance(given, Mesh) else from_device_mesh(given)
    for axis, wanted in (("tp", tensor.size if tensor.autotp_size else None), ("sp", sp if sp > 1 else None)):
        if wanted is not None and mesh.size(axis) != wanted:
            raise InputError(f"the mesh given has {axis} {mesh.size(axis)} but the config asks for {wanted} "
                             f"({'tensor_parallel.autotp_size' if axis == 'tp' else 'sequence_parallel_size'}); "
                             "make them agree or drop the config key")
    return mesh
