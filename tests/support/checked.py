"""Error tests that hold with run-time checking on and off.

The suite runs checked (jaxtyping's pytest plugin wraps cpslice with beartype), so a
mistyped argument may be refused by the checker before cpslice's own check runs. In
that session ``refused`` accepts the checker's ``TypeCheckError`` (a ``TypeError``) in
place of cpslice's error; ``test_errors.py::test_error_tests_pass_unchecked`` runs the
same tests again in a fresh interpreter with checking off, where only cpslice's own
exception type and message pass. A deleted check therefore fails there.
"""

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from jaxtyping import TypeCheckError

import cpslice

from . import background
from .background import Job

CHECKED = hasattr(cpslice.extract_responses, "__wrapped__")

UNCHECKED = (
    "tests/layout/test_errors.py", "tests/vocabulary/test_logprob.py::test_refusals",
    "tests/layout/test_pack.py::test_input_errors", "tests/layout/test_reduce.py::test_reducer_errors",
    "tests/layout/test_reduce.py::test_error_reducer_arguments",
    "tests/layout/test_reduce.py::test_a_2d_share_is_refused_as_values",
    "tests/layout/test_reduce.py::test_shares_of_one_call_have_one_trailing_shape",
    "tests/vocabulary/test_logprob.py::test_response_from_hidden_refuses_and_keeps_the_entropy_none",
    "tests/vocabulary/test_support.py::test_support_refusals_on_the_hidden_path",
    "tests/glue/test_arguments.py", "tests/vocabulary/test_distill.py::test_refusals",
    "tests/vocabulary/test_distill.py::test_response_refusals_name_the_sample",
    "tests/vocabulary/test_transforms.py::test_refusals",
    "tests/layout/test_padded.py::test_refusals",
    "tests/vocabulary/test_support.py::test_support_refusals",
    "tests/vocabulary/test_support.py::test_log_prob_refusals",
    "tests/vocabulary/test_leading.py::test_refusals",
    "tests/vocabulary/test_support.py::test_from_responses_refusals",
    "tests/vocabulary/test_transforms.py::test_refusals_of_the_per_sample_and_top_k_forms",
    "tests/layout/test_row_offsets.py::test_refusals",
    "tests/glue/test_debug.py::test_unset_means_no_wrapper_and_plain_errors",
    "tests/layout/test_depth.py::test_refusals", "tests/layout/test_unshard.py::test_refusals",
    "tests/glue/test_shared_prefix.py::test_refusals",
    "tests/glue/test_shared_prefix.py::test_layout_refusals_name_the_group_and_the_rule",
)
"""The tests the unchecked run repeats: every refusal, and the argument kinds every
entry point accepts (test_arguments), which must be the same with checking on and off."""


def _unchecked_run() -> dict[str, Job]:
    if not CHECKED:  # this is the unchecked run: it starts no other
        return {}
    env = {k: v for k, v in os.environ.items() if k != "CPSLICE_DEBUG"}
    argv = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            *UNCHECKED)
    return {"unchecked": Job(argv, env, Path(__file__).resolve().parents[2])}


background.register("unchecked", "tests/layout/test_errors.py::test_error_tests_pass_unchecked",
                    _unchecked_run)


@contextmanager
def refused(error: type[Exception], match: str) -> Iterator[None]:
    """Expect cpslice's ``error`` whose message matches ``match`` (a regex); in a checked
    session the checker's ``TypeCheckError`` is also accepted."""
    allowed: tuple[type[Exception], ...] = (error, TypeCheckError) if CHECKED else (error,)
    with pytest.raises(allowed) as info:
        yield
    if CHECKED and isinstance(info.value, TypeCheckError):
        return
    assert not isinstance(info.value, TypeCheckError), info.value
    assert isinstance(info.value, error), info.value
    assert re.search(match, str(info.value)), f"{match!r} not in {str(info.value)!r}"
