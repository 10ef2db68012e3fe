"""The verifier's layout oracle (``cpslice._verify.oracle``) against the suite's
(``tests/oracle.py``): two transcriptions of docs/layouts.md written apart, which
must place every position of every sample at the same local row of every rank.

Over hypothesis layouts (``tests/strategies.configs``: every mode, thd and bshd,
align and explicit padded widths with a stretched last sample, left-padded bshd rows,
empty responses, ranks holding nothing, extra padding rows): the least local length, each row's place, each
rank's response shares and gradient rows agree.
"""

import torch
from hypothesis import given, settings

from cpslice._verify import oracle as verifier

from . import oracle as suite
from .strategies import configs


def _view(cfg: suite.Config, rank: int) -> verifier.RankView:
    return verifier.RankView(cfg.total, cfg.response, cfg.mode, cfg.fmt, cfg.seq, rank,
                             cfg.cp, suite.local_length(cfg), cfg.align, cfg.padded,
                             cfg.row_offsets)


@settings(max_examples=100, deadline=None)
@given(configs(max_cp=4))
def test_the_two_oracles_agree(cfg: suite.Config) -> None:
    least = verifier.least_length(cfg.total, cfg.mode, cfg.fmt, cfg.seq, cfg.cp, cfg.align,
                                  cfg.padded)
    assert least == suite.least_length(cfg)
    whole = [torch.arange(r, dtype=torch.float64) + 100 * i for i, r in enumerate(cfg.response)]
    per_row = [torch.arange(t, dtype=torch.float64) + 100 * i for i, t in enumerate(cfg.total)]
    for rank in range(cfg.cp):
        view = _view(cfg, rank)
        assert verifier.places(view) == suite.local_map(cfg, rank)
        assert [s.tolist() for s in verifier.shares(whole, view)] == [
            s.tolist() for s in suite.shares(whole, cfg, rank)]
        if cfg.total:
            assert torch.equal(verifier.rows(per_row, view), suite.rows(per_row, cfg, rank))
