# Before any test module imports cpslice: under the jaxtyping import hook (pytest's
# --jaxtyping-packages), the modules that cpslice's own imports load would otherwise be
# compiled from source (see cpslice/__init__.py): torch and torch.distributed, which
# cpslice imports, and the hook's typechecker. Not torch._dynamo: cpslice no longer
# imports it (cpslice/_cache.py), and it costs 2 s of CPU in every session that never
# compiles; a test that does imports it then, outside any hooked module's import. The
# one hooked module whose imports load it, the megatron-core adapter, is imported only
# after the tests' own `from megatron.core import ...`. Only under the hook: a process
# without it (a spawned `cpslice verify` rank running tests/support/_verify_ranks.py, the
# unchecked rerun of tests/support/checked.py) would spend seconds on them for nothing.
import sys

if any(type(finder).__module__.startswith("jaxtyping") for finder in sys.meta_path):
    import torch.distributed  # noqa: F401
    from beartype import beartype as _beartype  # noqa: F401  (the hook's typechecker)
