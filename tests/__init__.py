# Before any test module imports cpslice: under the jaxtyping import hook (pytest's
# --jaxtyping-packages), the modules that cpslice's own imports load would otherwise be
# compiled from source (see cpslice/__init__.py). Only there: a process without the hook
# (a spawned `cpslice verify` rank running tests/support/_verify_ranks.py, the unchecked
# rerun of tests/support/checked.py) would spend seconds on torch._dynamo for nothing.
import sys

if any(type(finder).__module__.startswith("jaxtyping") for finder in sys.meta_path):
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    from beartype import beartype as _beartype  # noqa: F401  (the hook's typechecker)
