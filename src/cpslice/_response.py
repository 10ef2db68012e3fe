"""One call for a training step: the layout's targets and rows, the vocabulary engine,
the per-sample split. Where the layout side (``_pack``, ``_extract``) meets the
vocabulary functions (``_vocab``)."""

from collections.abc import Sequence
from typing import Literal, overload

import torch
import torch.distributed as dist

from . import _checks as checks
from ._errors import LayoutError
from ._extract import extract_responses
from ._layout import Layout
from ._pack import response_rows, row_temperatures, shifted_targets
from ._plan import resolve_length
from ._support import SupportArg, take_rows
from ._types import AnyShare, ChunkArg, EntropyOverArg, IntArg, RealArg, SampleTemperatureArg, Share, TensorArg
from ._vocab import args
from ._vocab.hidden import linear_log_probs_and_entropy
from ._vocab.logits import log_probs_and_entropy


@overload
def response_log_probs(
    logits: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: Literal[False] = False,
    entropy_grad: bool = True,
    temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None,
    vocab_size: IntArg | None = None,
) -> tuple[list[Share], None]: ...
@overload
def response_log_probs(
    logits: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: Literal[True],
    entropy_grad: bool = True,
    temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None,
    vocab_size: IntArg | None = None,
) -> tuple[list[Share], list[Share]]: ...
@overload
def response_log_probs(
    logits: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None,
    vocab_size: IntArg | None = None,
) -> tuple[list[Share], list[Share] | None]: ...
def response_log_probs(
    logits: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None,
    vocab_size: IntArg | None = None,
) -> tuple[list[Share], list[Share] | None]:
    """Per-sample response log-probs (and entropy) from this rank's logits, end to end.

    ``shifted_targets`` -> ``log_probs_and_entropy`` -> ``extract_responses``, all in
    this rank's layout: ``logits`` is the rank's local ``[T, V_local]`` tensor (its TP
    vocabulary shard), ``tokens`` the whole per-sample token tensors ``[L_i]`` (prompt +
    response, the same on every rank). Returns one ``[r_i]`` float32 share per sample,
    and the entropy shares aligned with them (None unless ``with_entropy``).
    ``support`` (e.g. ``Support.from_responses(ids, offsets, layout)``, over the ``T``
    local rows) and ``entropy_over`` restrict the log-probs (and entropy) to the
    rollout's top-p / top-k sets, and ``softcap`` and ``vocab_size`` match the rollout's
    distribution, as in ``log_probs_and_entropy``. ``temperature`` is one real, or one
    per sample (``n`` reals or an ``[n]`` tensor: rollouts sampled at different
    temperatures), each sample's applied to its rows.

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
        temperature=row_temperatures(temperature, local),
        tp_group=tp_group,
        chunk_size=chunk_size,
        support=support,
        entropy_over=entropy_over,
        softcap=softcap,
        vocab_size=vocab_size,
    )
    return extract_responses(log_probs, local, entropy)


@overload
def response_log_probs_from_hidden(
    hidden: TensorArg,
    weight: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: Literal[False] = False,
    entropy_grad: bool = True,
    temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None,
    vocab_size: IntArg | None = None,
) -> tuple[list[Share], None]: ...
@overload
def response_log_probs_from_hidden(
    hidden: TensorArg,
    weight: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: Literal[True],
    entropy_grad: bool = True,
    temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None,
    vocab_size: IntArg | None = None,
) -> tuple[list[Share], list[Share]]: ...
@overload
def response_log_probs_from_hidden(
    hidden: TensorArg,
    weight: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None,
    vocab_size: IntArg | None = None,
) -> tuple[list[Share], list[Share] | None]: ...
def response_log_probs_from_hidden(
    hidden: TensorArg,
    weight: TensorArg,
    tokens: Sequence[AnyShare],
    layout: Layout,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: SampleTemperatureArg = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None,
    support: SupportArg = None,
    entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None,
    vocab_size: IntArg | None = None,
) -> tuple[list[Share], list[Share] | None]:
    """``response_log_probs`` from the hidden states and the LM-head weight, computing
    only the response rows: ``R x V_local`` work instead of ``T x V_local``.

    ``hidden`` is this rank's ``[T, H]`` final hidden states in its layout (the same on
    every TP rank), ``weight`` its ``[V_local, H]`` LM-head shard, ``tokens`` the whole
    per-sample token tensors ``[L_i]``. The rows ``response_rows`` names are taken from
    ``hidden`` (an ``[R, H]`` copy), their targets from ``shifted_targets``, and
    ``linear_log_probs_and_entropy`` runs on them; the result is split per sample.
    Returns what ``response_log_probs(hidden @ weight.T, tokens, layout, ...)`` returns:
    one ``[r_i]`` float32 share per sample (an empty share is a zero-length view, in the
    graph) and the entropy shares aligned with them (None unless ``with_entropy``).
    ``support`` is over the ``T`` rows of ``hidden``, as ``response_log_probs`` takes it
    (``Support.from_responses``); the response rows' sets are taken from it, and its
    errors name its own rows.

    Collectives: those of ``linear_log_probs_and_entropy`` (one all-gather over
    ``tp_group`` forward, one all-reduce backward); no CP communication.

    Raises:
        TypeError, LayoutError: as ``shifted_targets`` and
            ``linear_log_probs_and_entropy``; ``hidden`` of a length the layout cannot
            hold; a support over another number of rows than ``hidden``'s.
    """
    if checks.tensor("hidden", hidden, "a torch.Tensor [T, H]").dim() != 2:
        raise LayoutError(
            f"hidden has shape {tuple(hidden.shape)}; it must be 2-D [T, H] (flatten the "
            "batch first: hidden.reshape(-1, hidden.shape[-1]))"
        )
    length = resolve_length(layout, int(hidden.shape[0]), "hidden")
    local = layout.with_local_length(length)
    host_rows, counts = response_rows(local)
    rows = host_rows.to(hidden.device)
    targets = shifted_targets(tokens, local).to(hidden.device)
    tau = row_temperatures(temperature, local)
    if support is not None:
        # the whole support against the whole hidden (its errors name the caller's
        # rows), then the response rows' sets
        _, weight_, _ = args.head_and_targets(hidden, weight, targets)
        args.chunk_size(chunk_size)
        vocab = checks.vocab_size(vocab_size, args.tp_world(tp_group) * weight_.shape[0])
        whole = args.sets(support, entropy_over, length, vocab, "hidden")
        assert whole is not None
        support = take_rows(whole, host_rows)
    log_probs, entropy = linear_log_probs_and_entropy(
        hidden[rows],
        weight,
        targets[rows],
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        temperature=tau if isinstance(tau, float) else tau[host_rows.to(tau.device)],
        tp_group=tp_group,
        chunk_size=chunk_size,
        support=support,
        entropy_over=entropy_over,
        softcap=softcap,
        vocab_size=vocab_size,
    )
    shares = list(torch.split(log_probs, counts))
    return shares, None if entropy is None else list(torch.split(entropy, counts))
