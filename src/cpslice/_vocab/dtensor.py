"""DTensor inputs, read in one place: what a vocabulary function computes on when it is
given a ``torch.distributed.tensor.DTensor``.

The vocabulary-sharded input (the logits, sharded ``Shard(-1)``; the hidden-state
path's ``[V, H]`` LM-head weight, sharded ``Shard(0)``) must be sharded on exactly one
dimension of its mesh, the TP one, in equal contiguous shards (rank ``r`` of that mesh
dimension holds ids ``[r * V_local, (r + 1) * V_local)``, cpslice's TP convention), and
``Replicate`` on every other: its local shard (``to_local()``, differentiable, so the
gradient reaches the DTensor) is what the engine computes on, the mesh dimension's
process group its ``tp_group``. Every other tensor (targets, ids, a per-row temperature,
the hidden states, a support's ids and offsets, per-sample tensors) may be a DTensor
``Replicate`` on every mesh dimension: its local tensor, the whole value, is used. Any
other placement is refused with a ``LayoutError`` that names the argument, the
placements found and what to pass instead; results are always plain tensors.

``import cpslice`` never imports ``torch.distributed.tensor``: while it is not loaded no
value can be a DTensor, and nothing here imports it (``_api``): the DTensor's class and
its placements' are looked up in ``sys.modules`` (torch 2.4's ``torch.distributed._tensor``
too), and the placements read through their own methods.
"""

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, overload

import torch.distributed as dist
from torch import Tensor

from .._errors import LayoutError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor
else:  # at run time (debug mode's checks) any tensor: this module never imports DTensor
    DTensor = Tensor

_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")


def _api() -> ModuleType | None:
    """The loaded module that exports ``DTensor`` and its placements (torch 2.4's
    ``torch.distributed._tensor``, its public home since 2.5); None while none is."""
    for name in _MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "DTensor"):
            return module
    return None


def _loaded(value: object) -> DTensor | None:
    """``value`` if it is a DTensor, else None; with no import (a plain tensor, or any
    value while ``torch.distributed.tensor`` is not loaded, is none)."""
    if type(value) is Tensor or not isinstance(value, Tensor):
        return None
    api = _api()
    if api is None:
        return None
    cls: type[DTensor] = api.DTensor
    return value if isinstance(value, cls) else None


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    return _loaded(value) is not None


def _where(x: DTensor) -> str:
    """``x``'s placements and mesh, for messages."""
    mesh = x.device_mesh
    names = mesh.mesh_dim_names
    shape = "(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) + ")" if names else str(mesh.shape)
    return f"placements {tuple(x.placements)} on a mesh of shape {shape}"


def _unreplicated(x: DTensor) -> list[int]:
    """The mesh dimensions on which ``x`` is not ``Replicate``."""
    return [i for i, p in enumerate(x.placements) if not p.is_replicate()]


@overload
def replicated(name: str, value: Tensor, instead: str = "") -> Tensor: ...
@overload
def replicated(name: str, value: object, instead: str = "") -> object: ...
def replicated(name: str, value: object, instead: str = "") -> object:
    """``value``'s local tensor (the whole value) if it is a DTensor ``Replicate`` on
    every mesh dimension, ``value`` itself if it is no DTensor (its own checks follow).

    Raises:
        LayoutError: a DTensor sharded or partial on some mesh dimension.
    """
    x = _loaded(value)
    if x is None:
        return value
    if not _unreplicated(x):
        return x.to_local()
    hint = instead or "its full_tensor() gathers it"
    raise LayoutError(
        f"{name} is a DTensor with {_where(x)}; cpslice reads {name} whole on every rank: pass a "
        f"plain tensor or a DTensor Replicate on every mesh dimension ({hint})"
    )


def replicated_each(name: str, values: object) -> object:
    """``values`` (per-sample tensors) with each DTensor among them replaced by its
    local tensor (``replicated``, named by sample); anything else as given."""
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes, Tensor)):
        return values
    if not any(is_dtensor(v) for v in values):
        return values
    return [replicated(f"sample {i}: {name}[{i}]", v) for i, v in enumerate(values)]


def vocab_shard(
    name: str, value: object, dim: int, tp_group: dist.ProcessGroup | None
) -> tuple[object, dist.ProcessGroup | None]:
    """The local shard of a vocabulary-sharded DTensor (``dim`` its vocabulary dimension,
    -1 for logits, 0 for a ``[V, H]`` weight) and the TP group, its mesh dimension's; for
    anything else ``value`` and ``tp_group`` as given.

    Raises:
        LayoutError: the vocabulary not sharded on exactly one mesh dimension (any other
            placement on the others), sharded unevenly, this process outside the mesh,
            or ``tp_group`` given and another group than that mesh dimension's.
    """
    x = _loaded(value)
    if x is None:
        return value, tp_group
    vocab_dim = dim % x.dim() if x.dim() else 0
    what = "the last dimension, Shard(-1)" if dim == -1 else f"dimension {dim}, Shard({dim})"
    others = _unreplicated(x)
    p = x.placements[others[0]] if len(others) == 1 else None
    # exactly Shard: not a subclass (older torch's _StridedShard is one), whose chunks are strided
    if p is None or not p.is_shard(vocab_dim) or type(p) is not getattr(_api(), "Shard", None):
        raise LayoutError(
            f"{name} is a DTensor with {_where(x)}; cpslice takes {name} with its vocabulary "
            f"({what}) sharded on exactly one mesh dimension, the TP one, and Replicate on every "
            f"other: {_instead(name, x, others, dim)}"
        )
    mesh_dim = others[0]
    size, local = x.device_mesh.size(mesh_dim), x.to_local()
    if x.shape[vocab_dim] != local.shape[vocab_dim] * size:
        raise LayoutError(
            f"{name} is a DTensor whose vocabulary of {x.shape[vocab_dim]} ids is split unevenly over "
            f"the {size} ranks of mesh dimension {mesh_dim} ({local.shape[vocab_dim]} here); cpslice's "
            "TP shards are equal and contiguous (rank r holds ids [r * V_local, (r + 1) * V_local)): "
            f"pad the vocabulary to a multiple of {size} and pass vocab_size={x.shape[vocab_dim]} "
            "(megatron pads it so: make_vocab_size_divisible_by)"
        )
    return local, _group(name, x, mesh_dim, tp_group)


def _instead(name: str, x: DTensor, others: list[int], dim: int) -> str:
    """What to pass instead of ``x``, which is not ``Replicate`` on the mesh dimensions
    ``others`` and not sharded as ``vocab_shard`` takes it."""
    shard = "Shard(-1)" if dim == -1 else f"Shard({dim})"
    placements = [x.placements[i] for i in others]
    if not others:
        return (f"every rank holds the whole vocabulary; pass {name}.to_local() without tp_group, or "
                f"distribute it with {shard} over the TP mesh dimension")
    if any(p.is_partial() for p in placements):
        return (f"a Partial {name} is a sum still to be reduced; redistribute it to {shard} on the TP "
                "mesh dimension, Replicate on the others")
    if len(others) > 1:
        return (f"mesh dimensions {others} are not Replicate; pass a DTensor on the TP mesh dimension "
                "alone (its submesh, e.g. mesh['tp']), or the local shard with tp_group=")
    found = getattr(placements[0], "dim", None)
    if found == dim % max(x.dim(), 1):
        return (f"its vocabulary is sharded in strided chunks ({placements[0]}), not in contiguous "
                f"ones; redistribute it to {shard}")
    if dim == -1:
        return (f"sharded on dimension {found}, each rank holds other rows of the whole vocabulary: "
                f"pass {name}.to_local() without tp_group (each rank's rows its own), or redistribute "
                f"it to {shard}")
    return (f"sharded on dimension {found}, not the vocabulary's; redistribute it to {shard} (a "
            "column-parallel LM head splits the vocabulary)")


def _group(
    name: str, x: DTensor, mesh_dim: int, tp_group: dist.ProcessGroup | None
) -> dist.ProcessGroup:
    """The process group of ``x``'s TP mesh dimension; ``tp_group``, when given, must be
    it (or one over the same ranks in the same order)."""
    mesh = x.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise LayoutError(f"{name} is a DTensor on a mesh this process is not part of ({mesh})")
    group = mesh.get_group(mesh_dim)
    if dist.get_rank(group) != coordinate[mesh_dim]:
        raise LayoutError(
            f"{name}'s mesh dimension {mesh_dim} puts this process at {coordinate[mesh_dim]} but its "
            f"group ranks it {dist.get_rank(group)}; the shard index must be the group rank"
        )
    if tp_group is None or tp_group is group:
        return group
    ours = dist.get_process_group_ranks(group)
    theirs = dist.get_process_group_ranks(tp_group) if dist.get_rank(tp_group) >= 0 else None
    if theirs != ours:
        label = repr(mesh.mesh_dim_names[mesh_dim]) if mesh.mesh_dim_names else str(mesh_dim)
        given = "a group this process is not a member of" if theirs is None else f"ranks {theirs}"
        raise LayoutError(
            f"tp_group ({given}) is not the group of the TP mesh dimension {label} of {name} (ranks "
            f"{ours}); leave tp_group unset for a DTensor (its mesh gives the group), or pass that "
            f"group: {name}.device_mesh.get_group({mesh_dim})"
        )
    return group
