"""The bad-input matrix: mistakes a user can make (a mesh that does not fit the world, a plan
that does not fit the mesh, a model or batch autopar cannot split, a wrong call at run time).
Every case of ``jobs.bad_inputs.CASES`` runs on both ranks of a real process group and must
raise its clear error (or warning) on every rank, with the ranks still in step afterwards (a
collective follows each case) and, for mistakes made at run time, the same module then running
a correct step. No case may hang: the job has a timeout. The table "Errors for bad inputs" in
docs/debugging.md lists every case with the message a run gives. The killed, stalled and
mismatched ranks are in tests/test_hangs.py (fresh processes)."""
import os
import re

import pytest

import autopar
from jobs import bad_inputs

TABLE = os.path.join(os.path.dirname(__file__), "..", "docs", "debugging.md")   # its "Errors for bad inputs"


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(bad_inputs.run_cases, 2, None, timeout=240)


def test_the_matrix_has_forty_cases():
    assert len(bad_inputs.CASES) >= 40
    assert len({c[0] for c in bad_inputs.CASES}) == len(bad_inputs.CASES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case_id,what,kind,pattern", bad_inputs.CASES, ids=[c[0] for c in bad_inputs.CASES])
def test_bad_input_raises_a_clear_error_on_every_rank(results, case_id, what, kind, pattern):
    for rank, out in enumerate(results):
        typ, msg = out[case_id]
        assert typ == kind, f"rank {rank}, {case_id} ({what}): expected {kind}, got {typ}: {msg}"
        assert re.search(pattern, msg, re.S), f"rank {rank}, {case_id}: {msg!r} does not match {pattern!r}"


def test_no_process_group_says_how_to_get_one():
    with pytest.raises(RuntimeError, match="none is initialised.*torchrun.*virtual=True"):
        autopar.Mesh(dp=2)


def test_the_docs_table_lists_every_case_with_its_message(results):
    text = open(TABLE).read()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z0-9_]+)` \|.*$", text, re.M)}
    for case_id, *_ in bad_inputs.CASES:
        assert case_id in rows, f"the bad-input table of docs/debugging.md has no row for {case_id}"
        typ, msg = results[0][case_id]
        head = " ".join(msg.split())[:60].replace("|", "\\|")
        head = re.sub(r"/tmp/\S+", "", head)       # temporary paths differ between runs
        assert re.sub(r"/tmp/\S+", "", rows[case_id]).find(head) >= 0, \
            f"the docs/debugging.md row of {case_id} does not show the message a run gives: {head!r}"


