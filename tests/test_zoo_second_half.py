"""The model zoo's slow tier, second part: the architectures of ``autopar.zoo.ARCHS`` after the
first ``test_zoo.SPLIT`` (which tests/test_zoo.py runs) and before ``test_zoo.NEWER`` (which
tests/test_zoo_new.py runs) under ZeRO-3, tp, tp+sp and 1F1B, one architecture per test (a
separate file so that pytest-xdist runs the parts on two workers; see tests/test_zoo.py)."""
import pytest

from autopar import zoo

from test_zoo import FIRST_PART, NEW_PART, SECOND_PART, check_every_two_process_plan


def test_the_three_parts_are_the_whole_zoo():
    assert FIRST_PART + SECOND_PART + NEW_PART == [a.name for a in zoo.ARCHS]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SECOND_PART)
def test_zoo_every_two_process_plan(ranks, name):
    check_every_two_process_plan(ranks, name)
