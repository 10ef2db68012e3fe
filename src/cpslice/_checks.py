"""Argument checks, in one place: every public function validates through these.

The rule for the exception type: a value of the wrong *kind* (not a tensor, not an
integer, a list where a tensor belongs) is a ``TypeError``; a value of the right kind
with the wrong length, shape, sign or range is a ``LayoutError``. Every message names
the argument, the sample where there is one, the offending value and the rule.

Python users pass more than ``int``: numpy integers and anything else with
``__index__`` count as integers, any ``Sequence`` of them (a ``range``, a tuple) as a
list of lengths, any ``numbers.Real`` (a numpy float) as a real number. ``bool`` is
never a number here: ``True`` as a length is a mistake, not a 1.
"""

import math
import numbers
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ._errors import LayoutError


def kind(value: object) -> str:
    """``"a float"``, ``"a Tensor"``: the kind of a value, for messages."""
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return f"{article} {name}"


def is_bool(value: object) -> bool:
    # numpy's bool is `bool_` (numpy 1) or `bool` (numpy 2) and has no __index__ in
    # numpy 2, but older numpy gave it one.
    return isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")


def integer(name: str, value: object) -> int:
    """``value`` as an ``int``: an int, a numpy integer, anything with ``__index__``.

    Raises:
        TypeError: a bool, a float, or anything else without ``__index__``.
    """
    if is_bool(value) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} {value!r} is {kind(value)}, not an int")
    return operator.index(value)  # type: ignore[arg-type]  # has __index__, checked above


def lengths(
    name: str, values: object, unit: str = "sample", rule: str = "lengths are whole token counts"
) -> tuple[int, ...]:
    """A ``Sequence`` of integers (list, tuple, range, ...) as a tuple of ints.

    ``name`` is the plural argument name (``total_lengths``); a bad element is reported
    as ``sample i: total_length ...`` (``unit`` ``"group"``: a shared prefix's groups),
    ``rule`` in parentheses.

    Raises:
        TypeError: not a sequence (a tensor or array: call ``.tolist()`` first), or an
            element that is not an integer.
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        hint = " (call .tolist() on it first)" if hasattr(values, "tolist") else ""
        raise TypeError(f"{name} must be a sequence of ints, got {kind(values)}{hint}")
    if isinstance(values, (list, tuple)) and all(type(v) is int for v in values):
        return tuple(values)  # plain ints, the common case: a fifth of the loop below
    out: list[int] = []
    for i, v in enumerate(values):
        if is_bool(v) or not hasattr(type(v), "__index__"):
            raise TypeError(
                f"{unit} {i}: {name.removesuffix('s')} {v!r} is {kind(v)}, not an int ({rule})"
            )
        out.append(operator.index(v))
    return tuple(out)


def real(name: str, value: object) -> float:
    """A ``numbers.Real`` (int, float, numpy float; not bool) as a float.

    Raises:
        TypeError: anything else.
    """
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {kind(value)} {value!r}")
    return float(value)


def temperature(value: object) -> float:
    """A temperature: a real number, finite and > 0.

    Raises:
        TypeError: not a real number.
        LayoutError: not finite, or <= 0.
    """
    return _finite_positive("temperature", value, "the logits are divided by it")


def temperatures(value: object, count: int, each: str) -> float | Tensor:
    """A temperature (``temperature``) or one per row or sample (``each``: ``"row"`` or
    ``"sample"``): a real number, finite and > 0; a ``[count]`` floating-point tensor,
    each finite and > 0 (checked on the CPU, where it costs no device sync); for samples
    also a sequence of ``count`` reals (returned as a CPU float64 tensor).

    Raises:
        TypeError: not a real number, a floating-point tensor or (samples) a sequence of
            reals.
        LayoutError: not finite or <= 0 (named by row or sample), or another count.
    """
    if not isinstance(value, Tensor) and not (each == "sample" and isinstance(value, Sequence)
                                              and not isinstance(value, (str, bytes))):
        return temperature(value)
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(
                f"temperature has dtype {value.dtype}; pass a floating-point tensor of one "
                f"temperature per {each}, or a real number for all"
            )
        taus = value
    else:
        taus = torch.tensor(
            [real(f"sample {i}: temperature[{i}]", v) for i, v in enumerate(value)], dtype=torch.float64
        )
    if tuple(taus.shape) != (count,):
        raise LayoutError(
            f"temperature has shape {tuple(taus.shape)}; one temperature per {each} is "
            f"[{count}] (or pass one real number for all)"
        )
    if taus.device.type == "cpu" and count:
        bad = (~torch.isfinite(taus) | (taus <= 0)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            where = f"sample {i}: " if each == "sample" else ""
            raise LayoutError(
                f"{where}temperature[{i}] = {float(taus[i])} is not allowed: each {each}'s "
                "temperature must be finite and > 0 (its logits are divided by it)"
            )
    return taus


def sample_temperatures(value: object, count: int, groups: tuple[int, ...] | None) -> float | Tensor:
    """A per-sample function's temperature: ``temperatures(value, count, "sample")``, and
    with a shared prefix (``groups``, its group sizes) one temperature per group: a
    group's prompt rows are computed once (one host read of a device tensor).

    Raises:
        TypeError, LayoutError: as ``temperatures``.
        LayoutError: a sample's temperature differs from its group's first's.
    """
    tau = temperatures(value, count, "sample")
    if not isinstance(tau, Tensor) or groups is None:
        return tau
    sizes = torch.tensor(groups, dtype=torch.int64)
    first = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes, output_size=count)
    host = tau.detach().to("cpu")
    bad = (host != host[first]).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        lead, group = _group_of(groups, i)
        raise LayoutError(
            f"sample {i}: temperature {float(host[i])} differs from sample {lead}'s "
            f"{float(host[lead])}, group {group}'s first (the samples of a shared_prefix group "
            "share their prompt's rows, whose statistics are computed once: one temperature "
            "per group)"
        )
    return tau


def shared_prompts(
    items: list[Tensor], what: str, total: tuple[int, ...], groups: tuple[int, ...],
    pairs: tuple[Tensor, Tensor, Tensor],
) -> None:
    """With a shared prefix (``groups``, its group sizes), every sample's prompt rows
    equal its group's first sample's (one host read). ``items`` are the samples' checked
    tensors (``total`` their lengths, named ``what``), ``pairs`` the layout's
    ``(copy, first, sample)``: each repeated prompt element, as an index into the
    concatenated samples, the same element of its group's first, and its sample.

    Raises:
        LayoutError: a prompt element differs (NaN equals NaN here), named by sample,
            position and group.
    """
    if not items:
        return
    copy, first, sample = (t.to(items[0].device) for t in pairs)
    flat = torch.cat(items)
    a, b = flat.index_select(0, copy), flat.index_select(0, first)
    differ = a != b
    if a.is_floating_point() or a.is_complex():
        differ &= ~(torch.isnan(a) & torch.isnan(b))  # NaN equals NaN here (torch.equal says not)
    differ = differ.reshape(differ.shape[0], -1).any(1) if differ.dim() > 1 else differ
    bad = differ.nonzero()
    if bad.numel():
        j = int(bad[0, 0])
        i = int(sample[j])
        position = int(copy[j]) - sum(total[:i])
        lead, group = _group_of(groups, i)
        raise LayoutError(
            f"sample {i}: {what}[{i}][{position}] differs from {what}[{lead}]"
            f"[{position}], the prompt of sample {lead}, group {group}'s first "
            "(the samples of a shared_prefix group share one prompt: its tokens are packed once)"
        )


def _group_of(groups: tuple[int, ...], sample: int) -> tuple[int, int]:
    """The first sample and the index of the shared-prefix group holding ``sample``."""
    first = 0
    for j, g in enumerate(groups):
        if sample < first + g:
            return first, j
        first += g
    raise AssertionError(sample)


def softcap(value: object) -> float | None:
    """None, or a soft-cap: a real number, finite and > 0.

    Raises:
        TypeError: not a real number.
        LayoutError: not finite, or <= 0.
    """
    if value is None:
        return None
    return _finite_positive("softcap", value, "the softmax reads softcap * tanh(logits / softcap)")


DIVERGENCES = {
    "forward": "KL(teacher || student)",
    "reverse": "KL(student || teacher)",
    "jsd": "beta KL(teacher || m) + (1 - beta) KL(student || m), m their mixture",
}
"""The divergences of a student from a teacher (``topk_divergence``, ``vocab_divergence``)."""


def divergence_kind(value: object) -> str:
    """``kind``: one of ``DIVERGENCES``.

    Raises:
        LayoutError: anything else; the message lists the kinds.
    """
    if not isinstance(value, str) or value not in DIVERGENCES:
        choices = "; ".join(f"{k!r} ({v})" for k, v in DIVERGENCES.items())
        raise LayoutError(f"kind={value!r} is not one of {choices}")
    return value


def mixture_beta(value: object) -> float:
    """``beta``, the teacher's weight in ``"jsd"``'s mixture: a real number in ``[0, 1]``.

    Raises:
        TypeError: not a real number.
        LayoutError: outside ``[0, 1]``.
    """
    b = real("beta", value)
    if not 0.0 <= b <= 1.0:
        raise LayoutError(
            f"beta={value!r} is not allowed: the mixture weight of jsd must be in [0, 1] "
            "(0 is kind='forward', 1 is kind='reverse', as TRL's generalized JSD)"
        )
    return b


def kind_at(kind: str, beta: float) -> str:
    """The kind a divergence computes: ``"jsd"`` at ``beta`` 0 is ``"forward"`` and at 1
    ``"reverse"`` (TRL's ends, computed as those kinds: no ``0 * inf``), else ``kind``."""
    if kind == "jsd" and beta in (0.0, 1.0):
        return "forward" if beta == 0.0 else "reverse"
    return kind


def _finite_positive(name: str, value: object, why: str) -> float:
    """A real number ``name``, finite and > 0; ``why`` says what it does, in the message.

    Raises:
        TypeError: not a real number.
        LayoutError: not finite, or <= 0.
    """
    x = real(name, value)
    if not (math.isfinite(x) and x > 0):
        raise LayoutError(f"{name}={value!r} is not allowed: it must be finite and > 0 ({why})")
    return x


def vocab_size(value: object, total: int) -> int:
    """The ids of the distribution, ``[0, vocab_size)`` of a (padded) vocabulary of
    ``total`` ids over all TP shards; None: all of them.

    Raises:
        TypeError: not an integer.
        LayoutError: < 1, or larger than ``total``.
    """
    if value is None:
        return total
    size = integer("vocab_size", value)
    if not 1 <= size <= total:
        raise LayoutError(
            f"vocab_size={size} is not allowed: it must be in [1, {total}], the full "
            "vocabulary over all TP shards (the LM head's rows, padding included); pass "
            "the tokenizer's vocabulary size"
        )
    return size


def tensor(name: str, value: object, what: str) -> Tensor:
    """``value`` if it is a tensor, else a TypeError saying ``name`` must be ``what``."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be {what}, got {kind(value)}")
    return value


def per_position(name: str, value: object) -> Tensor:
    """A per-position floating-point tensor ``[T, *rest]`` (log-probs, entropy, values).

    Raises:
        TypeError: not a tensor, 0-d, or not floating point.
    """
    x = tensor(name, value, "a torch.Tensor [T, ...]")
    if x.dim() == 0:
        raise TypeError(f"{name} is 0-d; it needs a leading per-position dimension [T, ...]")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} has dtype {x.dtype}; per-position results (log-probs, entropy, "
            "values) must be floating point"
        )
    return x


def per_sample_lengths(name: str, values: object, total: tuple[int, ...]) -> tuple[int, ...]:
    """``lengths(name, values)`` with one entry per sample of ``total`` (the
    ``total_lengths``).

    Raises:
        TypeError: as ``lengths``.
        LayoutError: another number of entries than ``len(total)``.
    """
    given = lengths(name, values)
    if len(given) != len(total):
        raise LayoutError(
            f"{name} has {len(given)} samples but total_lengths has {len(total)} "
            "(one entry per sample in each)"
        )
    return given


def tensor_list(name: str, value: object, count: int, what: str) -> list[Tensor]:
    """A sequence of ``count`` tensors of at least one dimension, one per sample.

    Raises:
        TypeError: ``value`` is a tensor or not a sequence; an element is not a tensor
            of at least one dimension.
        LayoutError: it holds another number of elements than ``count``.
    """
    if isinstance(value, (Tensor, str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of per-sample tensors, got {kind(value)}")
    if len(value) != count:
        raise LayoutError(f"{name} has {len(value)} samples but the layout has {count}")
    items: list[Tensor] = []
    for i, x in enumerate(value):
        if not isinstance(x, Tensor):
            raise TypeError(f"sample {i}: {name}[{i}] must be a tensor {what}, got {kind(x)}")
        if x.dim() == 0:
            raise TypeError(f"sample {i}: {name}[{i}] is 0-d; it must be a tensor {what}")
        items.append(x)
    return items


def per_sample(
    name: str, value: object, want: Sequence[int], which: str, *, uniform: bool = False, one_dim: bool = False,
    floating: bool = False,
) -> list[Tensor]:
    """One tensor per sample whose dimension 0 is ``want[i]``.

    ``which`` names ``want`` in messages: ``"total_length"``, ``"response_length"``, or
    ``"this rank's share"``. With ``uniform`` every tensor must share sample 0's dtype
    and trailing shape (one tensor is built from them all); with ``one_dim`` each must be
    1-D; with ``floating`` each must be floating point.

    Raises:
        TypeError: not a sequence of tensors of at least one dimension; with
            ``floating``, a tensor that is not floating point.
        LayoutError: another number of samples than ``len(want)``, a sample of another
            length, and with ``one_dim`` / ``uniform`` a shape or dtype that differs.
    """
    items = tensor_list(name, value, len(want), f"[{which}, ...]")
    for i, (x, n) in enumerate(zip(items, want)):
        if floating and not x.is_floating_point():
            raise TypeError(
                f"sample {i}: {name}[{i}] has dtype {x.dtype}; it must be floating point"
            )
        if one_dim and x.dim() != 1:
            raise LayoutError(
                f"sample {i}: {name}[{i}] has shape {tuple(x.shape)}; it must be 1-D "
                f"[{which}] = [{n}]"
            )
        if x.shape[0] != n:
            raise LayoutError(
                f"sample {i}: {name}[{i}] has {x.shape[0]} positions but {which} is {n}"
            )
        if uniform and (x.shape[1:] != items[0].shape[1:] or x.dtype != items[0].dtype):
            raise LayoutError(
                f"sample {i}: {name}[{i}] is {x.dtype} {tuple(x.shape)} but sample 0 is "
                f"{items[0].dtype} {tuple(items[0].shape)} (trailing shape and dtype must "
                "agree)"
            )
    return items


def fill_value(fill: object, dtype: torch.dtype) -> float | int | bool:
    """``fill`` as a value ``dtype`` holds exactly: refuse a fill it would truncate.

    Raises:
        TypeError: ``fill`` is not a real number (or a bool for a bool dtype).
        LayoutError: a fraction, NaN or infinity for an integer dtype, or an integer
            outside the dtype's range; anything but 0/1 for bool.
    """
    if dtype == torch.bool:
        if is_bool(fill):
            return bool(fill)
        value = real("fill", fill)
        if value not in (0.0, 1.0):
            raise LayoutError(f"fill {fill!r} cannot be held by a bool tensor (0, 1, False or True)")
        return bool(value)
    if dtype.is_floating_point or dtype.is_complex:
        return real("fill", fill)
    if hasattr(type(fill), "__index__") and not is_bool(fill):
        whole = operator.index(fill)  # type: ignore[arg-type]  # has __index__
    else:
        value = real("fill", fill)
        if not value.is_integer():
            raise LayoutError(
                f"fill {fill!r} cannot be held by {dtype} (an integer dtype holds whole "
                "numbers; it would be truncated)"
            )
        whole = int(value)
    info = torch.iinfo(dtype)
    if not info.min <= whole <= info.max:
        raise LayoutError(f"fill {fill!r} is outside the range of {dtype} [{info.min}, {info.max}]")
    return whole


def cp_group(
    what: str, name: str, cp_rank: int, cp_size: int, group: dist.ProcessGroup | None
) -> int:
    """The size of ``group``, which must be the CP group of a layout ``name`` that is
    rank ``cp_rank`` of ``cp_size`` (above 1); ``what`` is the function that needs it.
    ``None`` means no group, as ``tp_group=None`` means no TP: refused here, where
    the call needs CP communication.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        LayoutError: no group (``None``); this process is another rank, or the group
            another size.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} at cp_size {cp_size} needs torch.distributed: call init_process_group "
            "first"
        )
    if group is None:
        raise LayoutError(
            f"{what} at cp_size {cp_size} needs cp_group=, the CP process group "
            "(megatron-core: parallel_state.get_context_parallel_group(); dist.group.WORLD "
            "when every process is one CP group); None means no group, as tp_group=None "
            "means no TP"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp_size != size or cp_rank != rank:
        raise LayoutError(
            f"{name} is rank {cp_rank} of cp_size {cp_size} but this process is rank "
            f"{rank} of a group of {size}; pass the CP group (megatron-core: "
            "parallel_state.get_context_parallel_group()) as cp_group="
        )
    return size


def depth(value: object) -> int:
    """A target depth ``d``: an int ``>= 0`` (position ``p`` predicts token ``p + 1 + d``).

    Raises:
        TypeError: not an int (a bool or a float included).
        LayoutError: negative.
    """
    d = integer("depth", value)
    if d < 0:
        raise LayoutError(
            f"depth {d} < 0 (at depth d the logit at position p predicts token p + 1 + d; "
            "d = 0 is the next token)"
        )
    return d
