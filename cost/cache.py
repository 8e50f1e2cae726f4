"""The cache of the local preset: this machine's measured cluster, as JSON on disk.

``python -m autopar calibrate`` measures the machine and stores the result here;
``get_cluster("local")`` and everything else only read it. The file is ``$AUTOPAR_CACHE``
(a ``.json`` file, or a directory to hold local_cluster.json), else
~/.cache/autopar/local_cluster.json. An entry is keyed by (hostname, cpu count, torch
version, the calibration's code): the last is a digest of the sources that measure and fit
the preset (``cost/calibration/`` and ``cost/cluster.py``), so a preset that other code
measured, before a change to how a field is fitted, reads as missing (until ``python -m
autopar calibrate`` measures the machine again) and is named as such by ``problem``. The file
also carries a format version, and a file of another version reads as empty.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import Optional

import torch

__all__ = ["cache_path", "load_local", "store_local", "problem"]

FORMAT_VERSION = 41


def cache_path() -> str:
    """Where the local preset is cached (see the module docstring)."""
    env = os.environ.get("AUTOPAR_CACHE")
    if env:
        return env if env.endswith(".json") else os.path.join(env, "local_cluster.json")
    return os.path.join(os.path.expanduser("~"), ".cache", "autopar", "local_cluster.json")


_CODE: list = []        # [digest] once computed


def code_digest() -> str:
    """A digest of the code that measures and fits the local preset: the sources of
    ``cost/calibration/``, ``cost/cluster.py`` and ``cost/hardware.py`` (12 hex digits)."""
    if not _CODE:
        here = os.path.dirname(os.path.abspath(__file__))
        calib = os.path.join(here, "calibration")
        files = [os.path.join(here, "cluster.py"), os.path.join(here, "hardware.py")] + sorted(
            os.path.join(calib, f) for f in os.listdir(calib) if f.endswith(".py"))
        h = hashlib.sha256()
        for path in files:
            h.update(os.path.basename(path).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
        _CODE.append(h.hexdigest()[:12])
    return _CODE[0]


def _machine() -> str:
    return f"{socket.gethostname()}|{os.cpu_count()}|{torch.__version__}"


def _key() -> str:
    """What makes a measurement reusable: same host, same core count, same torch, and the same
    calibration code."""
    return f"{_machine()}|{code_digest()}"


def _read(path: str) -> dict:
    """The file's entries (key -> cluster as a dict); empty if missing, unreadable or of
    another format version."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def problem(path: str | None = None) -> Optional[str]:
    """Why the cache at ``path`` gives no entry for this machine although the file exists
    (corrupt JSON, another format, a malformed entry); None when it is missing or fine."""
    path = path or cache_path()
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    except ValueError as exc:
        return f"{path} is not valid JSON ({exc})"
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        return f"{path} has format version {found!r}, this autopar reads {FORMAT_VERSION!r}"
    entries = data.get("entries") if isinstance(data.get("entries"), dict) else {}
    entry = entries.get(_key())
    if entry is None:
        others = [k for k in entries if k.rsplit("|", 1)[0] == _machine()]
        if others:
            return (f"{path} holds this machine's preset as other calibration code measured it "
                    f"({others[0].rsplit('|', 1)[1]}; this autopar's is {code_digest()}): how a "
                    "field is measured or fitted has changed since")
        return None
    if not isinstance(entry, dict):
        return f"{path}: the entry for this machine ({_key()}) is a {type(entry).__name__}, not a cluster"
    return f"{path}: the entry for this machine ({_key()}) is not a complete cluster description"


def load_local(path: str | None = None) -> Optional[dict]:
    """This machine's entry (``dataclasses.asdict`` of its Cluster), or None."""
    return _read(path or cache_path()).get(_key())


def store_local(entry: dict, path: str | None = None) -> None:
    """Store this machine's entry, atomically (a temporary file renamed over the old one), in
    place of any other code's entry for it. A read-only home keeps it uncached, silently: the
    caller still has the numbers."""
    path = path or cache_path()
    entries = {k: v for k, v in _read(path).items() if k.rsplit("|", 1)[0] != _machine()}
    entries[_key()] = entry
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"version": FORMAT_VERSION, "entries": entries}, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
