"""dm.dump() writes every pass's graph with layouts and bytes; dm.explain() reports
collectives, bytes against the formula and per-rank memory."""
import os
import subprocess
import sys

import pytest

from jobs import data_parallel

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_dump_and_explain(ranks, tmp_path, mode):
    res = ranks(data_parallel.dump_and_explain, 2, mode, str(tmp_path), timeout=120)
    before, after, files = res[0]
    names = [os.path.basename(f) for f in files]
    assert names == ["00_capture.txt", "01_shard.txt", "02_collectives.txt", "03_localize.txt", "04_overlap.txt",
                     "05_emit.py", "explain.txt"]
    coll = open(files[2]).read()
    assert "dp:S(0)" in coll and "dp:R" in coll and "B/rank" in coll
    if mode == "zero3":
        assert "blocks_0_qkv_weight_full: f32[96, 32]  dp:R" in coll
        assert "dp_gather(blocks_0_qkv_weight, sync_dp, 'blocks.0.qkv.weight')" in coll
        # block 0 is one unit: its 12 parameters, 50,816 B padded, (N-1)/N of it per rank
        assert "forward all_gather[dp] 25,408 B/rank; unit 1 (12 params); backward" in coll
        over = open(files[4]).read()      # unit 2's gather issued as unit 1 is waited on
        assert over.index("unit1_wait") < over.index("unit2_start") < over.index("unit2_wait")
        assert "part of unit 1, gathered with blocks.0.ln1.weight" in coll
    compile(open(files[5]).read(), "05_emit.py", "exec")     # the emitted code is real Python
    assert "measured: no step run yet" in before
    formula = "3*Psi*(N - 1)/N" if mode == "zero3" else "2*Psi*(N - 1)/N"
    assert formula in after and "measured since the counters were last reset" in after
    mem = "16*Psi/N" if mode == "zero3" else "4*Psi + 12*Psi/N"
    assert mem in after and "optimizer state" in after
    assert "bucket 0" in after and "blocks.0.qkv.weight" in after


@pytest.mark.timing
@pytest.mark.timeout(180)
def test_demo_command(local_cluster, tmp_path):
    """The README's demo command, on the session's calibration (the demo itself calibrates a
    machine that has none)."""
    out = subprocess.run([sys.executable, "-m", "autopar", "demo", "--steps", "3", "--out", str(tmp_path / "d")],
                         capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "parity with the single-device run: OK" in out.stdout
    assert "plan picked: Plan(dp=" in out.stdout and "with the cost model (local)" in out.stdout
    assert "bytes per step" in out.stdout
    assert (tmp_path / "d" / "rank0" / "02_collectives.txt").exists()
