"""run_ranks(): results by rank, a rank's exception, a hard timeout."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from ca_testkit import RankError, run_ranks

pytestmark = pytest.mark.distributed

_RANKS = pathlib.Path(__file__).parent / "ranks"


@pytest.fixture
def rank_fns(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(_RANKS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(_RANKS), os.environ.get("PYTHONPATH", "")]))
    import rank_fns

    yield rank_fns
    sys.modules.pop("rank_fns", None)


def test_results_come_back_by_rank(rank_fns) -> None:
    assert run_ranks(rank_fns.all_reduce_rank, 3, world_size=2, timeout=120) == [3.0, 3.0]


def test_a_rank_that_raises_is_reported_with_its_traceback(rank_fns) -> None:
    with pytest.raises(RankError, match=r"(?s)rank 1 raised.*ValueError: rank one refuses"):
        run_ranks(rank_fns.raise_on_rank_one, world_size=2, timeout=120)


def test_ranks_past_the_timeout_are_killed(rank_fns) -> None:
    with pytest.raises(RankError, match=r"did not finish in 5"):
        run_ranks(rank_fns.sleep_on_rank_zero, world_size=2, timeout=5)


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"world_size": 0}, "world_size"), ({"timeout": 0}, "timeout")]
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_ranks(print, **kwargs)
