"""Measuring this machine for the cost model's local preset (``python -m autopar calibrate``)."""
from .local import calibrate_local

__all__ = ["calibrate_local"]
