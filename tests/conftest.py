"""Two tiers: ``pytest`` runs the fast one (graphs, layouts, bytes and formulas on virtual meshes
and fake process groups, plus one real-process parity run per parallelism); ``pytest -m slow``
the rest (real-process parity of every plan, memory censuses, measurements, the local
calibration). ``pytest --update-goldens`` rewrites the golden files instead of comparing.

Fixtures: ``ranks(fn, world, *args)`` runs a job on a pool of ``world`` processes kept for the
session; ``local_cluster`` is this machine's calibrated preset, measured once per session (or
read from its cache).
"""
import gc
import os
import sys
import time

import pytest

from autopar.cost.calibration import calibrate_local
from autopar.testing import RankPool

sys.path.insert(0, os.path.dirname(__file__))   # the ranks import the jobs package
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("AUTOPAR_EXPORT_CACHE", "1")   # a process exports a model built alike once (autopar.capture)


def pytest_collection_finish(session):
    """Everything imported for the tests is set aside from garbage collection: each compile's
    gc.collect() (export leaves cycles) then scans only what the test made."""
    gc.collect()
    gc.freeze()


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true",
                     help="write tests/golden/*.txt from the current output instead of comparing")



@pytest.fixture(scope="session")
def update_goldens(request) -> bool:
    return request.config.getoption("--update-goldens")


@pytest.fixture(scope="session")
def ranks():
    """``ranks(fn, world, *args, timeout=...)``: ``autopar.testing.run`` on a pool of ``world``
    processes started once for the session (a failed job starts a new pool)."""
    pools: dict[int, RankPool] = {}

    def call(fn, world: int, *args, timeout: float = 180.0):
        if world not in pools or not pools[world].alive:
            pools[world] = RankPool(world)
        return pools[world].run(fn, *args, timeout=timeout)

    def close_all():
        """Stop every pool (a timing measurement wants the machine to itself: idle ranks
        still hold threads and connections); the next call starts a new one."""
        for pool in pools.values():
            pool.close()
        pools.clear()

    call.close_all = close_all
    yield call
    close_all()


@pytest.fixture(scope="session")
def local_cluster():
    """This machine's local preset and the seconds it took: measured once per session (about a
    minute), or read from the cache a previous run left."""
    start = time.perf_counter()
    cluster = calibrate_local()
    return cluster, time.perf_counter() - start
