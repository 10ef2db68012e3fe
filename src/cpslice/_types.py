"""Shape aliases and the checked-at-run-time argument types, in one place.

mypy sees every jaxtyping alias as plain ``torch.Tensor``; in debug mode
(``CPSLICE_DEBUG=1``) beartype checks dtype and shape, with dimension names
bound across the arguments and the result of one call.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, SupportsFloat, SupportsIndex

from jaxtyping import Float, Int64, Shaped
from torch import Tensor

# Per-position tensors of one rank: dimension 0 is the local length ``t``.
Values = Float[Tensor, "t *rest"]
AnyValues = Shaped[Tensor, "t *rest"]
# One sample's share, or one sample's whole response.
Share = Float[Tensor, "_r *rest"]
AnyShare = Shaped[Tensor, "_r *rest"]
# The reducers' arguments: a 1-D share of values and a whole 1-D mask are of different
# lengths, and neither binds a dimension name to the other.
Share1D = Float[Tensor, " _r"]
Mask = Shaped[Tensor, " _R"]
Rows = Int64[Tensor, " m"]
Logits = Float[Tensor, "t v"]
PerRow = Float[Tensor, " t"]
Targets = Int64[Tensor, " t"]
# The LM head's input (final hidden states) and this TP rank's shard of its weight.
Hidden = Float[Tensor, "t h"]
HeadWeight = Float[Tensor, "v h"]

QkvFormat = Literal["thd", "bshd"]
CpMode = Literal["none", "zigzag", "allgather"]
Strategy = Literal["none-thd", "none-bshd", "zigzag", "allgather"]

if TYPE_CHECKING:
    Lengths = Sequence[SupportsIndex]
    IntArg = SupportsIndex
    RealArg = SupportsFloat
    # ``cu_seqlens_padded``: a list of ints or an integer tensor, on any device.
    Boundaries = Sequence[SupportsIndex] | Tensor
    FormatArg = QkvFormat
    ModeArg = CpMode
else:
    # At run time these arguments are checked by Layout's own validation, whose
    # LayoutError names the sample, the value and the rule; a beartype error
    # raised first would say less.
    Lengths = object
    IntArg = object
    RealArg = object
    Boundaries = object
    FormatArg = object
    ModeArg = object
