"""The bad-input matrix: each case is a mistake a user makes, run on every rank of a real
process group; each must raise a clear error (or, where autopar carries on, a warning) that
names what was expected, what was found and the fix, on every rank, without a hang, and
leave the ranks able to go on (a case that fails at run time then runs a correct step on the
same module).

``CASES`` lists them: (id, what the user did, the exception type, a pattern of its message).
``run_cases`` runs them in one job; ``markdown_table`` prints docs/debugging.md's table from a run.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.cost.cluster import get_cluster
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch, lm_loss

from .common import mlp_batch, mse


# ---- small models of the cases -----------------------------------------------------------------

class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if x.sum() > 0:          # data-dependent control flow
            return self.fc(x)
        return -self.fc(x)


class _ToList(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        scale = float(x.abs().max())     # a tensor's value leaves the graph
        return self.fc(x) * scale


class _NoRule(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)          # logsumexp over every dim: no rule, and no sharded layout is right
        return self.b(h - torch.logsumexp(h, dim=(0, 1), keepdim=True))


class _NoRuleBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.logsumexp(self.fc(x), dim=(0, 1))      # over the batch and the features


class _BatchCentre(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(dim=0, keepdim=True)      # a statistic over the whole batch


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) + 0.1 * torch.randn_like(x)


class _WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        x[:, 0] = 0.0
        return self.fc(x)


class _TrainScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x) * (2.0 if self.training else 1.0)


class _WithFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, double: bool = False):
        return self.fc(x) * (2 if double else 1)


class _GPTLoss(nn.Module):
    """A GPT whose loss is in the graph (vocabulary parallelism applies)."""

    def __init__(self, c):
        super().__init__()
        self.gpt = TinyGPT(c)

    def forward(self, idx, targets):
        return lm_loss(self.gpt(idx), targets)


# ---- helpers --------------------------------------------------------------------------------------

def _mesh(**axes):
    return autopar.Mesh(**axes)


def _mlp(plan="ddp", **axes):
    x, _ = mlp_batch()
    return autopar.compile(TinyMLP(), _mesh(**(axes or {"dp": 2})), example_inputs=(x,),
                           plan=autopar.Plan(dp=plan) if isinstance(plan, str) else plan)


def _step(dm):
    """A correct training step on ``dm`` (the ranks are still in step after an error)."""
    x, y = mlp_batch()
    mse(dm(*dm.shard_batch((x,))), dm.shard_batch(y)).backward()


def _raises(fn):
    try:
        fn()
    except Exception as exc:    # the error the case is about, kept until the recovery step ran
        return exc
    raise AssertionError("expected an error, none was raised")


def _gpt(c, axes, plan, batch=8):
    tok, _ = gpt_batch(c, batch)
    return autopar.compile(TinyGPT(c), _mesh(**axes), example_inputs=(tok,), plan=plan)


@contextlib.contextmanager
def _cache_file(text):
    """AUTOPAR_CACHE pointing at a file holding ``text`` (None: no file)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    if text is None:
        os.remove(path)
    else:
        with open(path, "w") as f:
            f.write(text)
    old = os.environ.get("AUTOPAR_CACHE")
    os.environ["AUTOPAR_CACHE"] = path
    try:
        yield path
    finally:
        if old is None:
            del os.environ["AUTOPAR_CACHE"]
        else:
            os.environ["AUTOPAR_CACHE"] = old
        if os.path.exists(path):
            os.remove(path)


class _Warned(Exception):
    """A case where autopar goes on and says why in a warning: the warning's text."""


def _warning_of(fn):
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("autopar")
    h = H(level=logging.WARNING)
    log.addHandler(h)
    try:
        fn()
    finally:
        log.removeHandler(h)
    raise _Warned(" | ".join(records) if records else "(no warning)")


# ---- the cases ------------------------------------------------------------------------------------

def mesh_world_mismatch():
    _mesh(dp=4)


def mesh_unknown_axis():
    _mesh(xp=2)


def mesh_axis_size():
    _mesh(dp=0)


def mesh_rank_given():
    autopar.Mesh(dp=2, rank=1 - dist.get_rank())


def not_a_mesh():
    autopar.compile(TinyMLP(), {"dp": 2}, example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def not_a_module():
    autopar.compile(lambda x: x, _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def plan_not_a_plan():
    autopar.compile(TinyMLP(), _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan="fast")


def plan_unknown_dp():
    autopar.Plan(dp="zero4")


def plan_unknown_schedule():
    autopar.Plan(pp_schedule="gpipe2")


def plan_sp_without_tp():
    autopar.Plan(sp=True)


def plan_axis_missing():
    _mlp(autopar.Plan(tp=True), dp=2)


def plan_axis_idle():
    _mlp(autopar.Plan(dp="ddp"), tp=2)


def plan_virtual_stages_one_rank():
    _gpt(GPTConfig(layers=4), {"pp": 1, "dp": 2},
         autopar.Plan(pp_schedule="interleaved", virtual_stages=2, microbatches=2))


def capture_data_dependent_branch():
    autopar.compile(_Branchy(), _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def capture_value_leaves_graph():
    autopar.compile(_ToList(), _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def rule_missing_dp():
    autopar.compile(_NoRuleBatch(), _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def rule_missing_tp():
    _warning_of(lambda: autopar.compile(_NoRule(), _mesh(tp=2), example_inputs=(torch.randn(8, 16),),
                                        plan=autopar.Plan(tp=True)))


def batch_statistic_dp():
    autopar.compile(_BatchCentre(), _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def tp_odd_heads():
    _gpt(GPTConfig(heads=3, dim=24), {"tp": 2}, autopar.Plan(tp=True))


def tp_vocab_smaller_than_tp():
    c = GPTConfig(vocab=1)
    tok, tgt = gpt_batch(c, 8)
    autopar.compile(_GPTLoss(c), _mesh(tp=2), example_inputs=(tok, tgt),
                    plan=autopar.Plan(tp=True, vocab_parallel=True))


def batch_not_divisible_by_dp():
    autopar.compile(TinyMLP(), _mesh(dp=2), example_inputs=(torch.randn(5, 16),), plan=autopar.Plan())


def batch_not_divisible_by_microbatches():
    _gpt(GPTConfig(layers=2), {"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=3))


def shard_batch_indivisible():
    dm = _mlp()
    err = _raises(lambda: dm.shard_batch(torch.randn(7, 16)))
    _step(dm)
    raise err


def run_wrong_dims():
    dm = _mlp()
    err = _raises(lambda: dm(torch.randn(16)))
    _step(dm)
    raise err


def run_wrong_dtype():
    dm = _mlp("zero3")
    err = _raises(lambda: dm(torch.randn(4, 16, dtype=torch.float64)))
    _step(dm)
    raise err


def run_wrong_structure():
    dm = _mlp("zero2")
    err = _raises(lambda: dm(torch.randn(4, 16), torch.randn(4, 16)))
    _step(dm)
    raise err


def run_constant_changed():
    x = torch.randn(8, 16)
    dm = autopar.compile(_WithFlag(), _mesh(dp=2), example_inputs=(x,), example_kwargs={"double": False},
                         plan=autopar.Plan())
    err = _raises(lambda: dm(x[:4], double=True))
    dm(x[:4], double=False).sum().backward()
    raise err


def run_pipeline_wrong_shape():
    c = GPTConfig(layers=2)
    dm = _gpt(c, {"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2))
    tok, tgt = gpt_batch(c, 8)
    err = _raises(lambda: dm.train_step((tok.reshape(-1),), tgt.reshape(-1), lm_loss))
    dm.train_step((tok,), tgt, lm_loss)
    raise err


def run_pipeline_forward():
    dm = _gpt(GPTConfig(layers=2), {"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2))
    tok, _ = gpt_batch(GPTConfig(layers=2), 8)
    dm(tok)


def shards_edited_on_zero2():
    dm = _mlp("zero2")
    with torch.no_grad():
        next(dm.parameters()).add_(1.0)     # outside an optimizer step: the replicas go stale
    err = _raises(lambda: _step(dm))
    dm.gather_params()           # the fix the message names
    _step(dm)
    raise err


def optimizer_stock_not_elementwise():
    dm = _mlp("zero3")
    opt = torch.optim.Adafactor(dm.parameters(), lr=0.01)     # not dm.optimizer: checked at its first step
    _step(dm)
    err = _raises(opt.step)
    dm.zero_grad()
    _step(dm)
    raise err


def optimizer_not_elementwise():
    _mlp("zero3").optimizer(torch.optim.Adafactor, lr=0.01)


def optimizer_per_tensor_pipeline():
    dm = _gpt(GPTConfig(layers=2), {"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2))
    dm.optimizer(torch.optim.Adafactor, per_tensor=True, lr=0.01)


def pipeline_stage_memory():
    _gpt(GPTConfig(layers=2), {"pp": 2},
         autopar.Plan(pp_schedule="1f1b", microbatches=2, stage_memory_bytes=1000))


def pipeline_schedule_deadlocks():
    _gpt(GPTConfig(layers=2), {"pp": 2},
         autopar.Plan(pp_schedule="rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0", microbatches=2))


def pipeline_schedule_ranks():
    _gpt(GPTConfig(layers=2), {"pp": 2},
         autopar.Plan(pp_schedule="rank 0: 0F0 0B0\nrank 1: 1F0 1B0\nrank 2: 2F0 2B0", microbatches=1))


def pipeline_interleaved_microbatches():
    _gpt(GPTConfig(layers=4), {"pp": 2}, autopar.Plan(pp_schedule="interleaved", virtual_stages=2, microbatches=3))


def pipeline_clip_inf():
    dm = _gpt(GPTConfig(layers=2), {"pp": 2}, autopar.Plan(pp_schedule="1f1b", microbatches=2))
    dm.clip_grad_norm_(1.0, norm_type=float("inf"))


def buffers_updated():
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
    autopar.compile(model, _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def input_written():
    autopar.compile(_WritesInput(), _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def random_op():
    autopar.compile(_Noisy(), _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan=autopar.Plan())


def eval_mode_differs():
    x = torch.randn(8, 16)
    dm = autopar.compile(_TrainScale(), _mesh(dp=2), example_inputs=(x,), plan=autopar.Plan(dp="zero3"))
    dm.eval()
    err = _raises(lambda: dm(x[:4]))
    dm.train()
    dm(x[:4]).sum().backward()
    raise err


def two_forwards_one_backward():
    dm = _mlp("ddp")
    x, _ = mlp_batch()
    xs = dm.shard_batch(x)
    err = _raises(lambda: (dm(xs).sum() + dm(xs).sum()).backward())
    _step(dm)
    raise err


def load_missing_key():
    dm = _mlp("zero3")
    sd = dm.full_state_dict()
    del sd["fc2.weight"]
    err = _raises(lambda: dm.load_full_state_dict(sd))
    _step(dm)
    raise err


def load_wrong_shape():
    dm = _mlp("zero2")
    sd = dm.full_state_dict()
    sd["fc1.weight"] = torch.zeros(3, 3)
    err = _raises(lambda: dm.load_full_state_dict(sd))
    _step(dm)
    raise err


def cluster_cache_corrupt():
    with _cache_file("{ not json"):
        get_cluster("local")


def cluster_cache_missing_auto_plan():
    with _cache_file(None):
        autopar.compile(TinyMLP(), _mesh(dp=2), example_inputs=(torch.randn(8, 16),), plan="auto")


def cluster_unknown():
    get_cluster("dgx-z")


def compile_differs_between_ranks():
    c = GPTConfig(layers=2 + dist.get_rank())
    _gpt(c, {"dp": 2}, autopar.Plan(dp="zero3"))


CASES = (   # (id, what the user did, exception type, pattern of the message)
    ("mesh_world_mismatch", "Mesh(dp=4) in a world of 2 processes", "ValueError",
     r"has 4 ranks but the world size is 2.*Mesh\(dp=2\)"),
    ("mesh_unknown_axis", "Mesh(xp=2): an axis name that is not a role", "ValueError",
     r"unknown mesh axis 'xp'.*one of"),
    ("mesh_axis_size", "Mesh(dp=0)", "ValueError", r"dp=0.*positive integers"),
    ("mesh_rank_given", "Mesh(dp=2, rank=...) naming another process's rank", "ValueError",
     r"given for a real mesh, but this process is rank"),
    ("not_a_mesh", "compile(model, {'dp': 2}): a dict for the mesh", "TypeError", r"must be an autopar.Mesh"),
    ("not_a_module", "compile(a function, ...)", "TypeError", r"expects an nn.Module"),
    ("plan_not_a_plan", "compile(..., plan='fast')", "ValueError", r"plan='fast' is not a plan.*Plan\(dp="),
    ("plan_unknown_dp", "Plan(dp='zero4')", "ValueError", r"not a data-parallel mode; expected one of"),
    ("plan_unknown_schedule", "Plan(pp_schedule='gpipe2')", "ValueError", r"gpipe2.*expected one of"),
    ("plan_sp_without_tp", "Plan(sp=True) without tp", "ValueError", r"sp=True\) needs tp=True"),
    ("plan_axis_missing", "Plan(tp=True) on Mesh(dp=2)", "ValueError", r"uses mesh axis 'tp'.*has none"),
    ("plan_axis_idle", "Plan(dp='ddp') on Mesh(tp=2): an axis without a role", "ValueError",
     r"axis tp=2, which Plan\(dp='ddp'\) gives no role"),
    ("plan_virtual_stages_one_rank", "virtual_stages=2 on a mesh with pp=1", "ValueError",
     r"runs every stage on one rank: virtual_stages=2 needs a pp axis"),
    ("capture_data_dependent_branch", "if x.sum() > 0: in forward", "CaptureError",
     r"could not capture _Branchy.*at .*bad_inputs.py:\d+.*torch.where / torch.cond"),
    ("capture_value_leaves_graph", "float(x.abs().max()) in forward", "CaptureError",
     r"could not capture _ToList.*bad_inputs.py:\d+.*fix:"),
    ("rule_missing_dp", "an op without a sharding rule (logsumexp over every dim) reading the batch shard, "
     "under dp", "NotImplementedError", r"no sharding rule for aten.logsumexp.default \(node logsumexp\).*"
     r"no candidate placement matched.*add a rule in passes/rules/"),
    ("rule_missing_tp", "an op without a sharding rule (logsumexp over every dim) between tensor-parallel "
     "matmuls", "warning", r"no sharding rule for aten.logsumexp.default.*made whole along tp and it runs replicated"),
    ("batch_statistic_dp", "h - h.mean(dim=0): a statistic over the batch, under dp", "ValueError",
     r"cannot run on its inputs as data parallelism lays them out.*mixes samples"),
    ("tp_odd_heads", "3 attention heads over tp=2", "ValueError", r"leading 3 \(attention heads\) does not divide by tp=2"),
    ("tp_vocab_smaller_than_tp", "a vocabulary of 1 token over tp=2, the head split", "ValueError",
     r"vocabulary of 1 rows leaves some of tp=2 ranks without rows"),
    ("batch_not_divisible_by_dp", "a global batch of 5 rows over dp=2", "ValueError",
     r"5 rows along dim 0, which does not divide by dp=2"),
    ("batch_not_divisible_by_microbatches", "a batch of 8 in 3 micro-batches", "ValueError",
     r"8 rows along dim 0, which does not divide by microbatches=3.*multiple of 3.*microbatches that divide 8"),
    ("shard_batch_indivisible", "dm.shard_batch of 7 rows over dp=2", "ValueError", r"7 rows along dim 0.*multiple of 2"),
    ("run_wrong_dims", "dm(x) with a 1-d x where the batch is 2-d", "ValueError",
     r"expected this rank's slice of the batch with 2 dims \(shape \(4, 16\)\), got shape \(16,\).*shard_batch"),
    ("run_wrong_dtype", "float64 inputs to a module compiled on float32", "ValueError",
     r"expected dtype torch.float32.*got torch.float64"),
    ("run_wrong_structure", "dm(x, x): another number of inputs", "TypeError",
     r"captured with 1 positional input and keywords \[\], but was called with 2 positional inputs"),
    ("run_constant_changed", "a Python flag that differs from the captured one", "ValueError",
     r"is the constant False in the captured graph, got True; compile again"),
    ("run_pipeline_wrong_shape", "train_step with the batch flattened to 1-d", "ValueError",
     r"micro-batch of this rank's slice has shape \(64,\), expected 2 dims \(shape \(4, 16\)"),
    ("run_pipeline_forward", "dm(x) on a pipelined module", "RuntimeError", r"call dm.train_step"),
    ("shards_edited_on_zero2", "a ZeRO-2 shard written in place outside an optimizer step, then forward",
     "RuntimeError", r"parameter shards were changed after the last parameter all-gather.*dm.gather_params\(\)"),
    ("optimizer_stock_not_elementwise", "torch.optim.Adafactor(dm.parameters()) under ZeRO-3, then its step",
     "ValueError", r"Adafactor was built directly on the parameters.*zero3 over dp=2.*per shard.*dm.optimizer\("),
    ("optimizer_not_elementwise", "dm.optimizer(torch.optim.Adafactor) under ZeRO-3", "ValueError",
     r"Adafactor is not an elementwise optimizer.*zero3 over dp=2.*per_tensor=True"),
    ("optimizer_per_tensor_pipeline", "dm.optimizer(..., per_tensor=True) on a pipeline", "NotImplementedError",
     r"per_tensor=True is not built for pipelines"),
    ("pipeline_stage_memory", "stage_memory_bytes=1000: no split fits", "ValueError",
     r"no split of the graph into 2 stages keeps every stage within stage_memory_bytes=1,000"),
    ("pipeline_schedule_deadlocks", "a custom schedule whose ranks wait on each other", "ScheduleDeadlock",
     r"deadlocks: rank 0 waits at 0RECV_B0.*Reorder the ranks' actions"),
    ("pipeline_schedule_ranks", "a custom schedule for 3 ranks on pp=2", "ValueError", r"3 ranks.*pp=2"),
    ("pipeline_interleaved_microbatches", "interleaved with 3 micro-batches on 2 ranks", "ValueError",
     r"interleaved needs m % p == 0.*got m=3, p=2"),
    ("pipeline_clip_inf", "clip_grad_norm_(norm_type=inf) on a pipeline", "NotImplementedError",
     r"clips by the 2-norm"),
    ("buffers_updated", "BatchNorm in training mode (running statistics)", "ValueError",
     r"updates the buffers .*running_mean.*eval mode before compiling"),
    ("input_written", "forward writes into its input (x[:, 0] = 0)", "ValueError",
     r"writes in place into its input 'x'.*x = x\.clone\(\)"),
    ("random_op", "torch.randn_like in forward", "NotImplementedError",
     r"randn_like.*draws random numbers.*only for dropout"),
    ("eval_mode_differs", "dm.eval() on a model whose forward branches on self.training", "RuntimeError",
     r"compiled from the model in training mode.*different program.*compile a second module"),
    ("two_forwards_one_backward", "one backward through two forwards (ddp)", "RuntimeError",
     r"second gradient in one backward.*backward once per forward"),
    ("load_missing_key", "load_full_state_dict without fc2.weight", "KeyError", r"fc2.weight.*missing"),
    ("load_wrong_shape", "load_full_state_dict with a (3, 3) fc1.weight", "ValueError",
     r"fc1.weight has shape \(3, 3\), expected \(32, 16\)"),
    ("cluster_cache_corrupt", "a calibration cache that is not JSON", "ValueError",
     r"(?=.*python -m autopar calibrate).*the cache is unusable: .* is not valid JSON"),
    ("cluster_cache_missing_auto_plan", "plan='auto' on a machine never calibrated", "ValueError",
     r"plan='auto' found no plan.*python -m autopar calibrate"),
    ("cluster_unknown", "get_cluster('dgx-z')", "ValueError", r"unknown cluster 'dgx-z': expected one of"),
    ("compile_differs_between_ranks", "ranks compile different models (2 and 3 layers)", "ValueError",
     r"collective"),
)
"""The cases that run in the pooled ranks; the killed, stalled and mismatched ranks run in
fresh processes (tests/test_bad_inputs.py)."""


def run_cases(ids=None):
    """Every case (or those of ``ids``) on this rank: {id: (exception type, message)}, each
    followed by a collective that proves the ranks are still in step."""
    torch.set_num_threads(1)
    out = {}
    for case_id, *_ in CASES:
        if ids is not None and case_id not in ids:
            continue
        fn = globals()[case_id]
        try:
            fn()
            out[case_id] = (None, "no error")
        except _Warned as w:
            out[case_id] = ("warning", str(w))
        except Exception as exc:       # the case's error: its type and message are the result
            out[case_id] = (type(exc).__name__, str(exc))
        token = torch.ones(1)
        dist.all_reduce(token)
        if float(token) != dist.get_world_size():
            raise RuntimeError(f"after {case_id} the ranks are out of step")
    return out


def markdown_table(results) -> str:
    """docs/debugging.md's table from one run's results (rank 0's messages)."""
    rows = ["| case | what the user did | error | message (rank 0) |", "|---|---|---|---|"]
    for case_id, what, kind, _ in CASES:
        typ, msg = results[case_id]
        msg = " ".join(msg.split()).replace("|", "\\|")
        rows.append(f"| `{case_id}` | {what} | {typ} | {msg} |")
    return "\n".join(rows)

