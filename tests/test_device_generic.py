"""The runtime allocates on the device of the tensors it serves: no buffer it creates may fall
back to the CPU by default (the first run on a GPU would fail, or copy every step). A lint
over ``autopar/runtime``: every factory call that makes a tensor from nothing
(``torch.zeros``/``empty``/``ones``/``full``/``tensor``/``arange``/``rand*``, and
``torch.Generator``) names its ``device=``; ``*_like`` and ``new_*`` take their argument's."""
import ast
import pathlib

import autopar.runtime

FACTORIES = {"zeros", "empty", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "empty_strided",
             "Generator", "as_tensor"}
# 0-dim placeholders that never meet a device tensor: a loss structure probed with zeros(())
EXEMPT = {("module.py", "has_loss")}


def _calls(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" and \
                    node.func.attr in FACTORIES:
                yield fn.name, node


def test_no_runtime_allocation_hard_codes_a_device():
    root = pathlib.Path(autopar.runtime.__file__).parent
    missing = []
    for path in sorted(root.glob("*.py")):
        for fn, call in _calls(path):
            if (path.name, fn) in EXEMPT:
                continue
            if not any(k.arg == "device" for k in call.keywords):
                missing.append(f"{path.name}:{call.lineno} in {fn}(): torch.{call.func.attr}(...) without device=")
    assert not missing, "\n".join(missing)


def test_the_lint_finds_a_missing_device(tmp_path):
    """The check can fail: a runtime-like file with a bare torch.zeros is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef f(x):\n    return torch.zeros(3) + torch.zeros(3, device=x.device)\n")
    found = [(fn, c.lineno) for fn, c in _calls(bad) if not any(k.arg == "device" for k in c.keywords)]
    assert found == [("f", 3)]
