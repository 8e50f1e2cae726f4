"""Golden text of what the passes produce for a few toy models: every pass's annotated graph and
the emitted code, compared byte for byte with tests/golden/<name>.txt, so that a change shows
its effect on the programs as a diff. A missing golden is a failure; ``pytest --update-goldens``
writes them from the current output (review the diff before committing it).

The emitted code is torch's codegen; it is compared without what a torch release may change and
the program does not (blank lines, the deletion of dead values, the pytree wrapping of the inputs
and outputs)."""
import pathlib
import re

import pytest
import torch

import autopar
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch

GOLDEN = pathlib.Path(__file__).parent / "golden"


def normalise_code(code: str) -> str:
    out = []
    for line in code.splitlines():
        line = line.split(";  ")[0].rstrip()          # `;  x = y = None`: dead values deleted
        if not line.strip() or "tree_flatten_spec(" in line:
            continue
        out.append(re.sub(r"return pytree\.tree_unflatten\((.*), self\._out_spec\)$", r"return \1", line))
    return "\n".join(out) + "\n"


def _mlp(plan, world=2):
    torch.manual_seed(0)
    return autopar.compile(TinyMLP(), autopar.Mesh(dp=world, virtual=True), example_inputs=(torch.randn(8, 16),),
                           plan=plan)


def _gpt(mesh, plan, layers=1, batch=4):
    torch.manual_seed(0)
    c = GPTConfig(layers=layers)
    return autopar.compile(TinyGPT(c), mesh, example_inputs=(gpt_batch(c, batch)[0],), plan=plan)


CASES = {
    "mlp_ddp": lambda: _mlp(autopar.Plan(dp="ddp")),
    "mlp_zero1": lambda: _mlp(autopar.Plan(dp="zero1")),
    "mlp_zero2": lambda: _mlp(autopar.Plan(dp="zero2")),
    "mlp_zero3": lambda: _mlp(autopar.Plan(dp="zero3"), world=4),
    "gpt_zero3": lambda: _gpt(autopar.Mesh(dp=2, virtual=True), autopar.Plan(dp="zero3")),
    "gpt_tp": lambda: _gpt(autopar.Mesh(tp=2, virtual=True), autopar.Plan(tp=True)),
    "gpt_tp_sp": lambda: _gpt(autopar.Mesh(tp=2, virtual=True), autopar.Plan(tp=True, sp=True)),
    "gpt_collective_matmul": lambda: _gpt(autopar.Mesh(tp=2, virtual=True),
                                          autopar.Plan(tp=True, sp=True, collective_matmul=True)),
    "gpt_pipeline_1f1b": lambda: _gpt(autopar.Mesh(pp=2, virtual=True),
                                      autopar.Plan(pp_schedule="1f1b", microbatches=2), layers=2),
}


def golden_text(dm) -> str:
    parts = []
    for stage, body in dm.ctx.snapshots:
        if stage.endswith("emit") or stage == "pipeline":
            body = normalise_code(body)
        parts.append(f"### {stage}\n{body}\n")
    return "".join(parts)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_graph_text(name, update_goldens):
    text = golden_text(CASES[name]())
    path = GOLDEN / f"{name}.txt"
    if update_goldens:
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"{path} is missing: run `pytest --update-goldens {__file__}` and review what it writes")
    assert text == path.read_text(), f"{path} differs: if the change is intended, run pytest --update-goldens"


def test_normalised_code_keeps_the_program():
    code = ("\n\n\ndef forward(self, x):\n    x, = fx_pytree.tree_flatten_spec(([x], {}), self._in_spec)\n"
            "    y = torch.ops.aten.gelu.default(x);  x = None\n"
            "    return pytree.tree_unflatten((y,), self._out_spec)\n    ")
    assert normalise_code(code) == ("def forward(self, x):\n    y = torch.ops.aten.gelu.default(x)\n"
                                    "    return (y,)\n")
