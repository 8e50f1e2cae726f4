"""``python -m autopar doctor``: the platform check runs each plan against one device and
reports a failing plan as a row, not a crash."""
import subprocess
import sys

import pytest

from autopar.doctor import CHECKS, Check, run_checks
from autopar.planspec import Plan


@pytest.mark.timeout(120)
def test_a_check_trains_with_parity_and_a_broken_one_is_a_failed_row():
    rows = run_checks([Check("ddp", (("dp", 2),), Plan()),
                       Check("tp on a dp mesh", (("dp", 2),), Plan(tp=True)),
                       Check("zero3", (("dp", 2),), Plan(dp="zero3"))], log=lambda line: None)
    ok, broken, after = rows
    assert ok.ok and after.ok, (ok, after)
    assert max(ok.errors.values()) <= 1 and ok.step_ms > 0 and ok.peak_mib > 0
    assert not broken.ok and "tp" in broken.detail and broken.step_ms is None


def test_every_check_has_a_distinct_name_and_the_quick_set_covers_the_kinds():
    names = [c.name for c in CHECKS]
    assert len(names) == len(set(names))
    quick = [c for c in CHECKS if c.quick]
    assert any(c.plan.pp_schedule for c in quick) and any(c.plan.tp for c in quick)
    assert any(c.plan.param_dtype for c in quick) and any(c.resume for c in quick)
    assert all(c.world <= 8 for c in CHECKS)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_quick_doctor_passes_on_this_machine():
    out = subprocess.run([sys.executable, "-m", "autopar", "doctor", "--quick"], capture_output=True, text=True,
                         timeout=380)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "checks passed" in out.stdout and "FAIL" not in out.stdout
