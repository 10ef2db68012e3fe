"""One head, two kinds: what a call's logits come from, and the one autograd shell over it.

A *head* is either this rank's ``[T, V_local]`` logits (``logits.LogitsHead``) or the
final hidden states with this rank's LM-head shard (``hidden.HiddenHead``: ``logits =
hidden @ weight.T``, never built whole). Each driver writes its head's numerics
(``forward``, ``backward``, ``topk_forward``); everything around them is written once
here, over any head: the call's ``Options`` (``options``), the ``torch.autograd.Function``
of the log-probs and of the top-k (the head's tensors are the Function's inputs, the head
rebuilt from them inside), and the typed entries ``log_probs``, ``entropy`` and ``topk``
that the public functions and the glue call. A call whose head needs no gradient (under
``torch.no_grad()``, or no tensor of it requiring one: old and reference log-probs) runs
the driver's forward alone, one pass, and keeps nothing for a backward.
"""

from collections.abc import Callable, Sequence
from typing import Any, Protocol, Unpack, cast, runtime_checkable

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _probe
from .._types import compute_dtype
from . import args
from . import topk as _topk
from .call import Options, Saved


@runtime_checkable
class Head(Protocol):
    """What a call's logits come from, as the shell and the glue need it: its ``tensors``
    (the autograd inputs; its class called with them rebuilds it), ``x`` (the ``[T, ...]``
    tensor of its rows: their number, device and dtype), its shard's ``vocab_local`` ids,
    its name (``what``) and default ``chunk_size``, and its driver's numerics."""

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors the head's gradients are for, in its constructor's order."""
        ...

    @property
    def x(self) -> Tensor:
        """The ``[T, ...]`` tensor whose rows are the head's rows."""
        ...

    @property
    def vocab_local(self) -> int:
        """This shard's vocabulary size."""
        ...

    @property
    def what(self) -> str:
        """The name of ``x`` in errors (``"logits"`` or ``"hidden"``)."""
        ...

    @property
    def default_chunk(self) -> int | None:
        """Rows per chunk when ``chunk_size`` is None (None: the kernels' default)."""
        ...

    @property
    def in_place(self) -> bool:
        """Whether a per-sample call computes the response rows where they are (a mask
        of rows, ``Options.rows``: the logits' rows cost nothing to skip) or on a copy of
        the distinct response rows (``take``: the hidden states, whose rows each cost a
        matmul)."""
        ...

    def take(self, index: Tensor) -> "Head":
        """The head of the rows ``index`` (an int64 index on ``x``'s device)."""
        ...

    def whole(self) -> "Head":
        """The head that computes every row: this one, or (a sequence-parallel shard of
        the hidden states) the head of the rows gathered over the TP group."""
        ...

    def forward(self, ids: Tensor, options: Options) -> tuple[Tensor, Tensor | None, Saved]:
        """The log-probs of ``ids``, the entropy (None without it), the ``Saved`` record."""
        ...

    def topk_forward(self, k: int, options: Options) -> tuple[Tensor, Tensor, Saved]:
        """The ``[T, k]`` largest log-probs, their ids, the ``Saved`` record."""
        ...

    def backward(
        self, ids: Tensor, entropy: Tensor | None, saved: Saved, g_lp: Tensor | None, g_entropy: Tensor | None,
        want: Sequence[bool],
    ) -> tuple[Tensor | None, ...]:
        """The gradients w.r.t. ``tensors``, each where ``want`` says (None elsewhere)."""
        ...


def options(
    head: Head, ids: Tensor | None, *, with_entropy: bool = False, **keywords: Unpack[args.Keywords]
) -> Options:
    """The call's ``Options`` over every row of ``head`` (``args.options``, with the head's
    name and default chunk), ``ids`` (or None for a top-k) checked against its vocabulary."""
    return args.options(head.x, head.vocab_local, ids, what=head.what, default_chunk=head.default_chunk,
                        with_entropy=with_entropy, **keywords)


def _keep(ctx: Any, kind: Any, saved: Saved, tensors: Sequence[Tensor | None]) -> None:
    """A forward's state for its backward: ``tensors`` saved by autograd, the rest on ``ctx``
    (a ``save`` event of ``_probe``)."""
    if _probe.active is not None:
        _probe.active.save(kind.__name__, sum(t is not None for t in tensors))
    ctx.save_for_backward(*tensors)
    ctx.kind, ctx.saved = kind, saved
    ctx.set_materialize_grads(False)


def _grads(
    ctx: Any, ids: Tensor, entropy: Tensor | None, tensors: Sequence[Tensor], g_lp: Tensor | None,
    g_entropy: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """A backward's result: None for the three arguments before the head's tensors, then
    the gradient of each tensor where it is wanted."""
    want = ctx.needs_input_grad[3:]
    if not any(want):
        return None, None, None, *(None for _ in want)
    head = ctx.kind(*tensors)
    return None, None, None, *head.backward(ids, entropy, ctx.saved, g_lp, g_entropy, want)


class _LogProbs(torch.autograd.Function):
    """A thin shell over the head's ``forward`` and ``backward`` (``kind``: the head's
    class, its ``tensors`` the last inputs): the head's tensors, the ids and (when its
    gradient is wanted) the entropy through ``save_for_backward``, the rest as one
    ``Saved``."""

    @staticmethod
    def forward(ctx: Any, kind: Any, ids: Tensor, options: Options, *tensors: Tensor) -> tuple[Tensor, Tensor | None]:
        log_p, entropy, saved = kind(*tensors).forward(ids, options)
        keep = entropy is not None and options.entropy_grad
        _keep(ctx, kind, saved, (ids, entropy if keep else None, *tensors))
        if entropy is not None and not keep:
            ctx.mark_non_differentiable(entropy)
        return log_p, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_lp: Tensor | None, g_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        ids, entropy, *tensors = ctx.saved_tensors
        return _grads(ctx, ids, entropy, tensors, g_lp, g_entropy)


class _TopK(torch.autograd.Function):
    """The head's ``topk_forward``, differentiable like ``torch.topk``: the gradient of the
    chosen entries is the head's ``backward`` at the chosen ids."""

    @staticmethod
    def forward(ctx: Any, kind: Any, k: int, options: Options, *tensors: Tensor) -> tuple[Tensor, Tensor]:
        log_p, ids, saved = kind(*tensors).topk_forward(k, options)
        _keep(ctx, kind, saved, (ids, *tensors))
        ctx.mark_non_differentiable(ids)
        return log_p, ids

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_lp: Tensor | None, g_ids: None) -> tuple[Tensor | None, ...]:
        ids, *tensors = ctx.saved_tensors
        return _grads(ctx, ids, None, tensors, g_lp, None)


# torch leaves Function.apply untyped; typed once here, at the boundary.
_apply = cast(Callable[..., tuple[Tensor, Tensor | None]], _LogProbs.apply)
_apply_topk = cast(Callable[..., tuple[Tensor, Tensor]], _TopK.apply)


def _forward_only(head: Head) -> bool:
    """Whether no gradient can reach the head's tensors: grad mode off, or none requires one."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in head.tensors))


def log_probs(head: Head, ids: Tensor, options: Options) -> tuple[Tensor, Tensor | None]:
    """The log-probs of ``ids`` (``[T]`` targets or ``[T, k]``) and the entropy (None
    without it), differentiable w.r.t. the head's tensors; where none needs a gradient,
    the driver's forward alone (the same values: the same blocks) and nothing kept."""
    if _forward_only(head):
        with torch.no_grad():  # as inside a Function's forward: a temperature tensor too
            log_p, entropy, _ = head.forward(ids, options)
        return log_p, entropy
    return _apply(type(head), ids, options, *head.tensors)


def entropy(head: Head, **keywords: Unpack[args.Keywords]) -> Tensor:
    """Each row's entropy alone, differentiable w.r.t. the head's tensors: the log-probs'
    call with no picked id (``[T, 0]`` ids: nothing gathered, no picked logit in the
    all-gather) and ``keywords`` checked as ``options``' (``entropy_grad`` left out: the
    entropy is the result); a support only with ``entropy_over="support"``, whose rows
    with a set take the entropy over the set alone (the full entropy needs none)."""
    none = torch.empty((head.x.shape[0], 0), dtype=torch.int64, device=head.x.device)
    opts = options(head, none, with_entropy=True, **keywords)
    if not opts.over_support:
        opts = opts._replace(support=None)
    result = log_probs(head.whole(), none, opts)[1]
    assert result is not None
    return result


def check_topk(head: Head, k: int, options: Options) -> None:
    """Refuse a ``k`` the vocabulary cannot give (``topk.check_k``): for a caller that
    enters a collective before ``topk`` (a sequence-parallel gather), first."""
    assert options.vocab_size is not None
    _topk.check_k(k, options.vocab_size, compute_dtype(head.x.dtype))


def topk(head: Head, k: int, options: Options) -> tuple[Tensor, Tensor]:
    """Each row's ``k`` largest log-probs, descending, and their global ids, after the
    check of ``k`` against the vocabulary (``check_topk``); differentiable like
    ``torch.topk`` (forward only where no tensor of the head needs a gradient)."""
    check_topk(head, k, options)
    if _forward_only(head):
        with torch.no_grad():
            log_p, ids, _ = head.topk_forward(k, options)
        return log_p, ids
    return _apply_topk(type(head), k, options, *head.tensors)
