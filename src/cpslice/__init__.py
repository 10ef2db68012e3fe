"""cpslice: per-sample response extraction, log-probs and entropy for packed,
context-parallel and tensor-parallel micro-batches, derived from one Layout.

The public API is exactly what this module lists. With ``CPSLICE_DEBUG=1`` set
before import, every function of the package (private ones too) is wrapped by
jaxtyping + beartype, checking dtypes and shapes with dimension names bound
across arguments; unset, no wrapper exists at all.
"""

from ._debug import debug_setting as _debug_setting

if _debug_setting():
    # the hook's loader points every import made while a cpslice module runs at
    # bytecode caches of its own tag: torch's modules imported first, so that they come
    # from their caches, not compiled from source (~1500 modules, seconds per process,
    # each time where PYTHONDONTWRITEBYTECODE keeps the hook's caches from being written)
    import torch._dynamo as _dynamo  # noqa: F401
    import torch.distributed as _distributed  # noqa: F401
    from jaxtyping import install_import_hook as _install_import_hook

    _hook = _install_import_hook("cpslice", "beartype.beartype")
else:
    _hook = None

from ._cache import clear_caches as clear_caches
from ._errors import LayoutError as LayoutError
from ._glue.distill import response_distillation as response_distillation
from ._glue.distill import response_distillation_from_hidden as response_distillation_from_hidden
from ._glue.distill import response_topk_log_probs as response_topk_log_probs
from ._glue.distill import response_topk_log_probs_from_hidden as response_topk_log_probs_from_hidden
from ._glue.distill import response_vocab_distillation as response_vocab_distillation
from ._glue.distill import topk_divergence as topk_divergence
from ._glue.response import response_log_probs as response_log_probs
from ._glue.response import response_log_probs_from_hidden as response_log_probs_from_hidden
from ._glue.support import Support as Support
from ._layout.extract import extract_responses as extract_responses
from ._layout.extract import extraction_strategy as extraction_strategy
from ._layout.extract import shard_responses as shard_responses
from ._layout.layout import Layout as Layout
from ._layout.pack import ResponseRows as ResponseRows
from ._layout.pack import pack as pack
from ._layout.pack import response_rows as response_rows
from ._layout.pack import shifted_targets as shifted_targets
from ._layout.positions import attention_mask as attention_mask
from ._layout.positions import position_ids as position_ids
from ._layout.redistribute import gather_responses as gather_responses
from ._layout.redistribute import redistribute as redistribute
from ._layout.reduce import sample_max as sample_max
from ._layout.reduce import sample_means as sample_means
from ._layout.reduce import sample_min as sample_min
from ._layout.reduce import sum_of_sample_means as sum_of_sample_means
from ._layout.reduce import sum_of_tokens as sum_of_tokens
from ._layout.unshard import unshard as unshard
from ._types import Strategy as Strategy
from ._vocab.divergence import vocab_divergence as vocab_divergence
from ._vocab.hidden import entropy_from_hidden as entropy_from_hidden
from ._vocab.hidden import log_probs_and_entropy_from_hidden as log_probs_and_entropy_from_hidden
from ._vocab.hidden import log_probs_at_from_hidden as log_probs_at_from_hidden
from ._vocab.hidden import topk_log_probs_from_hidden as topk_log_probs_from_hidden
from ._vocab.logits import entropy as entropy
from ._vocab.logits import log_probs_and_entropy as log_probs_and_entropy
from ._vocab.logits import log_probs_at as log_probs_at
from ._vocab.logits import topk_log_probs as topk_log_probs
from ._vocab.which import backend_for as backend_for

if _hook is not None:
    _hook.uninstall()

__all__ = [
    "Layout",
    "LayoutError",
    "ResponseRows",
    "Strategy",
    "Support",
    "attention_mask",
    "backend_for",
    "clear_caches",
    "entropy",
    "entropy_from_hidden",
    "extract_responses",
    "extraction_strategy",
    "gather_responses",
    "log_probs_and_entropy_from_hidden",
    "log_probs_at_from_hidden",
    "topk_log_probs_from_hidden",
    "log_probs_and_entropy",
    "log_probs_at",
    "pack",
    "position_ids",
    "redistribute",
    "response_distillation",
    "response_distillation_from_hidden",
    "response_log_probs",
    "response_log_probs_from_hidden",
    "response_rows",
    "response_topk_log_probs",
    "response_topk_log_probs_from_hidden",
    "response_vocab_distillation",
    "sample_max",
    "sample_means",
    "sample_min",
    "shard_responses",
    "shifted_targets",
    "sum_of_sample_means",
    "sum_of_tokens",
    "topk_divergence",
    "topk_log_probs",
    "unshard",
    "vocab_divergence",
]

def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cpslice")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"


__version__ = _installed_version()
"""The installed distribution's version (pyproject.toml is its one source)."""
