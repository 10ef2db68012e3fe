"""One call for a training step: the layout's targets and rows, the vocabulary engine,
the per-sample split. Where the layout side (``_layout.pack``, ``_layout.extract``) meets the
vocabulary functions (``_vocab``)."""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Unpack, overload

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks as checks
from .._errors import LayoutError
from .._layout.extract import gather_split as split_rows
from .._layout.extract import picked_ids, picked_values, split_elements
from .._layout.layout import Layout
from .._layout.pack import checked_tokens, temperatures_of
from .._layout.plan import Local, Read, Span, needed_length, resolve
from .._types import AnyShare, ChunkArg, EntropyOverArg, IntArg, RealArg, SampleTemperatureArg, Share, TensorArg
from .._vocab import args, dtensor
from .._vocab.call import Options
from .._vocab.head import Head, log_probs, options
from .._vocab.hidden import HiddenHead, hidden_head
from .._vocab.logits import LogitsHead
from .support import SupportArg, take_rows

if TYPE_CHECKING:
    from .._types import HiddenSampleKeywords, SampleKeywords
    from .support import Support

    Keywords = SampleKeywords[SampleTemperatureArg, Support]
    """The per-sample functions' keywords beside ``with_entropy``: one temperature per
    sample (or one for all), a ``cpslice.Support``, the target depth."""
    HiddenKeywords = HiddenSampleKeywords[SampleTemperatureArg, Support]
    """``Keywords`` and ``sequence_parallel``: ``response_log_probs_from_hidden``'s."""
else:  # beartype reads no subscripted TypedDict (see _types.LogProbKeywords)
    from .._types import HiddenSampleKeywords as HiddenKeywords
    from .._types import SampleKeywords as Keywords


@overload
def response_log_probs(
    logits: TensorArg, tokens: Sequence[AnyShare], layout: Layout,
    *, with_entropy: Literal[False] = False, **kwargs: Unpack[Keywords],
) -> tuple[list[Share], None]: ...
@overload
def response_log_probs(
    logits: TensorArg, tokens: Sequence[AnyShare], layout: Layout,
    *, with_entropy: Literal[True], **kwargs: Unpack[Keywords],
) -> tuple[list[Share], list[Share]]: ...
@overload
def response_log_probs(
    logits: TensorArg, tokens: Sequence[AnyShare], layout: Layout,
    *, with_entropy: bool = False, **kwargs: Unpack[Keywords],
) -> tuple[list[Share], list[Share] | None]: ...
def response_log_probs(
    logits: TensorArg, tokens: Sequence[AnyShare], layout: Layout, *, with_entropy: bool = False,
    entropy_grad: bool = True, temperature: SampleTemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None, support: SupportArg = None, entropy_over: EntropyOverArg = "full",
    softcap: RealArg | None = None, vocab_size: IntArg | None = None, depth: IntArg = 0, invariant: bool = False,
) -> tuple[list[Share], list[Share] | None]:
    """Per-sample response log-probs (and entropy) from this rank's logits, end to end.

    ``shifted_targets`` -> ``log_probs_and_entropy`` -> ``extract_responses``, all in
    this rank's layout: ``logits`` is the rank's local ``[T, V_local]`` tensor (its TP
    vocabulary shard) or a DTensor sharded ``Shard(-1)`` on the TP mesh dimension (as
    ``log_probs_and_entropy`` takes it: its local shard, its mesh's TP group), ``tokens``
    the whole per-sample token tensors ``[L_i]`` (prompt + response, the same on every
    rank; a replicated DTensor reads as its local tensor, as does a temperature's).
    Returns one ``[r_i]`` float32 share per sample,
    and the entropy shares aligned with them (None unless ``with_entropy``).
    ``support`` (e.g. ``Support.from_responses(ids, offsets, layout)``, over the ``T``
    local rows) and ``entropy_over`` restrict the log-probs (and entropy) to the
    rollout's top-p / top-k sets, and ``softcap`` and ``vocab_size`` match the rollout's
    distribution, as in ``log_probs_and_entropy``; ``invariant=True`` gives each response
    token the same bits whatever the layout, CP rank, batch, chunking or TP size that
    computes it (``log_probs_and_entropy``'s ``invariant``, docs/invariance.md). ``temperature`` is one real, or one
    per sample (``n`` reals or an ``[n]`` tensor: rollouts sampled at different
    temperatures), each sample's applied to its rows. ``depth`` ``d`` (an MTP head's
    logits): position ``p`` predicts token ``p + 1 + d``, the shares as
    ``extract_responses(..., depth=d)``'s. With a shared prefix, a prompt row that
    predicts the first response token of several branches is computed once and each
    branch's target picked from it (its gradient the sum over them); the samples of a
    group must then share their temperature.

    Collectives: those of ``log_probs_and_entropy`` (one all-gather over ``tp_group``);
    no CP communication (see ``redistribute`` / ``gather_responses`` for that).

    Raises:
        TypeError: ``logits`` is not a tensor; as ``shifted_targets``,
            ``log_probs_and_entropy`` and ``extract_responses``.
        LayoutError: ``logits`` not 2-D or of another length than the layout's; as the
            three functions above; a shared-prefix group whose samples' temperatures
            differ, or whose prompts' tokens differ.
    """
    x, tp = args.logits(_two_d("logits", logits, "[T, V_local]", "logits.reshape(-1, logits.shape[-1])"), tp_group)
    return _response_log_probs(LogitsHead(x), tokens, layout, temperature, depth,
        with_entropy=with_entropy, entropy_grad=entropy_grad, tp_group=tp, chunk_size=chunk_size, support=support,
        entropy_over=entropy_over, softcap=softcap, vocab_size=vocab_size, invariant=invariant)


def _response_log_probs(
    head: Head, tokens: object, layout: Layout, per_sample: object, depth: object, *, with_entropy: bool,
    **keywords: Unpack[args.Keywords],
) -> tuple[list[Share], list[Share] | None]:
    """``response_log_probs`` over any head: every argument checked (the tensors before,
    by the caller; ``per_sample`` the temperature as given, one or one per sample), then
    the response rows computed (``on_responses``) and split per sample."""
    local, targets, tau = _inputs(head, tokens, layout, per_sample, depth, keywords.get("tp_group"))
    read = local.reads["response"]
    # every argument against the whole head (a support's errors name the caller's rows)
    ids = picked_ids(read, targets, local.length)
    given: args.Keywords = {**keywords, "temperature": tau}
    whole = options(head, ids, with_entropy=with_entropy, **given)
    part, on_rows = on_responses(head, read, whole)
    return _computed(part, read, targets, ids if head.in_place else picked_ids(read, targets), on_rows)


def on_responses(head: Head, read: Read, options: Options) -> tuple[Head, Options]:
    """The head and ``options`` (over every row of ``head``) with which a per-sample call
    computes the response rows of ``read``: ``head`` itself, its rows a mask in the
    options, where it computes them in place (``Head.in_place``: only the response rows
    get the softmax's statistics, the others' gradient is zero, no copy selects them);
    else the distinct response rows alone (``Head.take``, a shared prefix's prompt row
    once), their temperatures and sets."""
    if head.in_place:
        return head, options._replace(rows=read.mask)
    rows = read.picks.rows
    return head.take(rows), options._replace(
        tau=options.tau if isinstance(options.tau, float) else options.tau[rows],
        support=None if options.support is None else take_rows(options.support, read.picks.host_rows),
    )


def _computed(
    head: Head, read: Read, targets: Tensor, ids: Tensor, options: Options
) -> tuple[list[Share], list[Share] | None]:
    """``head`` (from ``on_responses``: the local rows computed in place, or the distinct
    response rows) at the picks ``ids``, each element's result per sample.

    A support's sets take one target per row (the restricted distribution is its set plus
    that target), so where a shared prefix puts several branches' targets on one row, the
    branches after the first go through a second call on their rows alone (a few rows per
    group: with a set, no full-vocabulary pass unless the entropy is over it)."""
    local = head.in_place
    if options.support is None or read.picks.k == 1:
        values, entropy = log_probs(head, ids, options)
        return _shares(read, values, entropy, local)
    p = read.picks
    values, entropy = log_probs(head, ids[:, 0], options)  # each row's first pick
    extra, host_extra = (p.slot > 0).nonzero()[:, 0], (p.host_slot > 0).nonzero()[:, 0]
    at = read.rows if local else p.element
    rows = (read.selection.rows if local else p.host_element)[host_extra]
    device_rows = at.index_select(0, extra)
    sub = options._replace(
        tau=options.tau if isinstance(options.tau, float) else options.tau[device_rows],
        support=take_rows(options.support, rows), rows=None,
    )
    more, more_entropy = log_probs(head.take(device_rows), targets.index_select(0, extra), sub)
    each = values.index_select(0, at).index_put((extra,), more)
    if entropy is None or more_entropy is None:
        return split_elements(read, each), None
    h = entropy.index_select(0, at).index_put((extra,), more_entropy)
    return split_elements(read, each), split_elements(read, h)


def _shares(
    read: Read, log_probs: Tensor, entropy: Tensor | None, local: bool
) -> tuple[list[Share], list[Share] | None]:
    """The engine's results over the local (or distinct) rows, per element, per sample."""
    if local and read.picks.k == 1:  # one gather and one split per tensor, empty views of the inputs
        return split_rows(log_probs, read.rows, read.selection.counts), (
            None if entropy is None else split_rows(entropy, read.rows, read.selection.counts)
        )
    at = read.rows if local else read.picks.element
    return split_elements(read, picked_values(read, log_probs, local=local)), (
        None if entropy is None else split_elements(read, entropy.index_select(0, at))
    )


def _two_d(name: str, value: object, shape: str, flatten: str) -> Tensor:
    x = checks.tensor(name, value, f"a torch.Tensor {shape}")
    if x.dim() != 2:
        raise LayoutError(
            f"{name} has shape {tuple(x.shape)}; it must be 2-D {shape} (flatten the batch "
            f"first: {flatten})"
        )
    return x


def resolved(
    head: Head, layout: Layout, spans: tuple[Span, ...], tp_group: dist.ProcessGroup | None, depth: int = 0
) -> Local:
    """The call's one resolution of ``layout`` for ``head``'s rows (``resolve``, at
    ``depth``); where a hidden head's rows, times the TP size, are the length the layout
    needs, its length error names sequence parallelism (``args.sequence_hint``)."""
    rows = int(head.x.shape[0])

    def hint() -> str:
        if type(head) is not HiddenHead:  # logits, or hidden with sequence_parallel already
            return ""
        need = needed_length(layout) if layout.local_length is None else layout.local_length
        return args.sequence_hint(rows, need, tp_group, "the layout")

    with args.hinted(hint):
        return resolve(layout, rows, head.what, spans, head.x.device, depth=depth)


def _inputs(
    head: Head, tokens: object, layout: Layout, temperature: object, depth: object,
    tp_group: dist.ProcessGroup | None,
) -> tuple[Local, Tensor, float | Tensor]:
    """The call's one resolution of ``layout`` (``T`` from ``head``, at ``depth``:
    ``resolved``), each response element's target token (``[E]``) and the per-row
    temperature, on ``head``'s device (replicated DTensors read as their local tensors:
    ``dtensor.replicated``)."""
    x = head.x
    d = checks.depth(depth)
    items = checked_tokens(dtensor.replicated_each("tokens", tokens), layout)
    tau = checks.sample_temperatures(dtensor.replicated("temperature", temperature), layout.num_samples,
                                    layout.shared_prefix)
    spans: tuple[Span, ...] = ("response", "sample") if isinstance(tau, Tensor) else ("response",)
    local = resolved(head, layout, spans, tp_group, d)
    read = local.reads["response"]
    flat = torch.cat(items).to(x.device) if items else torch.zeros(0, dtype=torch.int64, device=x.device)
    return local, flat.index_select(0, read.targets).to(torch.int64), temperatures_of(tau, local)


@overload
def response_log_probs_from_hidden(
    hidden: TensorArg, weight: TensorArg, tokens: Sequence[AnyShare], layout: Layout,
    *, with_entropy: Literal[False] = False, **kwargs: Unpack[HiddenKeywords],
) -> tuple[list[Share], None]: ...
@overload
def response_log_probs_from_hidden(
    hidden: TensorArg, weight: TensorArg, tokens: Sequence[AnyShare], layout: Layout,
    *, with_entropy: Literal[True], **kwargs: Unpack[HiddenKeywords],
) -> tuple[list[Share], list[Share]]: ...
@overload
def response_log_probs_from_hidden(
    hidden: TensorArg, weight: TensorArg, tokens: Sequence[AnyShare], layout: Layout,
    *, with_entropy: bool = False, **kwargs: Unpack[HiddenKeywords],
) -> tuple[list[Share], list[Share] | None]: ...
def response_log_probs_from_hidden(
    hidden: TensorArg, weight: TensorArg, tokens: Sequence[AnyShare], layout: Layout, *, with_entropy: bool = False,
    entropy_grad: bool = True, temperature: SampleTemperatureArg = 1.0, tp_group: dist.ProcessGroup | None = None,
    chunk_size: ChunkArg = None, support: SupportArg = None, entropy_over: EntropyOverArg = "full", softcap: RealArg
    | None = None, vocab_size: IntArg | None = None, depth: IntArg = 0, invariant: bool = False,
    sequence_parallel: bool = False,
) -> tuple[list[Share], list[Share] | None]:
    """``response_log_probs`` from the hidden states and the LM-head weight, computing
    only the response rows: ``R x V_local`` work instead of ``T x V_local``.

    ``hidden`` is this rank's ``[T, H]`` final hidden states in its layout (the same on
    every TP rank), ``weight`` its ``[V_local, H]`` LM-head shard (or a DTensor sharded
    ``Shard(0)`` on the TP mesh dimension, as ``log_probs_and_entropy_from_hidden``
    takes it, with ``hidden`` plain or replicated), ``tokens`` the whole
    per-sample token tensors ``[L_i]``. With ``sequence_parallel`` (Megatron's
    ``--sequence-parallel``), ``hidden`` is this TP rank's contiguous ``[T / tp, H]``
    shard of those rows, gathered once, in the graph, its gradient the shard's (as
    ``log_probs_and_entropy_from_hidden`` takes it): ``T`` is what the layout holds, the
    results the same on every TP rank. The rows ``response_rows`` names are taken from
    ``hidden`` (an ``[R, H]`` copy), their targets from ``shifted_targets``, and
    ``log_probs_and_entropy_from_hidden`` runs on them; the result is split per sample.
    Returns what ``response_log_probs(hidden @ weight.T, tokens, layout, ...)`` returns:
    one ``[r_i]`` float32 share per sample (an empty share is a zero-length view, in the
    graph) and the entropy shares aligned with them (None unless ``with_entropy``).
    ``support`` is over the ``T`` rows of ``hidden``, as ``response_log_probs`` takes it
    (``Support.from_responses``); the response rows' sets are taken from it, and its
    errors name its own rows. ``depth``, a shared prefix and ``invariant`` as
    ``response_log_probs`` (a shared row's hidden state goes through the head once).

    Collectives: those of ``log_probs_and_entropy_from_hidden`` (one all-gather over
    ``tp_group`` forward, one all-reduce backward; with ``sequence_parallel`` one
    all-gather of ``[T / tp, H]`` more forward, one reduce-scatter of ``[T, H]`` backward
    instead of the all-reduce); no CP communication.

    Raises:
        TypeError, LayoutError: as ``shifted_targets`` and
            ``log_probs_and_entropy_from_hidden``; ``hidden`` of another length than the
            layout's (``extract_responses``; with ``sequence_parallel``, its rows times the TP
            size; without it, the message names sequence parallelism where those would fit);
            a support over another number of rows than ``hidden``'s. Raised before any
            collective.
    """
    h, w, tp = args.head(_two_d("hidden", hidden, "[T, H]", "hidden.reshape(-1, hidden.shape[-1])"), weight, tp_group)
    x = hidden_head(h, w, args.sequence(sequence_parallel, tp))
    return _response_log_probs(x, tokens, layout, temperature, depth,
        with_entropy=with_entropy, entropy_grad=entropy_grad, tp_group=tp, chunk_size=chunk_size, support=support,
        entropy_over=entropy_over, softcap=softcap, vocab_size=vocab_size, invariant=invariant)
