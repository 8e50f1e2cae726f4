"""The cost model's predictions against measurements (tests/test_predict_local.py): the small
GPT, the plans at world 4 and what each measures per rank, from ``autopar.predict_local``."""
from autopar.predict_local import PREDICT_BATCH, PREDICT_CONFIG, PREDICT_PLANS, measured_memory, measured_plans

__all__ = ["PREDICT_CONFIG", "PREDICT_BATCH", "PREDICT_PLANS", "measured_plans", "measured_memory"]
