"""One call for a training step: targets, log-probs/entropy, extraction."""

from collections.abc import Sequence
from typing import Literal, overload

import torch.distributed as dist

from . import _checks as checks
from ._errors import LayoutError
from ._extract import extract_responses
from ._layout import Layout
from ._logprob import log_probs_and_entropy
from ._pack import shifted_targets
from ._plan import resolve_length
from ._support import Support
from ._types import AnyShare, IntArg, Logits, RealArg, Share


@overload
def response_log_probs(
    logits: Logits,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: Literal[False] = False,
    entropy_grad: bool = True,
    temperature: RealArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: IntArg | None = None,
    support: Support | None = None,
    entropy_over: Literal["full", "support"] = "full",
) -> tuple[list[Share], None]: ...
@overload
def response_log_probs(
    logits: Logits,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: Literal[True],
    entropy_grad: bool = True,
    temperature: RealArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: IntArg | None = None,
    support: Support | None = None,
    entropy_over: Literal["full", "support"] = "full",
) -> tuple[list[Share], list[Share]]: ...
@overload
def response_log_probs(
    logits: Logits,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: RealArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: IntArg | None = None,
    support: Support | None = None,
    entropy_over: Literal["full", "support"] = "full",
) -> tuple[list[Share], list[Share] | None]: ...
def response_log_probs(
    logits: Logits,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: RealArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: IntArg | None = None,
    support: Support | None = None,
    entropy_over: Literal["full", "support"] = "full",
) -> tuple[list[Share], list[Share] | None]:
    """Per-sample response log-probs (and entropy) from this rank's logits, end to end.

    ``shifted_targets`` -> ``log_probs_and_entropy`` -> ``extract_responses``, all in
    this rank's layout: ``logits`` is the rank's local ``[T, V_local]`` tensor (its TP
    vocabulary shard), ``tokens`` the whole per-sample token tensors ``[L_i]`` (prompt +
    response, the same on every rank). Returns one ``[r_i]`` float32 share per sample,
    and the entropy shares aligned with them (None unless ``with_entropy``).
    ``support`` (e.g. ``Support.from_responses(ids, offsets, layout)``, over the ``T``
    local rows) and ``entropy_over`` restrict the log-probs (and entropy) to the
    rollout's top-p / top-k sets, as in ``log_probs_and_entropy``.

    Collectives: those of ``log_probs_and_entropy`` (one all-gather over ``tp_group``);
    no CP communication (see ``redistribute`` / ``gather_responses`` for that).

    Raises:
        TypeError: ``logits`` is not a tensor; as ``shifted_targets``,
            ``log_probs_and_entropy`` and ``extract_responses``.
        LayoutError: ``logits`` not 2-D or of a length the layout cannot hold; as the
            three functions above.
    """
    if checks.tensor("logits", logits, "a torch.Tensor [T, V_local]").dim() != 2:
        raise LayoutError(
            f"logits has shape {tuple(logits.shape)}; it must be 2-D [T, V_local] "
            "(flatten the batch first: logits.reshape(-1, logits.shape[-1]))"
        )
    length = resolve_length(layout, int(logits.shape[0]), "logits")
    local = layout.with_local_length(length)
    targets = shifted_targets(tokens, local).to(logits.device)
    log_probs, entropy = log_probs_and_entropy(
        logits,
        targets,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        temperature=temperature,
        tp_group=tp_group,
        chunk_size=chunk_size,
        support=support,
        entropy_over=entropy_over,
    )
    return extract_responses(log_probs, local, entropy)
