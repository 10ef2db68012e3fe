"""The two single-process drivers the log-prob tests run on, so that one test states a
property once for both: the logits path (``log_probs_and_entropy``, given logits
``[T, V]``) and the hidden-state path (``log_probs_and_entropy_from_hidden``, which forms
``logits = hidden @ weight.T`` itself, chunk by chunk, and never whole).

A test gives a driver ``x`` and an optional head ``weight``:

- ``weight`` None: ``x`` is logits, to either path. The hidden path takes them through
  the identity head (``hidden = x``, ``weight = I_V``): ``x @ I.T`` is ``x`` exactly
  (every product but one is a zero), so on both paths x's gradient is the logits'
  gradient, and on the hidden path the identity's gradient is ``dlogits.T @ x``.
- ``weight`` ``[V, H]``: ``x`` is the hidden states ``[T, H]``, to the hidden path only
  (the logits path on ``x @ weight.T`` would test torch's matmul, not cpslice).

``reference.head_reference`` is the float64 reference of both forms."""

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from cpslice import log_probs_and_entropy, log_probs_and_entropy_from_hidden


@dataclass(frozen=True)
class Driver:
    """``driver(x, targets, weight, **kwargs)``: ``(log_probs, entropy or None)``."""

    name: str  # "logits" or "hidden": the test id, and what refusals call the first input

    def __str__(self) -> str:
        return self.name

    def head(self, x: Tensor, weight: Tensor | None) -> Tensor | None:
        """The weight this driver multiplies ``x`` by: ``weight``; for the hidden path given
        logits the identity (in x's dtype, without grad: set it to read its gradient);
        None for the logits path given logits."""
        if weight is None and self.name == "hidden":
            return torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        return weight

    def __call__(
        self, x: Tensor, targets: Tensor, weight: Tensor | None = None, **kwargs: Any
    ) -> tuple[Tensor, Tensor | None]:
        w = self.head(x, weight)
        if self.name == "logits":
            assert w is None, "the logits path takes logits"
            logp, entropy = log_probs_and_entropy(x, targets, **kwargs)
        else:
            assert w is not None
            logp, entropy = log_probs_and_entropy_from_hidden(x, w, targets, **kwargs)
        return logp, entropy

    def both(
        self, x: Tensor, targets: Tensor, weight: Tensor | None = None, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """The call with ``with_entropy=True``: both outputs, the entropy never None."""
        logp, entropy = self(x, targets, weight, with_entropy=True, **kwargs)
        assert entropy is not None
        return logp, entropy


LOGITS = Driver("logits")
HIDDEN = Driver("hidden")
DRIVERS = (LOGITS, HIDDEN)

BOTH = pytest.mark.parametrize("driver", DRIVERS, ids=str)
"""Runs a test taking ``driver: Driver`` once on each path."""
OWN = pytest.mark.parametrize(("driver", "form"), [(LOGITS, "logits"), (HIDDEN, "head")], ids=str)
"""Runs a test taking ``driver`` and ``form`` on each path given its own input: logits
(``form`` "logits") to the logits path, a head ("head") to the hidden path."""
CROSSED = pytest.mark.parametrize(
    ("driver", "form"), [(LOGITS, "logits"), (HIDDEN, "head"), (HIDDEN, "logits")], ids=str
)
"""``OWN``, and the hidden path given logits (through the identity head)."""
