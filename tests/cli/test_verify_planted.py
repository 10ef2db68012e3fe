"""``cpslice verify`` catches bugs planted in copies of the package (``planted.PLANTS``:
layout arithmetic, a length read from the layout instead of the tensor, padded widths,
a shared prefix's row whose gradient is not summed over its branches, no-CP bshd rows,
left-padded rows, a misread bshd order): it prints FAIL for the layouts they break, passes
the others, and exits 1. The runs start with the session, in the background
(``background.py``); this file is collected last, so they have run beside the other
tests by then."""

import re

import pytest

from ..support import planted as _planted
from ..support.background import Done
from ..support.planted import rows, verdicts

# The first planted test waits for every planted run: minutes on a loaded 2-core
# machine (they spawn 8 ranks, each importing torch and megatron-core).
PLANTED_TIMEOUT = pytest.mark.timeout(480)


@pytest.fixture(scope="module")
def planted() -> dict[str, Done]:
    return _planted.results()


@PLANTED_TIMEOUT
def test_a_planted_layout_bug_fails(planted: dict[str, Done]) -> None:
    code, out, err = planted["zigzag chunk"]
    assert code == 1, out + err
    assert verdicts(out) == {"zigzag thd": "FAIL"}, out + err
    assert out.splitlines()[-1] == "1 of 1 layout FAIL"


@PLANTED_TIMEOUT
def test_the_extra_padding_row_catches_a_length_read_from_the_layout(
    planted: dict[str, Done],
) -> None:
    # every rank's local tensor has one padding row more than the layout needs: without
    # it the least length and the tensor's are the same, and this bug passes
    code, out, err = planted["redistribute reads the least length"]
    assert code == 1, out + err
    assert verdicts(out) == {"allgather thd": "FAIL"}, out + err
    assert out.splitlines()[-1] == "1 of 1 layout FAIL"


@PLANTED_TIMEOUT
def test_a_planted_padded_width_bug_and_an_unsummed_shared_row_fail(planted: dict[str, Done]) -> None:
    # the default set's padded layouts go through Layout.from_cu_seqlens; the first one
    # fails (the run stops there: a rank raised), the layouts without padding pass; the
    # shared-prefix layout, before them, fails on its gradient alone (its log-probs right)
    code, out, err = planted["from_cu_seqlens widths off by one, a shared row's gradient not summed"]
    assert code == 1, out + err
    assert verdicts(out) == {
        "zigzag thd": "pass", "allgather thd": "pass", "allgather thd align 8": "pass",
        "zigzag thd shared-prefix": "FAIL", "zigzag thd padded": "FAIL",
        "allgather thd padded": "not run", "order random thd": "not run", "order block thd": "not run",
        "order per-document head-tail thd": "not run"}, out + err
    assert "LayoutError" in rows(out)["zigzag thd padded"][-1]
    shared = rows(out)["zigzag thd shared-prefix"]  # ranks, samples, empty, 5 errors, result
    said = re.search(r"pass when each is <= (\S+) ", out)
    assert said is not None, out
    tolerance = float(said.group(1))
    assert float(shared[3]) <= tolerance and float(shared[4]) <= tolerance, shared
    assert float(shared[5]) > tolerance, shared


@PLANTED_TIMEOUT
def test_planted_bshd_row_bugs_fail(planted: dict[str, Done]) -> None:
    # in a CP world the default set still runs none bshd, its rows of odd length; its
    # left-padded rows catch offsets that pack and extraction both ignore; and its bshd
    # order, read by the oracle from the order itself, a misread order
    code, out, err = planted["bshd rows: no-CP rounded to even, row offsets ignored, an order's columns strided"]
    assert code == 1, out + err
    assert verdicts(out) == {"zigzag bshd": "pass", "zigzag bshd left-padded": "FAIL",
                              "order random bshd": "FAIL", "none bshd": "FAIL"}, out + err
