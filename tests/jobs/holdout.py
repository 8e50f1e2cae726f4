"""The hold-out harness's model builder and compiled step, as the benchmarks that time single
hold-out rows import them from the test jobs; the harness itself is ``autopar.holdout``."""
from __future__ import annotations

from autopar.holdout import build, prepared

__all__ = ["build", "prepared"]
