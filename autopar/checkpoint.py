"""Checkpoints beyond one compiled module: to and from plain PyTorch, and to Hugging Face.

``dm.save(path)`` / ``dm.load(path)`` write and read a sharded checkpoint that any plan and
world size loads (``autopar.runtime.checkpoint`` says how). Here, on one process:

- ``to_torch(path, model=None, optimizer=None)``: the checkpoint as full tensors, in PyTorch's
  own formats (a model ``state_dict`` and an optimizer state dict keyed by parameter name, as
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives them); given a plain
  ``nn.Module`` (and its optimizer), loaded into them.
- ``from_torch(model, optimizer, path)``: the other way: a plain model and its optimizer written as
  an autopar checkpoint, which ``dm.load`` reads under any plan.
- ``export_safetensors(path, out)``: the model's weights as one ``model.safetensors`` (and its
  ``config.json`` when the model came from transformers), for ``from_pretrained``, written one
  tensor at a time: memory bounded by the largest tensor, not the model.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_state_dict

from .runtime.checkpoint import (EXTRA, GROUPS, META, MODEL, RNG_KEY, STATE, CheckpointError, Pieces, Resumed,
                                 checkpoint_meta, load_flat, piece_cap, read_metadata, save_state, split_boxes)

__all__ = ["to_torch", "from_torch", "export_safetensors", "CheckpointError", "Resumed"]


def to_torch(path: str, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Read the checkpoint at ``path`` whole, on this process. Returns ``{"model": state_dict,
    "optim": {"state": {name: {...}}, "param_groups": [...]}, "step", "extra", "rng", "meta"}``
    (``optim`` absent when it was saved without an optimizer; tied weights under each of their
    names). With ``model`` (and ``optimizer``, built over ``model.parameters()``), loads them
    into these with ``torch.distributed.checkpoint.state_dict.set_state_dict``."""
    md, meta = read_metadata(path)
    flat = load_flat(path, md=md)
    model_sd = {}
    for key, value in flat.items():
        if key.startswith(MODEL):
            name = key[len(MODEL):]
            model_sd[name] = value
            for alias in meta.get("aliases", {}).get(name, ()):
                model_sd[alias] = value
    out = {"model": model_sd, "step": int(meta.get("step", 0)), "meta": meta, "rng": flat.get(RNG_KEY),
           "extra": {k[len(EXTRA):]: v for k, v in flat.items() if k.startswith(EXTRA)}}
    if GROUPS in flat:
        state: dict[str, dict] = {}
        for key, value in flat.items():
            if key.startswith(STATE):
                name, _, entry = key[len(STATE):].rpartition(".")
                state.setdefault(name, {})[entry] = value
        out["optim"] = {"state": state, "param_groups": flat[GROUPS]}
    if model is not None:
        if optimizer is not None and "optim" not in out:
            raise CheckpointError(f"{path!r} was saved without an optimizer; call to_torch(path, model) alone")
        _check_names(model, model_sd, path)
        set_state_dict(model, [optimizer] if optimizer is not None else [], model_state_dict=model_sd,
                       optim_state_dict=_torch_optim(out["optim"], model) if optimizer is not None else {})
    return out


def _torch_optim(optim: dict, model: nn.Module) -> dict:
    """The optimizer state keyed by the names ``model.named_parameters()`` gives (the first name
    of a tied weight, which is the checkpoint's too)."""
    names = {n for n, _ in model.named_parameters()}
    groups = [{**g, "params": [n for n in g["params"] if n in names]} for g in optim["param_groups"]]
    return {"state": {n: s for n, s in optim["state"].items() if n in names}, "param_groups": groups}


def _check_names(model: nn.Module, model_sd: dict, path: str) -> None:
    want = model.state_dict()
    missing = [k for k in want if k not in model_sd]
    wrong = [f"{k}: {tuple(model_sd[k].shape)} in the checkpoint, {tuple(v.shape)} in the model"
             for k, v in want.items() if k in model_sd and tuple(model_sd[k].shape) != tuple(v.shape)]
    if missing or wrong:
        raise CheckpointError(f"{path!r} is not a checkpoint of this model: " +
                              "; ".join(([f"missing {', '.join(missing[:5])}"] if missing else []) + wrong[:5]))


def _canonical(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """First name -> the other names of the same tensor, parameters then buffers (as compile
    names them)."""
    first: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if id(t) in first:
            aliases[first[id(t)]].append(name)
        else:
            first[id(t)] = name
            aliases[name] = []
    return {k: tuple(v) for k, v in aliases.items()}


def from_torch(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str, *, step: int | None = None,
               extra: dict | None = None) -> None:
    """Write a plain ``model`` and its ``optimizer`` (over ``model``'s parameters; None: the
    model alone) as an autopar checkpoint at ``path``, on this process: ``dm.load(path)`` reads it
    under any plan. The step defaults to the optimizer's; the RNG state is this process's."""
    names = _canonical(model)
    kept = set(model.state_dict())
    sd = {}
    with torch.no_grad():
        named = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
        for name in names:
            if name in kept or any(a in kept for a in names[name]):
                sd[MODEL + name] = named[name].detach()
    meta = checkpoint_meta(mesh="one process", plan="torch", world=1,
                           aliases={k: list(v) for k, v in names.items() if v},
                           model_class=f"{type(model).__module__}.{type(model).__qualname__}")
    if optimizer is not None:
        param_name = {id(p): n for n, p in model.named_parameters()}
        groups = []
        for group in optimizer.param_groups:
            gnames = []
            for p in group["params"]:
                if id(p) not in param_name:
                    raise CheckpointError(f"the optimizer steps a tensor of shape {tuple(p.shape)} that is not a "
                                          "parameter of the model")
                name = param_name[id(p)]
                gnames.append(name)
                for key, value in optimizer.state.get(p, {}).items():
                    sd[f"{STATE}{name}.{key}"] = value.detach() if isinstance(value, torch.Tensor) else value
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": gnames})
        sd[GROUPS] = groups
        meta.update(optimizer=type(optimizer).__name__, groups=[g["params"] for g in groups],
                    step=next((int(float(s["step"])) for s in optimizer.state.values() if "step" in s), 0))
    if step is not None:
        meta["step"] = int(step)
    sd[META] = meta
    sd[RNG_KEY] = {"cpu": torch.get_rng_state()}
    for key, value in (extra or {}).items():
        sd[EXTRA + key] = value
    # stored in pieces, as dm.save stores them: a load's transient memory stays under one tensor
    cap = piece_cap((tuple(v.shape), max(v.element_size(), 4)) for k, v in sd.items() if k.startswith(MODEL))
    for key, value in sd.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            sd[key] = Pieces(value.shape, split_boxes([((0,) * value.dim(), value)], cap), value.dtype)
    save_state(sd, path, no_dist=True)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


def export_safetensors(path: str, out: str, *, prefix: str | None = None) -> list[str]:
    """Write the model of the checkpoint at ``path`` as ``out/model.safetensors`` (and, when the
    model came from transformers, ``out/config.json``), for ``from_pretrained(out)``. Tensors
    are read from the checkpoint and written one at a time, in the safetensors layout (an 8-byte
    header length, a JSON header, then each tensor's bytes): memory stays within the largest
    tensor. ``prefix``: the part of the names to strip (default: the path of the transformers
    module inside the compiled model, e.g. ``"lm."`` for a wrapper; "" when it was the model).
    Tied weights are written once, under their first name, as ``save_pretrained`` does.
    Returns the files written."""
    md, meta = read_metadata(path)
    source = meta.get("model_config")
    if prefix is None:
        prefix = source[0] if source else ""
    keys = [k for k in md.state_dict_metadata if k.startswith(MODEL + prefix)]
    if not keys:
        raise CheckpointError(f"{path!r} holds no model tensor under the prefix {prefix!r}")
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key in keys:
        entry = md.state_dict_metadata[key]
        dtype = entry.properties.dtype
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{key[len(MODEL):]} is {dtype}, which safetensors does not store")
        nbytes = dtype.itemsize * math.prod(entry.size)
        header[key[len(MODEL) + len(prefix):]] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(entry.size),
                                                  "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(out, exist_ok=True)
    files = [os.path.join(out, "model.safetensors")]
    with open(files[0], "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key in keys:
            t = load_flat(path, [key], md)[key]
            if t.numel():
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t
    if source:
        files.append(os.path.join(out, "config.json"))
        with open(files[1], "w") as f:
            f.write(source[1])
    return files
