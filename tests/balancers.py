"""torch's context-parallel load balancers, for tests/test_balancers.py: where torch keeps
them (a private module: ``load_balancers`` fails, naming it, when torch moves it)."""

import importlib
from types import ModuleType

import torch

MODULE = "torch.distributed.tensor.experimental._context_parallel._load_balancer"
CLASSES = ("_HeadTailLoadBalancer", "_PerDocumentHeadTailLoadBalancer", "_PTRRLoadBalancer")


def load_balancers() -> ModuleType:
    """torch's private load-balancer module, or an AssertionError that says it moved."""
    where = f"torch {torch.__version__}"
    try:
        module = importlib.import_module(MODULE)
    except ImportError as err:
        raise AssertionError(
            f"{where} has no module {MODULE} ({err}): the private module of the context-parallel load "
            f"balancers moved; find {', '.join(CLASSES)} and update tests/balancers.py and docs/recipes.md"
        ) from None
    missing = [name for name in CLASSES if not isinstance(getattr(module, name, None), type)]
    if missing:
        raise AssertionError(f"{where}'s {MODULE} has no {', '.join(missing)}: the private load balancers "
                             "moved or were renamed; update tests/balancers.py and docs/recipes.md")
    return module
