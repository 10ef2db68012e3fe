"""Shape aliases, the public functions' argument types and the compute dtype, in one place.

mypy sees every jaxtyping alias as plain ``torch.Tensor``; in debug mode
(``CPSLICE_DEBUG=1``) beartype checks dtype and shape, with dimension names
bound across the arguments and the result of one call.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, Literal, SupportsFloat, SupportsIndex, TypedDict, TypeVar

import torch
import torch.distributed as dist
from jaxtyping import Float, Int64, Shaped
from torch import Tensor

# Per-position tensors of one rank: dimension 0 is the local length ``t``.
Values = Float[Tensor, "t *rest"]
AnyValues = Shaped[Tensor, "t *rest"]
# Every CP rank's local tensor concatenated in rank order (``cp_size * t`` rows), and
# the packed stream without CP that ``unshard`` puts them back into (``n`` rows).
Gathered = Shaped[Tensor, "ct *rest"]
Stream = Shaped[Tensor, "n *rest"]
# One sample's share, or one sample's whole response.
Share = Float[Tensor, "_r *rest"]
AnyShare = Shaped[Tensor, "_r *rest"]
# The reducers' arguments: a 1-D share of values and a whole 1-D mask are of different
# lengths, and neither binds a dimension name to the other.
Share1D = Float[Tensor, " _r"]
Mask = Shaped[Tensor, " _R"]
# A teacher's per-token top-k of one sample: [R_i, k] log-probs or ids.
TopK = Shaped[Tensor, "_r _k"]
Rows = Int64[Tensor, " m"]
Logits = Float[Tensor, "t v"]
PerRow = Float[Tensor, " t"]
# One value per row of [..., V] logits: their leading shape ([T] for [T, V] logits).
PerPosition = Float[Tensor, "*t"]
Targets = Int64[Tensor, " t"]
# The LM head's input (final hidden states) and this TP rank's shard of its weight.
Hidden = Float[Tensor, "t h"]
HeadWeight = Float[Tensor, "v h"]

QkvFormat = Literal["thd", "bshd"]
CpMode = Literal["none", "zigzag", "allgather"]
"""The modes a ``Layout`` is built with: its closed forms."""
LayoutMode = Literal["none", "zigzag", "allgather", "order"]
"""A layout's ``cp_mode``: a closed form's, or ``"order"`` (``Layout.from_order``)."""
Strategy = Literal["none-thd", "none-bshd", "zigzag", "allgather", "order"]
EntropyOver = Literal["full", "support"]
Divergence = Literal["forward", "reverse", "jsd"]
Tail = Literal["bin", "renormalize"]

# The public functions' arguments, for the type checker: what a caller may pass. At run
# time (debug mode's beartype) each is ``object``: the function's own validation
# (``_checks``) refuses a wrong one with a TypeError or LayoutError that names the
# argument, the sample and the rule, where a beartype error raised first would say less.
# So every entry point accepts the same integers (int, numpy integers, anything with
# ``__index__``) and reals (``numbers.Real``) with and without CPSLICE_DEBUG=1. The one
# alias that names a cpslice class, ``support``'s, lives beside that class
# (``_vocab.token_sets.SupportArg``, ``_glue.support.SupportArg``): this module stays below every
# other in the import graph.
if TYPE_CHECKING:
    TensorArg = Tensor
    IntArg = SupportsIndex
    RealArg = SupportsFloat
    # a temperature: one for all rows, or a [T] float tensor of one per row (the
    # row-level functions), or one per sample: n reals or an [n] tensor (the per-sample)
    TemperatureArg = SupportsFloat | Tensor
    SampleTemperatureArg = SupportsFloat | Sequence[SupportsFloat] | Tensor
    ChunkArg = SupportsIndex | None
    Lengths = Sequence[SupportsIndex]
    # ``cu_seqlens_padded``: a list of ints or an integer tensor, on any device.
    Boundaries = Sequence[SupportsIndex] | Tensor
    FormatArg = QkvFormat
    ModeArg = CpMode
    EntropyOverArg = EntropyOver
    DivergenceArg = Divergence
    TailArg = Tail
    # ``Support.from_responses``: per sample, a 1-D integer tensor or a list of ints.
    IdsArg = Sequence[Tensor] | Sequence[Sequence[SupportsIndex]]
    # The reducers': per-sample shares and whole masks, and the denominators.
    Shares = Sequence[Share]
    Masks = Sequence[AnyShare]
    Denominators = Tensor | Sequence[SupportsFloat] | None
else:
    TensorArg = IntArg = RealArg = TemperatureArg = SampleTemperatureArg = ChunkArg = Lengths = Boundaries = object
    FormatArg = ModeArg = EntropyOverArg = DivergenceArg = TailArg = IdsArg = object
    Shares = Masks = Denominators = object


TemperatureT = TypeVar("TemperatureT")
SupportT = TypeVar("SupportT")


class LogProbKeywords(TypedDict, Generic[TemperatureT, SupportT], total=False):
    """The keywords that the log-prob functions with an entropy share beside
    ``with_entropy`` (``log_probs_and_entropy``, ``log_probs_and_entropy_from_hidden`` and
    their per-sample forms), for their overload stubs: ``**kwargs: Unpack[...]``, the
    implementation naming each keyword with its default (so that ``inspect.signature``
    shows them). Generic in the two that differ: the temperature (one per row, or one
    per sample) and the support's class (which this module, below every other, cannot
    name). Use it through an alias that binds both for the type checker and is this
    class itself at run time (beartype reads no subscripted ``TypedDict``):
    ``_vocab.args.Keywords``."""

    entropy_grad: bool
    temperature: TemperatureT
    tp_group: dist.ProcessGroup | None
    chunk_size: ChunkArg
    support: SupportT | None
    entropy_over: EntropyOverArg
    softcap: RealArg | None
    vocab_size: IntArg | None
    invariant: bool


class SampleKeywords(LogProbKeywords[TemperatureT, SupportT], total=False):
    """``LogProbKeywords`` and the per-sample functions' own: ``depth``, the target depth
    (``response_log_probs`` and its hidden-state twin)."""

    depth: IntArg


class HiddenKeywords(LogProbKeywords[TemperatureT, SupportT], total=False):
    """``LogProbKeywords`` and the hidden-state path's own: ``sequence_parallel``
    (``log_probs_and_entropy_from_hidden``)."""

    sequence_parallel: bool


class HiddenSampleKeywords(SampleKeywords[TemperatureT, SupportT], total=False):
    """``SampleKeywords`` and the hidden-state path's own: ``sequence_parallel``
    (``response_log_probs_from_hidden``)."""

    sequence_parallel: bool


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype cpslice computes and accumulates in for inputs of ``dtype``: float64 for
    float64, float32 for every other dtype (bfloat16 and float16 sums would stall)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
