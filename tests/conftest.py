import os
import sys

sys.path.insert(0, os.path.dirname(__file__))   # spawned ranks import tests/jobs.py
os.environ.setdefault("OMP_NUM_THREADS", "1")
