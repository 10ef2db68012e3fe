"""The vocabulary functions' argument checks, on ``_checks``' rules: a wrong kind is a
``TypeError``, a wrong shape, value or range a ``LayoutError``; every message names the
argument, the values and the rule. All run before any collective.

Every public function checks its tensors (``logits_and_targets`` and ``logits_rows``:
``[..., V_local]`` logits, flattened to their rows by ``leading``; ``logits``: 2-D, the
glue's; ``head_and_targets``, ``head``), then hands every other argument to ``options``,
the one entry: each checked once, in one order, into the call's ``Options``. The tensor
checks read a DTensor first (``dtensor``): the vocabulary-sharded input's local shard and
its mesh's TP group (the group they return, for ``options``), every other tensor's local
value."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Unpack

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks as checks
from .. import _probe
from .._cache import boundary
from .._errors import LayoutError
from .._types import HiddenKeywords as HiddenKeywordsOf
from .._types import LogProbKeywords, TemperatureArg, compute_dtype
from . import dtensor
from .call import Options
from .leading import Leading
from .softmax import Tau
from .token_sets import Support, check_support, on_host

if TYPE_CHECKING:
    Keywords = LogProbKeywords[TemperatureArg, Support]
    """The keywords of ``log_probs_and_entropy`` and ``log_probs_and_entropy_from_hidden``
    beside ``with_entropy``: one temperature per row, the engine's ``Support``."""
    HiddenKeywords = HiddenKeywordsOf[TemperatureArg, Support]
    """``Keywords`` and ``sequence_parallel``: ``log_probs_and_entropy_from_hidden``'s."""
else:  # beartype reads no subscripted TypedDict; at run time each value is ``object``
    Keywords = LogProbKeywords
    HiddenKeywords = HiddenKeywordsOf


def options(
    x: Tensor,
    vocab_local: int,
    ids: Tensor | None,
    *,
    what: str = "logits",
    default_chunk: int | None = None,
    with_entropy: bool = False,
    **keywords: Unpack[Keywords],
) -> Options:
    """The call's ``Options`` from the checked ``x`` (``[T, V_local]`` logits or ``[T, H]``
    hidden states, named ``what``), its shard's ``vocab_local`` ids, its checked ``ids``
    (``[T]`` targets, ``[T, k]`` ids, or None for a top-k) and the raw keywords, a keyword
    not given taking its public default. In this order: the temperature, ``chunk_size``
    (None: ``default_chunk``), ``softcap``, ``vocab_size`` (and ``tp_group``'s
    membership), the ids inside the vocabulary (on the CPU), ``entropy_over``, the
    ``support`` and ``invariant``. Nothing here enters a collective."""
    tp_group = keywords.get("tp_group")
    tau = temperature(keywords.get("temperature", 1.0), x.shape[0], x)
    chunk = chunk_size(keywords.get("chunk_size"))
    cap = checks.softcap(keywords.get("softcap"))
    vocab = checks.vocab_size(keywords.get("vocab_size"), tp_world(tp_group) * vocab_local)
    if ids is not None:
        in_vocabulary(ids, vocab, "targets" if ids.dim() == 1 else "ids")
    entropy_over = keywords.get("entropy_over", "full")
    support = sets(keywords.get("support"), entropy_over, x.shape[0], vocab, what)
    invariant = flag("invariant", keywords.get("invariant", False))
    if invariant and isinstance(tau, float):
        # a per-row tensor: every division by it is a true one (CUDA multiplies by the
        # reciprocal of a Python-number divisor), as the spec's (docs/invariance.md)
        tau = torch.full((x.shape[0],), tau, dtype=compute_dtype(x.dtype), device=x.device)
    return Options(
        with_entropy=with_entropy,
        entropy_grad=keywords.get("entropy_grad", True),
        tau=tau,
        tp_group=tp_group,
        chunk_size=default_chunk if chunk is None else chunk,
        support=support,
        over_support=entropy_over == "support",
        cap=cap,
        vocab_size=vocab,
        invariant=invariant,
    )


def flag(name: str, value: object) -> bool:
    """A ``bool`` keyword (numpy's too), never a truthy stand-in."""
    if not checks.is_bool(value):
        raise TypeError(f"{name}={value!r} is {checks.kind(value)}; pass True or False")
    return bool(value)


def chunk_size(value: object) -> int | None:
    """``chunk_size``: None, or rows per chunk >= 1."""
    if value is None:
        return None
    chunk = checks.integer("chunk_size", value)
    if chunk < 1:
        raise LayoutError(
            f"chunk_size={chunk} is not allowed: it must be >= 1 (rows per "
            "chunk), or None for the default (about CHUNK_BYTES of work buffers)"
        )
    return chunk


def _ids_kind(name: str, value: object, what: str) -> Tensor:
    ids = checks.tensor(name, value, f"a torch.Tensor {what} of int64 token ids")
    if ids.dtype != torch.int64:
        raise TypeError(f"{name} has dtype {ids.dtype}; pass int64 token ids ({name}.long())")
    return ids


def _ids_fit(
    name: str, shape: tuple[int, ...], device: torch.device, rows: int, at: torch.device, what: str
) -> None:
    """``[T]`` for ``targets``, ``[T, k]`` (``k >= 1``) for any other ``name``; on ``at``."""
    if name == "targets" and shape != (rows,):
        raise LayoutError(
            f"{name} has shape {shape} but {what} has {rows} rows; {name} "
            f"must be [T] = [{rows}], one token id per row"
        )
    if name != "targets" and (len(shape) != 2 or shape[0] != rows or shape[1] < 1):
        raise LayoutError(
            f"{name} has shape {shape} but {what} has {rows} rows; {name} must be [T, k] = "
            f"[{rows}, k], k >= 1 token ids per row"
        )
    if device != at:
        raise LayoutError(
            f"{name} is on {device} but {what} on {at}; put them on "
            "the same device"
        )


def _logits_kind(value: object, name: str = "logits") -> Tensor:
    logits = checks.tensor(name, value, "a torch.Tensor [T, V_local]")
    if not logits.is_floating_point():
        raise TypeError(
            f"{name} has dtype {logits.dtype}; pass floating-point logits (float32 or "
            "bfloat16; float16 and float64 are accepted too)"
        )
    return logits


def _logits_shape(logits: Tensor, nd: bool = False, name: str = "logits") -> None:
    """2-D ``[T, V_local]`` logits (``nd``: at least 2-D, ``[..., V_local]``) with columns."""
    if logits.dim() < 2 or (logits.dim() > 2 and not nd):
        raise LayoutError(
            f"{name} has shape {tuple(logits.shape)}; it must be 2-D [T, V_local] "
            + ("or more, [..., V_local]: one row per index of its leading dimensions (e.g. [B, S, V_local])"
               if nd else "(flatten the batch first: logits.reshape(-1, logits.shape[-1]))")
        )
    if logits.shape[-1] == 0:
        raise LayoutError(
            f"{name} has shape {tuple(logits.shape)}: 0 vocabulary columns; a vocabulary "
            "shard needs at least one"
        )


Group = dist.ProcessGroup | None


def logits(value: object, tp_group: Group = None) -> tuple[Tensor, Group]:
    """``[T, V_local]`` floating-point logits with at least one column, and the TP group
    (``tp_group``, or a DTensor's: ``dtensor.vocab_shard``)."""
    local, group = dtensor.vocab_shard("logits", value, -1, tp_group)
    logits_ = _logits_kind(local)
    _logits_shape(logits_)
    return logits_, group


def logits_rows(value: object, tp_group: Group = None) -> tuple[Tensor, Group, Leading]:
    """``[..., V_local]`` floating-point logits (at least 2-D, at least one column) as their
    ``[T, V_local]`` rows, the TP group (as ``logits``) and their ``Leading`` shape, which
    gives the results the leading shape back (``leading``)."""
    local, group = dtensor.vocab_shard("logits", value, -1, tp_group)
    logits_ = _logits_kind(local)
    _logits_shape(logits_, nd=True)
    lead = Leading.of("logits", logits_)
    return lead.flat(logits_), group, lead


def logits_pair(
    student: object, teacher: object, tp_group: Group = None, names: tuple[str, str] = ("student", "teacher")
) -> tuple[Tensor, Tensor, Group, Leading]:
    """A student's and a teacher's ``[..., V_local]`` floating-point logits of one shape, on
    one device (each as ``logits_rows`` checks logits, a DTensor's local shard), as their
    ``[T, V_local]`` rows; the TP group (``tp_group``, or a DTensor's) and the student's
    ``Leading`` shape. ``names``: theirs in errors (``response_vocab_distillation``'s
    ``logits`` and ``teacher_logits``)."""
    found: list[Tensor] = []
    group = tp_group
    for name, value in zip(names, (student, teacher)):
        local, group = dtensor.vocab_shard(name, value, -1, group)
        x = _logits_kind(local, name)
        _logits_shape(x, nd=True, name=name)
        found.append(x)
    s, t = found
    s_name, t_name = names
    if s.shape != t.shape:
        raise LayoutError(
            f"{s_name} has shape {tuple(s.shape)} but {t_name} has {tuple(t.shape)}: both are [..., V_local] "
            "logits of the same rows over the same vocabulary shard"
        )
    if s.device != t.device:
        raise LayoutError(f"{t_name} is on {t.device} but {s_name} on {s.device}; put them on the same device")
    lead = Leading.of(s_name, s)
    return lead.flat(s), lead.flat(t), group, lead


def logits_and_targets(
    logits: object, targets: object, name: str = "targets", *, tp_group: Group = None
) -> tuple[Tensor, Tensor, Group, Leading]:
    """``[..., V_local]`` logits as ``logits_rows`` and int64 token ids on their device:
    ``[...]`` targets, or ``[..., k]`` ids with ``name="ids"``, flattened with them to
    ``[T]`` or ``[T, k]``; the TP group and the ``Leading`` shape. 2-D logits keep their
    own messages (``_ids_fit``)."""
    local, group = dtensor.vocab_shard("logits", logits, -1, tp_group)
    logits_ = _logits_kind(local)
    targets_ = _ids_kind(name, dtensor.replicated(name, targets), "[T]" if name == "targets" else "[T, k]")
    _logits_shape(logits_, nd=True)
    lead = Leading.of("logits", logits_)
    if lead.nd:
        targets_ = lead.per_row(name, targets_, None if name == "targets" else "k")
    _ids_fit(name, tuple(targets_.shape), targets_.device, lead.rows, logits_.device, "logits")
    return lead.flat(logits_), targets_, group, lead


def head_and_targets(
    hidden: object, weight: object, targets: object, name: str = "targets", *, tp_group: Group = None,
    sequence_parallel: object = False,
) -> tuple[Tensor, Tensor, Tensor, Group, Group]:
    """``[T, H]`` hidden states and a ``[V_local, H]`` LM-head shard of one float dtype on
    one device, and int64 token ids on it (``[T]`` targets, or ``[T, k]`` with ``name="ids"``);
    the TP group, as ``head``; and the sequence-parallel group (``sequence``), with which
    ``hidden`` holds this TP rank's ``[T / tp, H]``."""
    hidden_, weight_, group = head(hidden, weight, tp_group)
    shards = sequence(sequence_parallel, group)
    tp = tp_world(shards)
    rows = hidden_.shape[0] * tp
    targets = dtensor.replicated(name, targets)
    if isinstance(targets, Tensor):
        # the shape of int64 ids before the kind of other ones, the device of any
        shape = tuple(targets.shape) if targets.dtype == torch.int64 else (rows,) if name == "targets" else (rows, 1)
        what = "hidden" if shards is None else gathered(hidden_.shape[0], tp)
        with hinted(lambda: "" if shards is not None or not shape else sequence_hint(rows, shape[0], group, name)):
            _ids_fit(name, shape, targets.device, rows, hidden_.device, what)
    return hidden_, weight_, _ids_kind(name, targets, "[T]" if name == "targets" else "[T, k]"), group, shards


def sequence(value: object, group: Group) -> Group:
    """The group over which ``hidden`` is sharded on the sequence: the TP ``group``
    (``tp_group``, or a DTensor weight's) with ``sequence_parallel`` (a bool) True, None
    with it False."""
    if not flag("sequence_parallel", value):
        return None
    if group is None:
        raise LayoutError(
            "sequence_parallel=True needs tp_group: hidden is then this TP rank's [T / tp, H] shard of the "
            "sequence, gathered over the TP group; pass tp_group (or the weight as a DTensor sharded on the TP "
            "mesh dimension), or sequence_parallel=False with every row in hidden"
        )
    tp_world(group)  # refuses a group this process is not in
    return group


def gathered(rows: int, tp: int) -> str:
    """The name of sequence-parallel ``hidden`` in errors: its ``rows`` on each of ``tp`` ranks."""
    return f"hidden gathered over tp_group ({rows} rows x tp {tp})"


def sequence_hint(rows: int, need: int, group: Group, of: str) -> str:
    """The hint of a length error where ``rows`` of ``hidden`` times the TP size are what
    ``of`` needs (``need``): Megatron's sequence parallelism; empty otherwise."""
    tp = tp_world(group)
    if tp == 1 or rows * tp != need:
        return ""
    return (
        f"{rows} * tp {tp} = {need} is what {of} needs: if hidden is this TP rank's shard of the sequence, "
        "pass sequence_parallel=True with tp_group (Megatron's --sequence-parallel)"
    )


@contextmanager
def hinted(hint: Callable[[], str]) -> Iterator[None]:
    """A ``LayoutError`` raised within, its message followed by ``hint()`` (if any)."""
    try:
        yield
    except LayoutError as err:
        more = hint()
        if more:
            err.args = (f"{err}; {more}",)
        raise


def head(hidden: object, weight: object, tp_group: Group = None) -> tuple[Tensor, Tensor, Group]:
    """``[T, H]`` hidden states and a ``[V_local, H]`` LM-head shard of one float dtype,
    on one device, and the TP group (``tp_group``, or a DTensor weight's:
    ``dtensor.vocab_shard``; a DTensor ``hidden`` must be replicated)."""
    hidden = dtensor.replicated(
        "hidden", hidden, "hidden.full_tensor() gathers sequence-parallel hidden states; the hidden "
        "states are the same on every TP rank; or pass its local shard, hidden.to_local(), with "
        "sequence_parallel=True"
    )
    weight, group = dtensor.vocab_shard("weight", weight, 0, tp_group)
    checked = []
    for name, given, shape in (("hidden", hidden, "[T, H]"), ("weight", weight, "[V_local, H]")):
        x = checks.tensor(name, given, f"a torch.Tensor {shape}")
        if not x.is_floating_point():
            raise TypeError(
                f"{name} has dtype {x.dtype}; pass floating-point tensors (float32 or "
                "bfloat16; float16 and float64 are accepted too)"
            )
        if x.dim() != 2:
            raise LayoutError(
                f"{name} has shape {tuple(x.shape)}; it must be 2-D {shape}"
                + (" (flatten the batch first: hidden.reshape(-1, hidden.shape[-1]))"
                   if name == "hidden" else "")
            )
        checked.append(x)
    hidden_, weight_ = checked
    if hidden_.dtype != weight_.dtype:
        raise TypeError(
            f"hidden has dtype {hidden_.dtype} but weight {weight_.dtype}; pass both in the "
            "same dtype (the LM head's matmul runs in it)"
        )
    if weight_.shape[0] == 0:
        raise LayoutError(
            f"weight has shape {tuple(weight_.shape)}: 0 vocabulary rows; a vocabulary "
            "shard needs at least one"
        )
    if hidden_.shape[1] != weight_.shape[1]:
        raise LayoutError(
            f"hidden has shape {tuple(hidden_.shape)} and weight {tuple(weight_.shape)}: "
            f"the hidden sizes {hidden_.shape[1]} and {weight_.shape[1]} must agree "
            "(logits = hidden @ weight.T)"
        )
    if weight_.device != hidden_.device:
        raise LayoutError(
            f"weight is on {weight_.device} but hidden on {hidden_.device}; put them on the "
            "same device"
        )
    return hidden_, weight_, group


def tp_world(tp_group: dist.ProcessGroup | None) -> int:
    """The TP group's size (1 without one); refuses a group this process is not in."""
    if tp_group is None:
        return 1
    if dist.get_rank(tp_group) < 0:
        raise LayoutError("this process is not a member of tp_group")
    return dist.get_world_size(tp_group)


@boundary  # data-dependent (nonzero): not for a compiled caller to trace
def in_vocabulary(targets: Tensor, vocab_total: int, name: str = "targets") -> None:
    """On the CPU, where it costs no device sync, refuse an id outside the vocabulary
    (``[T]`` targets or ``[T, k]`` ids)."""
    checked = _probe.step("host_checks", on_host)
    if not checked(targets) or targets.numel() == 0:
        return
    bad = ((targets < 0) | (targets >= vocab_total)).nonzero()
    if bad.numel():
        at = ", ".join(str(int(i)) for i in bad[0])
        what = "rows" if targets.dim() == 1 else "ids"
        raise LayoutError(
            f"{name}[{at}] = {int(targets[tuple(bad[0])])} is outside the vocabulary [0, {vocab_total}) "
            f"({bad.shape[0]} such {what}); padding rows need an id in range too, e.g. 0"
        )


def k_best(value: object) -> int:
    """``k`` of a top-k: an integer >= 1 (the vocabulary bounds it too, checked later)."""
    k = checks.integer("k", value)
    if k < 1:
        raise LayoutError(f"k={k} is not allowed: it must be >= 1 (ids per row)")
    return k


def sets(
    support: object, entropy_over: object, rows: int, vocab_total: int, what: str = "logits"
) -> Support | None:
    """``support`` checked against the ``rows`` of ``what`` and the vocabulary (see
    ``support.check_support``), after ``entropy_over``."""
    if entropy_over not in ("full", "support"):
        raise LayoutError(
            f"entropy_over={entropy_over!r} is not one of 'full' (entropy over the whole "
            "vocabulary) or 'support' (over each row's set plus its target)"
        )
    if support is None:
        return None
    return check_support(support, rows, vocab_total, what)


def temperature(value: object, rows: int, like: Tensor) -> Tau:
    """A real temperature, or ``[T]`` per row moved to ``like``'s device in its compute
    dtype (see ``_checks.temperatures``)."""
    tau = checks.temperatures(dtensor.replicated("temperature", value), rows, "row")
    if isinstance(tau, float):
        return tau
    return tau.to(device=like.device, dtype=compute_dtype(like.dtype), non_blocking=True)
