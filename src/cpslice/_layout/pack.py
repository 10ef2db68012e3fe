"""The input side of the same layout: packing per-sample tensors into a rank's
local tensor, the shifted targets, and the rows that hold the response.

All three are readings of ``plan.py``'s selections, so they cannot disagree with
extraction.
"""

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _checks as checks
from .._errors import LayoutError
from .._types import AnyShare, AnyValues, IntArg, RealArg, Rows, Targets
from .layout import Layout
from .plan import Local, Span, prompt_pairs, resolve


def lay_out(items: list[Tensor], local: Local, span: Span, fill: object, rest: tuple[int, ...],
            dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[T, *rest]`` of ``fill``, the rows of ``span`` (``"sample"``, or ``"targets"``: the
    next token) holding their element of the concatenated ``items``."""
    out = torch.full((local.length, *rest), checks.fill_value(fill, dtype), dtype=dtype, device=device)
    if not items:
        return out
    read = local.reads[span]
    flat = torch.cat(items).to(read.sources.device)  # e.g. CPU tokens for device logits
    return out.index_copy(0, read.rows, flat.index_select(0, read.sources).to(dtype))


def checked_tokens(tokens: object, layout: Layout) -> list[Tensor]:
    """Each sample's whole tokens, checked: ``[L_i]`` integer tensors of one dtype (and
    with a shared prefix, each group's prompts equal: ``checked_samples``)."""
    return checked_samples("tokens", tokens, layout, tokens=True)


def checked_samples(name: str, value: object, layout: Layout, *, tokens: bool = False) -> list[Tensor]:
    """Each sample's whole tensor ``[L_i, *rest]``, of one dtype and trailing shape (with
    ``tokens``, 1-D integer), checked in one pass: with a shared prefix, every sample's
    prompt equals its group's first's (``_checks.shared_prompts``; the message calls
    the argument ``name``)."""
    pairs = None if layout.shared_prefix is None else prompt_pairs(layout)  # the layout's, first
    items = checks.per_sample(name, value, layout.total_lengths, "total_length", uniform=True)
    for i, x in enumerate(items if tokens else []):
        if x.dim() != 1 or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"sample {i}: tokens[{i}] must be a 1-D integer tensor, got "
                            f"{x.dtype} {tuple(x.shape)}")
    if pairs is not None and layout.shared_prefix is not None:
        checks.shared_prompts(items, name, layout.total_lengths, layout.shared_prefix, pairs)
    return items


def _device(items: list[Tensor]) -> torch.device:
    return items[0].device if items else torch.device("cpu")


def targets_of(items: list[Tensor], local: Local, fill: object = 0) -> Tensor:
    """``shifted_targets`` of checked tokens (``checked_tokens``) in a layout resolved with the
    ``"targets"`` span on the tokens' device."""
    return lay_out(items, local, "targets", fill, (), torch.int64, local.device)


def temperatures_of(tau: float | Tensor, local: Local) -> float | Tensor:
    """A per-sample function's temperature for every local row, from checked per-sample
    temperatures (``_checks.temperatures``: a real as it is, or ``[n]``), in a layout
    resolved with the ``"sample"`` span (for ``[n]``), on its device: each sample's at
    every row holding one of its tokens and 1 at padding rows, ``[T]``."""
    if isinstance(tau, float):
        return tau
    if not local.layout.num_samples:
        return torch.ones(local.length, dtype=tau.dtype, device=local.device)
    per_sample = [t.expand(n) for t, n in zip(tau, local.layout.total_lengths)]
    return lay_out(per_sample, local, "sample", 1.0, (), tau.dtype, local.device)


def pack(
    per_sample: Sequence[AnyShare], layout: Layout, *, fill: RealArg = 0
) -> AnyValues:
    """Lay each sample's whole tensor into this rank's local tensor, as docs/layouts.md says.

    ``per_sample[i]`` is ``[L_i, *rest]`` (tokens, loss masks, position ids; any dtype,
    the same for every sample). With a shared prefix, each group's prompt is written
    once, from its first sample; the others' prompts must be equal to it (one host
    read). The result is ``[T, *rest]`` with ``T`` the layout's
    ``local_length`` when set, else the least length the layout needs (for allgather,
    ``ceil(sum(L) / cp_size)``); every position no sample holds (zigzag and bshd
    padding, a left-padded row's columns before its sample, the tail) is ``fill``.
    Differentiable for floating-point inputs.

    Raises:
        TypeError: ``per_sample`` is not a list of tensors of at least 1 dim; ``fill``
            is not a number.
        LayoutError: the number of samples, a sample's length, or a sample's dtype
            or trailing shape disagrees; a ``fill`` the dtype cannot hold exactly (0.5
            or NaN into integer tokens, 300 into uint8); with a shared prefix, a
            sample whose prompt differs from its group's first (named by sample,
            position and group).
    """
    items = checked_samples("per_sample", per_sample, layout)
    local = resolve(layout, spans=("sample",), device=_device(items), least=True)
    if not items:
        return torch.full((local.length,), checks.fill_value(fill, torch.float32))
    first = items[0]
    return lay_out(items, local, "sample", fill, tuple(first.shape[1:]), first.dtype, first.device)


def shifted_targets(
    tokens: Sequence[AnyShare], layout: Layout, *, fill: IntArg = 0, depth: IntArg = 0
) -> Targets:
    """The int64 ``[T]`` target of every local position: the next token of the same sample
    (at ``depth`` ``d``, the token ``d`` after it).

    ``tokens[i]`` is sample ``i``'s whole token tensor ``[L_i]`` (prompt + response),
    the same on every rank. A local position holding within-sample position ``p`` gets
    ``tokens[i][p + 1 + d]``; padding and each sample's last ``d + 1`` positions get
    ``fill``. Under allgather and zigzag a target on another rank is read from
    ``tokens``: no communication (multi-token prediction heads included). ``T`` as in
    ``pack``.

    Raises:
        TypeError: ``tokens`` is not a list of integer tensors; ``depth`` not an int.
        LayoutError: as ``pack``, or a sample's tokens are not 1-D; a negative ``depth``;
            a shared-prefix layout, whose prompt rows have one target per branch (call
            ``response_log_probs``, or ``response_rows`` with ``tokens`` for the targets).
    """
    d = checks.depth(depth)
    if layout.shared_prefix is not None:
        raise LayoutError(
            f"shifted_targets gives one target per row, but this layout's shared_prefix "
            f"{list(layout.shared_prefix)} puts a prompt's rows in several samples, whose "
            "branches predict different tokens there; call response_log_probs(logits, tokens, "
            "layout) (or extract_responses), which picks each branch's targets"
        )
    items = checked_tokens(tokens, layout)
    local = resolve(layout, spans=("targets",), device=_device(items), least=True, depth=d)
    return targets_of(items, local, fill)


class ResponseRows(NamedTuple):
    """This rank's response rows: ``rows`` in extraction order, ``counts[i]`` of sample i."""

    rows: Rows
    counts: list[int]


def response_rows(
    layout: Layout, device: torch.device | str | None = None, *, depth: IntArg = 0
) -> ResponseRows:
    """The local row indices of this rank's response positions, in extraction order.

    ``rows`` lists, sample after sample, exactly the rows ``extract_responses`` returns
    (at ``depth``, ``extract_responses(..., depth=d)``'s); ``counts[i]`` of them belong
    to sample ``i``. Run the LM head on just those rows of the hidden states (``R x V``
    instead of ``T x V``) and feed the result, with ``shifted_targets(...)[rows]``, to
    ``log_probs_and_entropy``; then ``torch.split(log_probs, counts)`` gives the
    per-sample shares. With a shared prefix a prompt row that predicts response tokens
    is listed once per branch (``response_log_probs`` computes it once).

    Raises:
        TypeError: ``depth`` not an int.
        LayoutError: an allgather layout without ``local_length`` (there is no local
            tensor to read ``T`` from); a negative ``depth``.
    """
    d = checks.depth(depth)
    sel = resolve(layout, spans=("response",), depth=d).reads["response"].selection
    # a copy: the cached selection must not be mutable through the result
    return ResponseRows(sel.rows.to(device or "cpu", copy=True), list(sel.counts))

