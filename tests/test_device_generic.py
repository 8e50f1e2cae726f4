"""The runtime works on the device of the tensors it serves. Two lints over ``autopar/runtime``
and the entry points (``autopar/*.py``):

- allocation: no buffer the runtime creates may fall back to the CPU by default (the first run
  on a GPU would fail, or copy every step): every factory call that makes a tensor from
  nothing (``torch.zeros``/``empty``/``ones``/``full``/``tensor``/``arange``/``rand*``/
  ``randperm``/``linspace``/``eye``, and ``torch.Generator``) names its ``device=``;
  ``*_like`` and ``new_*`` take their argument's;
- timing: CUDA runs kernels asynchronously, so a host clock read after a launch times the
  launch, not the work: every duration of device work reads ``autopar.runtime.timing.now``
  (which waits for the device first), never ``time.time``/``perf_counter``/``monotonic``.

Each allows the exceptions listed below, each with why it meets no device."""
import ast
import functools
import pathlib
import time

import pytest
import torch

import autopar
import autopar.runtime
from autopar.runtime import timing
from autopar.runtime.comm import CommStats
from autopar.runtime.offload import HostLink

FACTORIES = {"zeros", "empty", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "empty_strided",
             "Generator", "as_tensor", "randperm", "linspace", "eye"}
EXEMPT = {   # (file, function; "*": the whole file) -> why its bare factories meet no device tensor
    ("module.py", "has_loss"): "placeholders of the outputs' dims probing a loss structure with zeros",
    ("mesh.py", "_ranks"): "the rank layout, integers the mesh reshapes on the host",
    ("models.py", "*"): "the example models and batches a user builds on the host and moves",
    ("fuzz_models.py", "*"): "the fuzzer's models, built on the host as a user's are",
    ("fuzz.py", "example"): "a fuzzed model's example batch, built on the host",
    ("zoo.py", "batch"): "a zoo model's example batch, built on the host",
    ("rng.py", "draw_masks"): "local mode's key of the step, one number drawn from the CPU generator",
}

CLOCKS = {"time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "monotonic_ns"}
CLOCK_EXEMPT = {   # (file, function; "*": the whole file) -> why the host clock times no device work
    ("timing.py", "now"): "the synchronising helper itself",
    ("timing.py", "mark"): "Spans: the CPU's clock, whose work is done when the call returns (CUDA: an event)",
    ("flight.py", "*"): "the flight recorder's wall clocks: when a collective was issued and ended, when a rank "
                        "last changed, compared between processes to detect a hang",
    ("launch.py", "*"): "the launcher's deadlines for its processes and threads",
    ("phases.py", "*"): "the step-phase harness of benchmarks/step_phases.py: its models and meshes are "
                        "built on the CPU (gloo processes), where the host clock is the device's",
    ("fuzz.py", "check"): "the wall clock of a whole check, which ends reading its verdict on the host",
    ("fuzz.py", "run"): "the wall clock of a fuzzing run and its time budget",
    ("zoo.py", "run_cell"): "the wall clock of a whole cell, which ends in a host read of the verdict",
    ("__main__.py", "*"): "the command line's wall clocks of whole runs, printed for the user",
    ("doctor.py", "_resume"): "the wall clock of a whole check, which ends in host reads",
    ("doctor.py", "run_checks"): "the wall clock of each check, run in other processes",
    ("doctor.py", "main"): "the wall clock of all the checks, printed for the user",
}


def _sources() -> list[pathlib.Path]:
    """The runtime's files and the entry points' (``autopar/*.py``)."""
    runtime = pathlib.Path(autopar.runtime.__file__).parent
    return sorted(runtime.glob("*.py")) + sorted(pathlib.Path(autopar.__file__).parent.glob("*.py"))


@functools.lru_cache(maxsize=None)
def _parsed(path: pathlib.Path, text: str) -> ast.Module:
    return ast.parse(text)


def _functions(tree):
    """(name of the innermost function, node) of every node inside a function."""
    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if inner is not None:
                yield inner, child
            yield from visit(child, inner)
    yield from visit(tree, None)


def _calls(path: pathlib.Path):
    for fn, node in _functions(_parsed(path, path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" and \
                node.func.attr in FACTORIES:
            yield fn, node


def _clock_calls(path: pathlib.Path):
    """Calls of ``time.<clock>()``, and of a clock imported by name (``from time import ...``)."""
    tree = _parsed(path, path.read_text())
    by_name = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "time"
               for a in node.names if a.name in CLOCKS}
    for fn, node in _functions(tree):
        f = node.func if isinstance(node, ast.Call) else None
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "time"
                and f.attr in CLOCKS) or (isinstance(f, ast.Name) and f.id in by_name):
            yield fn, node


def _exempt(table: dict, path: pathlib.Path, fn: str) -> bool:
    return (path.name, fn) in table or (path.name, "*") in table


def _missing_device(paths) -> list[str]:
    return [f"{path.name}:{call.lineno} in {fn}(): torch.{call.func.attr}(...) without device="
            for path in paths for fn, call in _calls(path)
            if not _exempt(EXEMPT, path, fn) and not any(k.arg == "device" for k in call.keywords)]


def _bare_clocks(paths) -> list[str]:
    return [f"{path.name}:{call.lineno} in {fn}(): {ast.unparse(call)} times without waiting for the device; "
            "read autopar.runtime.timing.now(device)"
            for path in paths for fn, call in _clock_calls(path) if not _exempt(CLOCK_EXEMPT, path, fn)]


def test_no_runtime_allocation_hard_codes_a_device():
    missing = _missing_device(_sources())
    assert not missing, "\n".join(missing)


def test_every_timer_of_device_work_waits_for_the_device():
    bare = _bare_clocks(_sources())
    assert not bare, "\n".join(bare)


def test_the_lint_finds_a_missing_device(tmp_path):
    """The check can fail: a runtime-like file with a bare torch.zeros is reported, one whose
    name and function are allowed is not."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef f(x):\n    return torch.zeros(3) + torch.zeros(3, device=x.device)\n")
    found = [(fn, c.lineno) for fn, c in _calls(bad) if not any(k.arg == "device" for k in c.keywords)]
    assert found == [("f", 3)]
    assert _missing_device([bad]) == ["bad.py:3 in f(): torch.zeros(...) without device="]
    allowed = tmp_path / "module.py"
    allowed.write_text("import torch\ndef has_loss(out):\n    return torch.zeros(())\n")
    assert _missing_device([allowed]) == []


def test_the_lint_finds_a_bare_clock(tmp_path):
    """The check can fail: a step timed with time.perf_counter (and with a perf_counter
    imported by name, and inside a nested function) is reported; one timed with
    timing.now is not."""
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom time import perf_counter as pc\nfrom autopar.runtime.timing import now\n"
                   "def step(f, device):\n    t0 = time.perf_counter()\n    f()\n"
                   "    def inner():\n        return pc()\n"
                   "    return now(device) - t0, inner()\n")
    assert [line.split(" times")[0] for line in _bare_clocks([bad])] == [
        "bad.py:5 in step(): time.perf_counter()", "bad.py:8 in inner(): pc()"]
    good = tmp_path / "good.py"
    good.write_text("from autopar.runtime.timing import now\ndef step(f, device):\n    t0 = now(device)\n"
                    "    f()\n    return now(device) - t0\n")
    assert _bare_clocks([good]) == []


# ---- the device a module allocates on, and the device work its timers and copies wait for ------------------

def test_to_empty_allocates_on_the_mesh_device(monkeypatch):
    """``dm.to_empty()`` allocates where ``Mesh.device`` says (this rank's GPU under NCCL), not on
    the CPU: with the mesh's device stood in by the meta device, a module's storage moves
    there, a pipeline's too; ``device=`` still wins."""
    import autopar.mesh
    from autopar.models import TinyMLP
    x = torch.randn(8, 16)
    dm = autopar.compile(TinyMLP(), autopar.Mesh(dp=2, virtual=True), example_inputs=(x,), plan=autopar.Plan(dp="zero2"))
    pm = autopar.compile(TinyMLP(), autopar.Mesh(pp=2, virtual=True), example_inputs=(x,),
                         plan=autopar.Plan(pp_schedule="1f1b", microbatches=2))
    monkeypatch.setattr(autopar.mesh, "process_device", lambda: torch.device("meta"))
    assert dm.mesh.device == torch.device("meta")
    for m in (dm, pm):
        assert m.to_empty() is m
        assert {p.device.type for p in m.parameters()} == {"meta"}
        m.to_empty(device="cpu")
        assert {p.device.type for p in m.parameters()} == {"cpu"}


def test_the_clock_and_the_host_link_on_the_cpu_are_plain():
    """On the CPU ``timing.now`` is the clock alone and the host link copies in place, with no
    stream: what ran before the device-correct versions, unchanged."""
    t0 = time.perf_counter()
    assert t0 <= timing.now(torch.device("cpu")) <= time.perf_counter()
    assert abs(timing.now(wall=True) - time.time()) < 1.0
    link = HostLink(torch.device("cpu"), CommStats())
    assert link.stream is None and not link.pinned
    src = torch.arange(6.0)
    host = link.down(link.host_empty(src), src)
    link.wait()
    dst = torch.zeros(6)
    link.up(dst, host * 2)
    assert torch.equal(host, src) and torch.equal(dst, src * 2)
    assert link.stats.total(kind="d2h") == link.stats.total(kind="h2d") == 24


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_clock_waits_for_cuda_work():
    """A span between two ``now`` calls holds the kernel queued between them; the bare clock
    reads only its launch."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    cycles = 200_000_000       # ~0.1 s on a GPU at about 2 GHz
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    launched = time.perf_counter() - t0
    t0 = timing.now(device)
    torch.cuda._sleep(cycles)
    ran = timing.now(device) - t0
    assert ran > 0.02 and ran > 10 * launched, (ran, launched)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_host_link_copies_on_its_own_stream_in_order():
    """On CUDA the copies run on the link's stream: a copy down waits for the compute that wrote
    its source (a long kernel before it), a copy up is seen by the compute queued after it."""
    device = torch.device("cuda", torch.cuda.current_device())
    link = HostLink(device, CommStats())
    assert link.pinned and link.stream is not None and link.stream != torch.cuda.current_stream(device)
    src = torch.zeros(1 << 20, device=device)
    torch.cuda._sleep(100_000_000)
    src.add_(3.0)                    # queued behind the sleep on the compute stream
    host = link.host_empty(src)
    assert host.is_pinned()
    link.down(host, src)
    del src                          # its memory must not be reused before the copy ran
    junk = torch.full((1 << 20,), -1.0, device=device)
    link.wait()
    assert bool((host == 3.0).all())
    dst = torch.empty(1 << 20, device=device)
    link.up(dst, host * 2)
    total = float((dst + 0).sum())   # compute after the copy up
    assert total == 6.0 * (1 << 20) and bool((junk == -1.0).all())
