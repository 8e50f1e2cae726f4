"""The cache of the local preset: this machine's measured cluster, as JSON on disk.

``python -m autopar calibrate`` measures the machine and stores the result here;
``get_cluster("local")`` and everything else only read it. The file is ``$AUTOPAR_CACHE``
(a ``.json`` file, or a directory to hold local_cluster.json), else
~/.cache/autopar/local_cluster.json. An entry is keyed by (hostname, cpu count, torch
version); the file carries a format version, and an entry of another version reads as
missing (until ``python -m autopar calibrate`` measures the machine again).
"""
from __future__ import annotations

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


def _key() -> str:
    """What makes a measurement reusable: same host, same core count, same torch."""
    return f"{socket.gethostname()}|{os.cpu_count()}|{torch.__version__}"


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
    entry = (data.get("entries") or {}).get(_key()) if isinstance(data.get("entries"), dict) else None
    if entry is None:
        return None
    if not isinstance(entry, dict):
        return f"{path}: the entry for this machine ({_key()}) is a {type(entry).__name__}, not a cluster"
    return f"{path}: the entry for this machine ({_key()}) is not a complete cluster description"


def load_local(path: str | None = None) -> Optional[dict]:
    """This machine's entry (``dataclasses.asdict`` of its Cluster), or None."""
    return _read(path or cache_path()).get(_key())


def store_local(entry: dict, path: str | None = None) -> None:
    """Store this machine's entry, atomically (a temporary file renamed over the old one). A
    read-only home keeps it uncached, silently: the caller still has the numbers."""
    path = path or cache_path()
    entries = _read(path)
    entries[_key()] = entry
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"version": FORMAT_VERSION, "entries": entries}, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
