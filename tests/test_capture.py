"""Capture: torch.export into a training-IR GraphModule with explicit parameters."""
import copy

import pytest
import torch
from torch import nn

import autopar
from autopar import meta
from autopar.models import GPTConfig, TinyGPT, TinyMLP, gpt_batch
from autopar.testing import live_tensor_bytes

VMESH = autopar.Mesh(dp=2, virtual=True)


def _compile(model, inputs, plan="ddp", **kw):
    return autopar.compile(model, VMESH, example_inputs=inputs, plan=autopar.Plan(dp=plan), **kw)


def test_gpt_captures_aten_ops_with_shapes_and_explicit_parameters():
    c = GPTConfig()
    tok, _ = gpt_batch(c, 4)
    dm = _compile(TinyGPT(c), (tok,))
    g = dm.module.graph
    targets = {str(n.target) for n in g.nodes if n.op == "call_function"}
    for op in ("aten.embedding.default", "aten.layer_norm.default", "aten.linear.default",
               "aten.scaled_dot_product_attention.default"):
        assert op in targets
    for n in g.nodes:
        if n.op == "call_function" and isinstance(n.meta.get(meta.VAL), torch.Tensor):
            assert n.meta[meta.LAYOUT] is not None
        if n.op in ("placeholder",):   # the logical graph: the global batch, split along dp
            assert tuple(n.meta[meta.VAL].shape) == (4, c.seq) and str(n.meta[meta.LAYOUT]) == "dp:S(0)"
    assert dm.ctx.input_shapes == ((2, c.seq),)                   # this rank's half of the batch
    views = [n for n in g.nodes if n.target is torch.ops.aten.view.default]
    assert views and all(n.args[1][0] == 2 and n.meta[meta.VAL].shape[0] == 4 for n in views)
    params = [n for n in g.nodes if n.op == "get_attr" and meta.PARAM in n.meta]
    assert len(params) == len(list(TinyGPT(c).parameters()))


def test_tied_weights_stay_one_parameter():
    c = GPTConfig()
    tok, _ = gpt_batch(c, 4)
    model = TinyGPT(c)
    dm = _compile(model, (tok,))
    assert dm.ctx.params["wte.weight"].aliases == ("head.weight",)
    names = [n for n, _ in dm.named_parameters()]
    assert "module.wte.weight" in names and not any("head" in n for n in names)
    uses = [n for n in dm.module.graph.nodes if n.op == "get_attr" and n.target == "wte.weight"]
    assert len(uses) == 1
    sd = dm.full_state_dict()          # virtual mesh, ddp: local copies
    assert set(sd) == set(model.state_dict())
    assert torch.equal(sd["head.weight"], sd["wte.weight"])


def test_shape_control_flow_resolves_and_its_errors_name_the_line():
    c = GPTConfig(seq=8, max_seq=16)
    _compile(TinyGPT(c), (torch.randint(0, c.vocab, (2, 8)),))       # 8 <= 16: branch resolved
    with pytest.raises(autopar.CaptureError) as e:
        _compile(TinyGPT(c), (torch.randint(0, c.vocab, (2, 20)),))  # 20 > 16: the model raises
    msg = str(e.value)
    assert "longer than max_seq=16" in msg and "models.py:" in msg and "fix:" in msg


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:            # branches on a value: not capturable
            y = y * 2
        return y


def test_untraceable_model_gets_line_and_fix():
    with pytest.raises(autopar.CaptureError) as e:
        _compile(DataDependent(), (torch.randn(4, 4),))
    msg = str(e.value)
    assert "test_capture.py:" in msg and "if y.sum() > 0" in msg
    assert "torch.where" in msg or "torch.cond" in msg


def test_meta_model_captures_without_memory():
    c = GPTConfig(vocab=50257, dim=768, heads=12, layers=4, seq=64, max_seq=64)
    before = live_tensor_bytes()
    with torch.device("meta"):
        model = TinyGPT(c)
    tok = torch.randint(0, c.vocab, (4, c.seq), device="meta")
    dm = _compile(model, (tok,), plan="zero3")
    psi = sum(p.numel() for p in model.parameters())
    assert psi > 60_000_000
    assert live_tensor_bytes() - before < 1 << 20          # 240 MB of fp32 never allocated
    assert all(p.device.type == "meta" for p in dm.parameters())
    assert "dp_gather" in dm.module.code


def test_meta_model_materialises_from_a_full_state_dict():
    torch.manual_seed(0)
    real = TinyMLP()
    with torch.device("meta"):
        model = TinyMLP()
    dm = _compile(model, (torch.randn(4, 16, device="meta"),), plan="ddp")
    dm.to_empty(device="cpu")
    dm.load_full_state_dict(real.state_dict())
    x = torch.randn(2, 16)
    assert torch.allclose(dm(x), real(x))


def test_kwargs_are_captured():
    class WithKw(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale=None, use_cache=True):
            y = self.lin(x)
            return y * scale if scale is not None else y

    m = WithKw()
    x, s = torch.randn(4, 4), torch.tensor(3.0)
    dm = _compile(m, (x,), example_kwargs={"scale": s, "use_cache": False})
    local = dm.shard_batch(x)
    assert torch.allclose(dm(local, scale=s, use_cache=False), m(local, scale=s))
    with pytest.raises(ValueError, match="constant"):
        dm(local, scale=s, use_cache=True)


def test_a_program_exported_beforehand_is_used_as_is():
    """compile(exported=...) skips its own export: the same graph as exporting itself; a program
    of another model (even a copy), of other shapes, or for a pipeline is refused."""
    model, (tok, _) = TinyGPT(), gpt_batch(GPTConfig(), 8)
    ep = torch.export.export(model, (tok,), strict=False)
    mine = autopar.compile(model, autopar.Mesh(dp=2, virtual=True, rank=0), example_inputs=(tok,),
                           plan=autopar.Plan(dp="zero3"), exported=ep)
    again = autopar.compile(TinyGPT(), autopar.Mesh(dp=2, virtual=True, rank=0), example_inputs=(tok,),
                            plan=autopar.Plan(dp="zero3"))
    assert dict(mine.ctx.snapshots)["capture"] == dict(again.ctx.snapshots)["capture"]
    with pytest.raises(ValueError, match=r"not the model's own tensor.*copy.deepcopy\(\(model, exported\)\)"):
        autopar.compile(copy.deepcopy(model), autopar.Mesh(dp=2, virtual=True, rank=0), example_inputs=(tok,),
                        plan=autopar.Plan(dp="zero3"), exported=ep)
    with pytest.raises(ValueError, match=r"made on inputs of shapes \[\(8, 16\)\], the example inputs have \[\(4, 16\)\]"):
        autopar.compile(model, autopar.Mesh(dp=2, virtual=True, rank=0), example_inputs=(tok[:4],),
                        plan=autopar.Plan(dp="zero3"), exported=ep)
    with pytest.raises(ValueError, match=r"exported=\.\.\.\) is for plans without a pipeline"):
        autopar.compile(model, autopar.Mesh(pp=2, virtual=True, rank=0), example_inputs=(tok,),
                        plan=autopar.Plan(pp_schedule="gpipe", microbatches=2), exported=ep)


class _Scaled(nn.Module):
    """Scales by a Python number it holds: export bakes the number into the graph."""

    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        return self.fc(x) * self.scale


def _exports_counted(monkeypatch):
    from autopar import capture
    monkeypatch.setenv("AUTOPAR_EXPORT_CACHE", "1")
    calls = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(capture, "_exports", type(capture._exports)())    # this test's own store
    return calls


def test_a_model_built_again_the_same_way_is_exported_once(monkeypatch):
    """A fresh instance with the same classes, attributes, weights and inputs reuses the stored
    program, bound to its own tensors (capture finds every one of them a parameter of the model,
    none left behind as a constant of the first), and its capture is the one exporting gives."""
    calls = _exports_counted(monkeypatch)
    tok, _ = gpt_batch(GPTConfig(), 8)
    torch.manual_seed(0)
    first = _compile(TinyGPT(), (tok,))
    torch.manual_seed(0)
    model = TinyGPT()
    again = _compile(model, (tok,))
    assert len(calls) == 1
    assert dict(first.ctx.snapshots)["capture"] == dict(again.ctx.snapshots)["capture"]
    assert set(again.ctx.params) == {n for n, _ in model.named_parameters()} == set(first.ctx.params)
    local = tok[:4]       # rank 0's slice of the batch
    assert torch.allclose(again(local), model(local), atol=1e-6)


def test_what_export_reads_decides_whether_a_program_is_reused(monkeypatch):
    """Other weights, another number in an attribute, tied against equal but separate weights, another input shape, another train/eval mode: each is exported on its own, and each
    compiled module computes its own model; a model that does not pickle is exported every time."""
    calls = _exports_counted(monkeypatch)
    x = torch.randn(4, 4)
    torch.manual_seed(0)
    a, b = _Scaled(2.0), _Scaled(3.0)
    b.fc.load_state_dict(a.fc.state_dict())       # same weights, the number differs
    for m in (a, b):
        assert torch.allclose(_compile(m, (x,))(x[:2]), m(x[:2]))
    assert len(calls) == 2
    c = _Scaled(2.0)                               # other weights
    _compile(c, (x,))
    assert len(calls) == 3
    _compile(c, (torch.randn(8, 4),))              # other shapes
    assert len(calls) == 4
    c.eval()
    _compile(c, (x,))
    assert len(calls) == 5
    torch.manual_seed(0)
    tied = TinyGPT()
    torch.manual_seed(0)
    untied = TinyGPT()
    untied.head.weight = nn.Parameter(untied.wte.weight.detach().clone())   # equal values, two tensors
    tok, _ = gpt_batch(GPTConfig(), 8)
    n = len(calls)
    _compile(tied, (tok,))
    _compile(untied, (tok,))
    assert len(calls) == n + 2
    d = _Scaled(2.0)
    d.hook = lambda: None                          # does not pickle: no digest, no reuse
    _compile(d, (x,))
    _compile(d, (x,))
    assert len(calls) == n + 4


def test_the_profile_is_made_when_read_and_keeps_no_weight_alive():
    """The cost model's profile of a compile (explain's and predict's numbers) is made on first
    read of ``ctx.profile``, equal to the profile of the graph as captured; until then the
    compile keeps a copy of that graph on the meta device, not the model's full-size weights:
    under ZeRO-3 they are freed once the model is dropped, as they are without the profile."""
    import gc
    import weakref
    from autopar.cost.profile import profile
    tok, _ = gpt_batch(GPTConfig(), 8)
    torch.manual_seed(0)
    model = TinyGPT()
    gone = weakref.ref(model.blocks[0].fc.weight)
    dm = autopar.compile(model, autopar.Mesh(dp=2, virtual=True, rank=0), example_inputs=(tok,),
                         plan=autopar.Plan(dp="zero3"))
    assert dm.ctx.profile_source is not None          # not made yet
    del model
    gc.collect()
    assert gone() is None
    torch.manual_seed(0)
    again = TinyGPT()
    ctx = autopar.context.CompileContext(mesh=autopar.Mesh(dp=2, virtual=True, rank=0),
                                         plan=autopar.Plan(dp="zero3"))
    from autopar.capture import capture
    expected = profile(capture(again, (tok,), {}, ctx), ctx, dropout_math=True)
    assert repr(dm.ctx.profile) == repr(expected) and dm.ctx.profile_source is None


@pytest.mark.parametrize("reuse", ["0", "1"])
def test_compiling_planning_and_explaining_warn_nothing_about_torch_code(monkeypatch, reuse):
    """Copying the captured graph (the cost model's profile, a reused export) reconstructs
    torch's deprecated LeafSpec class, and torch warned (FutureWarning) on every compile about
    its own code: a user must not see that. Every warning category is recorded here, not only
    that one; with the export store on, the second and third compiles reuse the first's export."""
    import warnings
    monkeypatch.setenv("AUTOPAR_EXPORT_CACHE", reuse)
    c = GPTConfig()
    x, _ = gpt_batch(c, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for axes, kw in [({"dp": 2}, {"dp": "zero3"}), ({"pp": 2}, {"pp_schedule": "1f1b", "microbatches": 2}),
                         ({"dp": 2, "tp": 2}, {"dp": "zero2", "tp": True, "sp": True})]:
            torch.manual_seed(0)
            dm = autopar.compile(TinyGPT(c), autopar.Mesh(virtual=True, **axes), example_inputs=(x,),
                                 plan=autopar.Plan(**kw))
            dm.predict(cluster="dgx-a100-80gb")   # a preset: "local" needs this machine's calibration
            dm.explain()
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []


def _redefined(sign: float):
    """A module class named ``_Redefined`` in this module, as a notebook cell run again defines it."""
    def forward(self, x):
        return self.fc(x) * sign
    return type("_Redefined", (nn.Module,), {"__module__": __name__, "forward": forward,
                                              "__init__": lambda self: (nn.Module.__init__(self),
                                                                        setattr(self, "fc", nn.Linear(4, 4)))[-1]})


def test_a_class_redefined_under_its_name_is_exported_again_and_the_store_is_off_by_default(monkeypatch):
    """Two classes of one qualified name pickle alike: the class's identity is in the digest, so
    the second one's model, built with the same weights, is exported with its own forward.
    Without AUTOPAR_EXPORT_CACHE a process exports every compile."""
    import sys
    calls = _exports_counted(monkeypatch)
    x = torch.randn(4, 4)
    for sign in (1.0, -1.0):
        monkeypatch.setattr(sys.modules[__name__], "_Redefined", _redefined(sign), raising=False)
        torch.manual_seed(0)
        m = sys.modules[__name__]._Redefined()
        assert torch.allclose(_compile(m, (x,))(x[:2]), m(x[:2]))
    assert len(calls) == 2
    _compile(m, (x,))
    assert len(calls) == 2
    monkeypatch.delenv("AUTOPAR_EXPORT_CACHE")
    _compile(m, (x,))
    _compile(m, (x,))
    assert len(calls) == 4
