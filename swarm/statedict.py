"""Any optimizer's or scheduler's state_dict as JSON plus named tensors, without pickle.

``pack`` walks a state_dict (dicts, lists, tuples, numbers, strings, None, tensors) and returns a
JSON-ready tree in which every tensor is replaced by {"$t": name} and listed in a tensor map (it
goes into the same safetensors blob as the parameters); tuples become {"$tuple": [...]} and dict
keys keep their type ({"$map": [[key, value], ...]} when a key is not a string, as an optimizer's
per-parameter state keyed by int is). ``unpack`` does the reverse on hostile input: depth, size,
key and leaf types are bounded, and every tensor must be referenced exactly once.

``same_shape(ours, theirs)`` is the check a replica makes before loading a downloaded state: the
same keys and value kinds everywhere except where a value is a tensor or a number (those may
differ; tensors are checked by the caller).
"""
from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

MAX_DEPTH = 12
MAX_NODES = 1 << 20
_SCALARS = (bool, int, float, str, type(None))


class StateDictError(ValueError):
    """A packed state_dict is malformed or does not fit (the message says where)."""


def pack(tree: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON tree, {name: tensor}) of a state_dict; tensor names are ``prefix`` + a counter."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise StateDictError("state_dict is nested too deeply to pack")
        if isinstance(x, torch.Tensor):
            name = f"{prefix}{len(tensors)}"
            tensors[name] = x.detach().to("cpu").contiguous()
            return {"$t": name}
        if isinstance(x, float) and not math.isfinite(x):
            return {"$f": repr(x)}
        if isinstance(x, _SCALARS):
            return x
        if isinstance(x, tuple):
            return {"$tuple": [walk(v, depth + 1) for v in x]}
        if isinstance(x, list):
            return [walk(v, depth + 1) for v in x]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: walk(v, depth + 1) for k, v in x.items()}
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in x):
                raise StateDictError("state_dict keys must be strings or ints")
            return {"$map": [[k, walk(v, depth + 1)] for k, v in x.items()]}
        raise StateDictError(f"cannot pack a {type(x).__name__} (only tensors, numbers, strings, None, "
                             "lists, tuples and dicts)")

    return walk(tree, 0), tensors


def unpack(tree: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """The state_dict ``pack`` made; StateDictError on anything it could not have made."""
    used: set[str] = set()
    count = [0]

    def walk(x: Any, depth: int) -> Any:
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            raise StateDictError("packed state_dict is too deep or too large")
        if isinstance(x, _SCALARS):
            return x
        if isinstance(x, list):
            return [walk(v, depth + 1) for v in x]
        if not isinstance(x, dict):
            raise StateDictError(f"unexpected {type(x).__name__} in a packed state_dict")
        if "$t" in x:
            name = x["$t"]
            if len(x) != 1 or not isinstance(name, str) or not name.startswith(prefix) or name not in tensors \
                    or name in used:
                raise StateDictError(f"bad tensor reference {str(name)[:40]!r}")
            used.add(name)
            return tensors[name]
        if "$f" in x:
            if len(x) != 1 or x["$f"] not in ("nan", "inf", "-inf"):
                raise StateDictError("bad non-finite float")
            return float(x["$f"])
        if "$tuple" in x:
            if len(x) != 1 or not isinstance(x["$tuple"], list):
                raise StateDictError("bad tuple")
            return tuple(walk(v, depth + 1) for v in x["$tuple"])
        if "$map" in x:
            if len(x) != 1 or not isinstance(x["$map"], list):
                raise StateDictError("bad map")
            out = {}
            for item in x["$map"]:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
                        and not isinstance(item[0], bool)) or item[0] in out:
                    raise StateDictError("bad map entry")
                out[item[0]] = walk(item[1], depth + 1)
            return out
        if any(k.startswith("$") for k in x):
            raise StateDictError("unknown marker in a packed state_dict")
        return {k: walk(v, depth + 1) for k, v in x.items()}

    out = walk(tree, 0)
    extra = sorted(n for n in tensors if n.startswith(prefix) and n not in used)
    if extra:
        raise StateDictError(f"tensor {extra[0]!r} is not referenced by the state_dict")
    return out


def same_shape(ours: Any, theirs: Any, where: str = "") -> None:
    """Raise StateDictError where ``theirs`` differs from ``ours`` in structure: dict keys, list
    lengths and the kind of every leaf (tensors and numbers may hold other values)."""
    if isinstance(ours, torch.Tensor) or isinstance(theirs, torch.Tensor):
        if not (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor)):
            raise StateDictError(f"{where or 'state'}: a tensor on one side only")
        return
    if isinstance(ours, dict):
        if not isinstance(theirs, dict) or set(ours) != set(theirs):
            diff = sorted(map(str, set(ours) ^ set(theirs or {}))) if isinstance(theirs, dict) else []
            raise StateDictError(f"{where or 'state'}: keys differ {diff[:4]}")
        for k in ours:
            same_shape(ours[k], theirs[k], f"{where}.{k}" if where else str(k))
        return
    if isinstance(ours, (list, tuple)):
        if not isinstance(theirs, (list, tuple)) or len(ours) != len(theirs):
            raise StateDictError(f"{where or 'state'}: lengths differ")
        for i, (a, b) in enumerate(zip(ours, theirs)):
            same_shape(a, b, f"{where}[{i}]")
        return
    number = (int, float)
    if isinstance(ours, number) and not isinstance(ours, bool):
        if isinstance(theirs, bool) or not isinstance(theirs, number):
            raise StateDictError(f"{where or 'state'}: a number on one side only")
        return
    if type(ours) is not type(theirs):
        raise StateDictError(f"{where or 'state'}: {type(ours).__name__} against {type(theirs).__name__}")
    if isinstance(ours, str) and ours != theirs:
        raise StateDictError(f"{where or 'state'}: {ours!r} against {theirs!r}")


def dumps(tree: Any) -> str:
    return json.dumps(tree, separators=(",", ":"), allow_nan=False)


def loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise StateDictError(f"packed state_dict is not JSON: {e}") from None


def safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The __metadata__ map of a safetensors blob (header parsed by hand: 8-byte length + JSON)."""
    if len(blob) < 8:
        raise ValueError("blob shorter than its header length field")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if hlen > len(blob) - 8 or hlen > 1 << 24:
        raise ValueError("header length out of range")
    header = json.loads(blob[8:8 + hlen])
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("metadata is not a string map")
    return meta
