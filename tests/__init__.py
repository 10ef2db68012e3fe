# Before any test module imports cpslice: under the jaxtyping import hook (pytest's
# --jaxtyping-packages), the modules that cpslice's own imports load would otherwise be
# compiled from source (see cpslice/__init__.py).
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
from beartype import beartype as _beartype  # noqa: E402, F401  (the hook's typechecker)
