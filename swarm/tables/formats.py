"""Wire formats of the sharded tables, and their hostile-input decoders (sans-I/O).

    pull request    msgpack  {"v": 1, "view": str, "dtype": str, "ids": {table: bin (uint32 LE)}
                              [, "tags": {table: bin (uint32 LE), one per id: the tag of the row the
                                 asker holds, 0 for none}]}
    rows reply      safetensors: one tensor per table of the request, [len(ids), dim], in the asked dtype;
                    for a table the request tagged, only the rows whose tag changed, [n_changed, dim],
                    and "<table>.same" U8 [ceil(len(ids) / 8)]: bit i (little-endian bit order) set when
                    row i is left out because its tag is the asker's (see row_tags)
    push            safetensors: "<table>.ids" I32 [k], "<table>.g" F32/F16/BF16/I8/U8 (int4) [k, dim]; meta v, view, key

int8 ("int8" on the wire) is a tensor of I8 values plus "<name>.scale" F32 [rows]: one power-of-two scale
per row (see quantize), so that re-quantizing what was decoded gives back the same bytes. int4 is the
same with values in -7..7, two per byte: U8 [rows, ceil(dim / 2)], column 2j in the low nibble, 2j+1 in the
high one, each a 4-bit two's complement.
    replica update  safetensors: "ids" I32 [k], "rows" F32 [k, dim], state F32 [k, dim], "step" I64 [k];
                    meta v, table, view, key
    slot hand-off   safetensors: "rows" F32 [n, dim], state F32 [n, dim], "step" I64 [n]; meta v, table, slot, view
(state: the optimizer's state_keys, "m" and "v" for Adam; a per-row key of a row-wise kind, "v_row" or
"acc_row", is F32 [k] / [n].)

The safetensors container is parsed here, not by the safetensors library, so that every field is
checked (exact keys, dtypes, shapes, offsets that tile the data exactly) before anything is allocated.
Every decoder raises only WireError (a ValueError) with a reason. docs/tables.md has the byte layout.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import msgpack
import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

from .ownership import OwnershipMap, TableSpec
from .shard import KINDS, all_finite, state_keys, state_shape

__all__ = ["WireError", "DTYPES", "quantize", "dequantize", "roundtrip", "row_tags", "PullRequest", "PushRequest", "Replay", "encode_replays", "decode_replays",
           "encode_replay_reply", "stale_rows",
           "encode_pull", "decode_pull", "encode_rows",
           "decode_rows", "decode_rows_tagged", "encode_push", "decode_push", "encode_replica", "decode_replica", "encode_slot",
           "decode_slot"]

VERSION = 1
DTYPES = {"fp32", "fp16", "bf16", "int8", "int4"}
MAX_HEADER = 1 << 16          # safetensors JSON header; ours are a few hundred bytes
MAX_KEY = 256
_VIEW_RE = re.compile(r"[0-9a-f]{16}")
_KEY_RE = re.compile(r"[^\s]{1,200}:(0|[1-9][0-9]{0,18})")
REPLICA_MODES = ("heal", "catch-up")  # a replica update's: overwrite, or only rows with fewer updates
_INT_RE = re.compile(r"0|[1-9][0-9]{0,9}")
_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_ST_NAME = {"fp32": "F32", "fp16": "F16", "bf16": "BF16", "int8": "I8", "int4": "U8"}
_ST = {"F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2), "I8": ("<i1", 1), "U8": ("<u1", 1),
       "I32": ("<i4", 4), "I64": ("<i8", 8)}
_QMAX = {"int8": 127, "int4": 7}
_SCALED = ("I8", "U8")  # stored dtypes that come with a ".scale" tensor (int8, int4)
_FLOATS = ("F32", "F16", "BF16")
_KINDS = KINDS


class WireError(ValueError):
    """Malformed or invalid table message."""


@dataclass
class PullRequest:
    view: str
    dtype: str
    ids: dict[str, np.ndarray]  # table -> sorted-unique row ids (decoded: int64)
    # table -> uint32 per id: row_tags of the row the asker holds (0: none); the reply leaves out
    # the rows whose tag is still that (a table not here: every row is sent)
    tags: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class PushRequest:
    view: str
    key: str                            # idempotency key "peer:step"
    ids: dict[str, np.ndarray]          # table -> sorted-unique row ids (decoded: int64)
    grads: dict[str, torch.Tensor]      # table -> fp32 [len(ids), dim]


def _guard(fn):
    """Decoders raise WireError and nothing else, whatever the bytes."""
    def wrapped(*a, **kw):
        try:
            return fn(*a, **kw)
        except WireError:
            raise
        except Exception as e:  # numpy / msgpack / json / unicode / recursion errors on hostile bytes
            raise WireError(f"malformed message: {type(e).__name__}: {str(e)[:200]}") from e
    wrapped.__name__, wrapped.__doc__ = fn.__name__, fn.__doc__
    return wrapped


# ----------------------------------------------------------------------------- checks

def _check_view(view) -> str:
    if not isinstance(view, str) or not _VIEW_RE.fullmatch(view):
        raise WireError(f"view must be 16 lowercase hex chars, got {str(view)[:40]!r}")
    return view


def _check_key(key) -> str:
    if not isinstance(key, str) or len(key) > MAX_KEY or not _KEY_RE.fullmatch(key):
        raise WireError(f"key must be 'peer:step' (no whitespace, step a decimal), got {str(key)[:60]!r}")
    return key


def _check_mode(mode) -> str:
    if not isinstance(mode, str) or mode not in REPLICA_MODES:
        raise WireError(f"replica mode must be one of {list(REPLICA_MODES)}, got {str(mode)[:20]!r}")
    return mode


def _check_dtype(dtype) -> str:
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise WireError(f"dtype must be one of {sorted(DTYPES)}, got {str(dtype)[:20]!r}")
    return dtype


def _spec(tables: Mapping[str, TableSpec], name) -> TableSpec:
    if not isinstance(name, str) or name not in tables:
        raise WireError(f"unknown table {str(name)[:60]!r}")
    return tables[name]


def _check_ids(ids: np.ndarray, rows: int, what: str) -> np.ndarray:
    """Strictly increasing, in [0, rows); returns int64."""
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (int(ids[0]) < 0 or int(ids[-1]) >= rows):
        raise WireError(f"{what}: ids outside [0, {rows})")
    if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
        raise WireError(f"{what}: ids must be strictly increasing")
    return ids


def _ids_in(ids, rows: int, what: str) -> np.ndarray:
    """Encoder side: any integer array -> validated int64."""
    if isinstance(ids, torch.Tensor):
        ids = ids.numpy()
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise WireError(f"{what}: ids must be a 1-D integer array")
    return _check_ids(ids, rows, what)


def _finite(t: torch.Tensor, what: str) -> None:
    if t.numel() and not all_finite(t.float()):  # (fp32: an fp16 sum of finite values overflows early)
        raise WireError(f"{what} has non-finite values")


def _meta(meta: dict, want: set[str]) -> None:
    if set(meta) != want:
        raise WireError(f"metadata keys must be {sorted(want)}, got {sorted(meta)[:8]}")
    if meta["v"] != str(VERSION):
        raise WireError(f"unsupported version {meta['v'][:10]!r}, expected {VERSION}")


def _tables(tables) -> Mapping[str, TableSpec]:
    return tables.tables if isinstance(tables, OwnershipMap) else tables


# ----------------------------------------------------------------------------- safetensors container

def _no_dupes(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise WireError("duplicate key in safetensors header")
    return d


class _Blob:
    """A parsed, structurally validated safetensors blob: metadata + tensor table of contents."""

    def __init__(self, data):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise WireError(f"payload must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < 8:
            raise WireError(f"truncated: {len(data)} bytes, no safetensors header")
        hlen = int.from_bytes(data[:8], "little")
        if hlen > MAX_HEADER:
            raise WireError(f"safetensors header of {hlen} bytes exceeds {MAX_HEADER}")
        if 8 + hlen > len(data):
            raise WireError("truncated: header runs past the end")
        header = json.loads(data[8:8 + hlen].decode("utf-8"), object_pairs_hook=_no_dupes)
        if not isinstance(header, dict):
            raise WireError("safetensors header is not a JSON object")
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict) or not all(isinstance(v, str) and len(v) <= 1024 for v in meta.values()):
            raise WireError("metadata must map strings to strings")
        start, body = 8 + hlen, len(data) - 8 - hlen
        entries, spans = {}, []
        for name, e in header.items():
            if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
                raise WireError(f"tensor {name[:60]!r}: entry must have exactly dtype, shape, data_offsets")
            dt, shape, off = e["dtype"], e["shape"], e["data_offsets"]
            if dt not in _ST:
                raise WireError(f"tensor {name[:60]!r}: dtype {str(dt)[:10]!r} not allowed")
            if (not isinstance(shape, list) or len(shape) > 4
                    or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)):
                raise WireError(f"tensor {name[:60]!r}: bad shape")
            if not isinstance(off, list) or len(off) != 2 or not all(type(o) is int for o in off):
                raise WireError(f"tensor {name[:60]!r}: bad data_offsets")
            a, b = off
            if not 0 <= a <= b <= body or b - a != math.prod(shape) * _ST[dt][1]:
                raise WireError(f"tensor {name[:60]!r}: data_offsets {off} do not fit shape {shape} {dt}")
            spans.append((a, b))
            entries[name] = (dt, tuple(shape), start + a)
        pos = 0
        for a, b in sorted(spans):
            if a != pos:
                raise WireError("tensor data overlaps or leaves gaps")
            pos = b
        if pos != body:
            raise WireError(f"{body - pos} trailing bytes after the tensor data")
        self.data, self.meta, self.entries = data, meta, entries

    def names(self, want: set[str]) -> None:
        if set(self.entries) != want:
            raise WireError(f"tensors must be {sorted(want)[:8]}, got {sorted(self.entries)[:8]}")

    def _entry(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> tuple[str, int]:
        """(stored dtype, offset) of ``name``, refused unless its dtype is one of ``dtypes`` and its
        shape is exactly ``shape``."""
        dt, shp, off = self.entries[name]
        if dt not in dtypes:
            raise WireError(f"tensor {name[:60]!r}: dtype {dt}, expected one of {dtypes}")
        if shp != tuple(shape):
            raise WireError(f"tensor {name[:60]!r}: shape {list(shp)}, expected {list(shape)}")
        return dt, off

    def get(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """fp32 for float dtypes, int64 for integer ones."""
        dt, off = self._entry(name, dtypes, shape)
        n = math.prod(shape)
        if dt in _FLOATS:
            if n == 0:
                return torch.zeros(shape, dtype=torch.float32)
            arr = np.frombuffer(self.data, _ST[dt][0], n, off)
            if dt == "BF16":
                arr = (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)
            return torch.from_numpy(arr.astype(np.float32).reshape(shape))
        if n == 0:
            return torch.zeros(shape, dtype=torch.int64)
        return torch.from_numpy(np.frombuffer(self.data, _ST[dt][0], n, off).astype(np.int64).reshape(shape))

    def raw(self, name: str, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """An integer tensor as stored (I8 -> int8, U8 -> uint8), not widened: the quantized rows."""
        dt, off = self._entry(name, (dtype,), shape)
        arr = np.frombuffer(self.data, _ST[dt][0], math.prod(shape), off).reshape(shape)
        return torch.from_numpy(arr.copy())  # (frombuffer is read-only)


def _save(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> bytes:
    """The same safetensors bytes either way; through numpy it costs a quarter (no per-tensor ctypes
    round trip), but numpy has no bfloat16."""
    if any(v.dtype == torch.bfloat16 for v in tensors.values()):
        # (clone: safetensors.torch refuses views that share storage, like slices of one tensor)
        return safetensors.torch.save({k: v.detach().contiguous().clone() for k, v in tensors.items()}, metadata=meta)
    return safetensors.numpy.save({k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in tensors.items()},
                                  metadata=meta)


def _cast(t: torch.Tensor, dtype: str, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise WireError(f"{what} must be a float tensor")
    out = t.detach().to("cpu", _TORCH[dtype])
    _finite(out, f"{what} (as {dtype})")
    return out


def quantize(x: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` [n, d] as integers in [-qmax, qmax] (int8) and one scale per row, a power of
    two with max|row| / scale in (qmax / 2, qmax]. Powers of two make the round trip exact:
    dequantized values q * scale are exact in fp32, and quantizing them again gives the same
    (q, scale), which is what lets a primary replay a quantized push to its replicas in the same
    dtype and keep them bit-identical."""
    x = x.detach().to("cpu", torch.float32)
    amax = x.abs().amax(dim=1) if x.shape[0] and x.shape[1] else torch.zeros(x.shape[0])
    mant, exp = torch.frexp(amax / qmax)  # amax / qmax = mant * 2**exp, mant in [0.5, 1)
    exp = torch.where(mant > 0.5, exp, exp - 1).clamp(min=-126, max=127)
    scale = torch.ldexp(torch.ones_like(amax), exp)
    # x * 2**-e is exactly x / 2**e (a power of two), and cheaper; 2**-e is finite for e >= -126
    q = torch.round(x * torch.ldexp(torch.ones_like(amax), -exp)[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32, copy=True).mul_(scale[:, None])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [n, d] in -8..7 -> uint8 [n, ceil(d / 2)]: column 2j in the low nibble, 2j+1 in the high."""
    if q.shape[1] % 2:
        q = torch.cat([q, torch.zeros(q.shape[0], 1, dtype=q.dtype)], dim=1)
    u = q.view(torch.uint8)  # two's complement: the low nibble is the value's 4-bit pattern
    return (u[:, 0::2] & 0xF) | (u[:, 1::2] << 4)


def unpack_int4(p: torch.Tensor, d: int) -> torch.Tensor:
    """pack_int4's inverse: uint8 [n, ceil(d / 2)] -> int8 [n, d] (nibbles sign-extended)."""
    v = p.to(torch.uint8).view(torch.int8)
    lo = torch.bitwise_right_shift(torch.bitwise_left_shift(v, 4), 4)  # arithmetic: sign-extends
    hi = torch.bitwise_right_shift(v, 4)
    return torch.stack([lo, hi], dim=2).reshape(p.shape[0], 2 * p.shape[1])[:, :d]


def roundtrip(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 values of ``x`` as a receiver decodes them after sending them in ``dtype``."""
    _check_dtype(dtype)
    if dtype in _QMAX:
        return dequantize(*quantize(x, _QMAX[dtype]))
    return x.detach().to("cpu", _TORCH[dtype]).to(torch.float32)


_TAG_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection mod 2**64
_TAG_MIX = np.uint64(0xBF58476D1CE4E5B9)


def row_tags(rows: torch.Tensor, dtype: str) -> np.ndarray:
    """uint32 [n], never 0: a hash of each row's bytes as ``dtype`` puts them on the wire (int8 and
    int4: the quantized values and the scale). Two rows with the same tag decode, with all but a
    2**-32 chance, to the same fp32 values; and since re-encoding what was decoded gives back the
    same bytes (quantize), the asker computes the tag of a row it pulled from the decoded row, as
    its owner does from the stored one. A pull carries the tags of the rows the asker holds, so an
    owner leaves out the rows that did not change (docs/tables.md, "Conditional pulls")."""
    _check_dtype(dtype)
    x = rows.detach().to("cpu", torch.float32)
    if dtype in _QMAX:
        q, scale = quantize(x, _QMAX[dtype])
        return _wire_tags(pack_int4(q) if dtype == "int4" else q, scale)
    return _wire_tags(x.to(_TORCH[dtype]), None)


def _wire_tags(values: torch.Tensor, scale: torch.Tensor | None) -> np.ndarray:
    """row_tags from a row's bytes as they are on the wire: ``values`` [n, w] in the wire's dtype
    (int8, int4 packed two to a byte, fp16, bf16, fp32) and, for int8 / int4, its ``scale`` [n]. Both
    ends of a pull hash these bytes where they have them (the owner as it encodes, the asker as it
    decodes), so a row is quantized once, not again for its tag."""
    n = values.shape[0]
    if n == 0:  # (a reply whose rows were all left out: nothing came to hash)
        return np.zeros(0, np.uint32)
    v = values.view(torch.int16) if values.dtype == torch.bfloat16 else values  # numpy has no bf16
    parts = [np.ascontiguousarray(v.numpy()).view(np.uint8).reshape(n, v.shape[1] * v.element_size())]
    if scale is not None:
        parts.append(np.ascontiguousarray(scale.to(torch.float32).numpy()).view(np.uint8).reshape(n, 4))
    width = sum(p.shape[1] for p in parts)
    pad = np.zeros((n, -width % 8), np.uint8)
    words = np.ascontiguousarray(np.concatenate(parts + [pad], axis=1)).view("<u8")
    h = np.full(n, 0x243F6A8885A308D3, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(words.shape[1]):  # a word at a time, mixed (multiply, then shift down)
            h = (h ^ words[:, j]) * _TAG_MUL
            h ^= h >> np.uint64(31)
        h = (h ^ (h >> np.uint64(30))) * _TAG_MIX
    tags = (h >> np.uint64(32)).astype(np.uint32)
    tags[tags == 0] = 1  # 0 means "holds none"
    return tags


def _put(out: dict[str, torch.Tensor], name: str, t: torch.Tensor, dtype: str, what: str) -> None:
    """Write float rows ``t`` as ``name`` in ``dtype`` (int8, int4: plus ``name.scale``)."""
    _store(out, name, *_as_wire(t, dtype, what))


def _store(out: dict[str, torch.Tensor], name: str, values: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Rows already in their wire dtype (_as_wire) as ``name`` (and ``name.scale`` for int8 / int4)."""
    out[name] = values
    if scale is not None:
        out[name + ".scale"] = scale


def _as_wire(t: torch.Tensor, dtype: str, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float rows ``t`` as ``dtype`` puts them on the wire: (values, and for int8 / int4 the scale
    per row; None for the others), finite."""
    if dtype not in _QMAX:
        return _cast(t, dtype, what), None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2:
        raise WireError(f"{what} must be a 2-D float tensor")
    _finite(t, what)
    q, scale = quantize(t, _QMAX[dtype])
    return (pack_int4(q) if dtype == "int4" else q), scale


def _take(blob: "_Blob", name: str, dtypes: tuple[str, ...], shape: tuple[int, int], what: str) -> torch.Tensor:
    """Read float rows ``name`` (int8 / int4: with ``name.scale``, positive and finite) as fp32, finite."""
    return _take_wire(blob, name, dtypes, shape, what)[0]


def _take_wire(blob: "_Blob", name: str, dtypes: tuple[str, ...], shape: tuple[int, int], what: str
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """_take, and the int8 / int4 rows as they were on the wire: (fp32 rows, values, scale); values
    and scale are None for the other dtypes."""
    stored = blob.entries[name][0] if name in blob.entries else ""
    if stored in _SCALED and stored in dtypes:
        if name + ".scale" not in blob.entries:
            raise WireError(f"{stored} tensor {name[:60]!r} needs {name[:60]!r}.scale")
        if stored == "U8":
            values = blob.raw(name, "U8", (shape[0], (shape[1] + 1) // 2))
            q = unpack_int4(values, shape[1])
        else:
            values = q = blob.raw(name, "I8", shape)
        scale = blob.get(name + ".scale", ("F32",), (shape[0],))
        if scale.numel() and not bool((torch.isfinite(scale) & (scale > 0)).all()):
            raise WireError(f"{what}: scales must be finite and positive")
        out = dequantize(q, scale)
        _finite(out, what)
        return out, values, scale
    out = blob.get(name, tuple(d for d in dtypes if d not in _SCALED), shape)
    _finite(out, what)
    return out, None, None


def _int8_names(names: set[str], dtype_of: dict[str, str]) -> set[str]:
    """The names a blob holds for these tensors: each int8 / int4 one brings its scale."""
    return names | {n + ".scale" for n in names if dtype_of.get(n) in _SCALED}


# ----------------------------------------------------------------------------- pull

def encode_pull(req: PullRequest) -> bytes:
    _check_view(req.view)
    _check_dtype(req.dtype)
    ids = {}
    for t, a in req.ids.items():
        if not isinstance(t, str):
            raise WireError("table names must be strings")
        ids[t] = _ids_in(a, 1 << 32, f"pull {t!r}").astype("<u4").tobytes()
    msg = {"v": VERSION, "view": req.view, "dtype": req.dtype, "ids": ids}
    tags = {}
    for t, a in req.tags.items():
        a = np.asarray(a)
        if t not in ids or a.ndim != 1 or a.dtype.kind not in "iu" or len(a) * 4 != len(ids[t]):
            raise WireError(f"tags of {str(t)[:60]!r} must be one integer per id of that table")
        if a.any():  # all zero: nothing held, nothing to say
            tags[t] = a.astype("<u4").tobytes()
    if tags:
        msg["tags"] = tags
    return msgpack.packb(msg, use_bin_type=True)


@_guard
def decode_pull(data: bytes, tables: Mapping[str, TableSpec], max_ids: int) -> PullRequest:
    """Decode a pull request: known tables only, ids strictly increasing and < rows, at most
    max_ids ids in total, a 16-hex view, a known dtype, tags (if any) one per id of a table the
    request asks rows of, no extra keys."""
    tables = _tables(tables)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"payload must be bytes, got {type(data).__name__}")
    cap = 1024 + 8 * max_ids + 64 * len(tables) + 2 * sum(len(t) for t in tables)
    if len(data) > cap:
        raise WireError(f"pull request of {len(data)} bytes exceeds {cap} for max_ids={max_ids}")
    msg = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True,
                          max_bin_len=4 * max_ids, max_str_len=1024, max_array_len=0,
                          max_map_len=max(5, len(tables)), max_ext_len=0)
    if not isinstance(msg, dict) or set(msg) - {"tags"} != {"v", "view", "dtype", "ids"}:
        raise WireError("pull request must be a map with exactly v, view, dtype, ids (and tags)")
    if type(msg["v"]) is not int or msg["v"] != VERSION:
        raise WireError(f"unsupported version {str(msg['v'])[:10]!r}")
    view, dtype = _check_view(msg["view"]), _check_dtype(msg["dtype"])
    if not isinstance(msg["ids"], dict):
        raise WireError("ids must be a map table -> bin")
    out, total = {}, 0
    for t, b in msg["ids"].items():
        spec = _spec(tables, t)
        if not isinstance(b, bytes) or len(b) % 4:
            raise WireError(f"ids of {t!r} must be bin of uint32 (length a multiple of 4)")
        total += len(b) // 4
        if total > max_ids:
            raise WireError(f"more than max_ids={max_ids} ids")
        out[t] = _check_ids(np.frombuffer(b, "<u4"), spec.rows, f"pull {t!r}")
    tags = {}
    if "tags" in msg:
        if not isinstance(msg["tags"], dict):
            raise WireError("tags must be a map table -> bin")
        for t, b in msg["tags"].items():
            if not isinstance(t, str) or t not in out:
                raise WireError(f"tags of {str(t)[:60]!r}, a table the request asks no rows of")
            if not isinstance(b, bytes) or len(b) != 4 * len(out[t]):
                raise WireError(f"tags of {t!r} must be bin of one uint32 per id ({4 * len(out[t])} bytes)")
            tags[t] = np.frombuffer(b, "<u4").copy()
    return PullRequest(view, dtype, out, tags)


# ----------------------------------------------------------------------------- rows reply

def encode_rows(tables_in_order: list[tuple[str, torch.Tensor]], dtype: str,
                tags: Mapping[str, np.ndarray] | None = None) -> bytes:
    """One tensor per table, named by the table, cast to dtype (finite after the cast). ``tags``
    (a request's): for a table in it, the rows whose row_tags equal the asker's are left out and
    "<table>.same" marks them."""
    _check_dtype(dtype)
    out = {}
    for name, rows in tables_in_order:
        if name in out:
            raise WireError(f"table {name!r} twice")
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
            raise WireError(f"rows of {name!r} must be a 2-D tensor")
        held = (tags or {}).get(name)
        if held is not None and len(held) != rows.shape[0]:
            raise WireError(f"tags of {name!r}: {len(held)} for {rows.shape[0]} rows")
        values, scale = _as_wire(rows, dtype, f"rows of {name!r}")  # quantized once, tags or not
        if held is not None:
            same = (held != 0) & (_wire_tags(values, scale) == held)
            out[name + ".same"] = torch.from_numpy(np.packbits(same, bitorder="little"))
            keep = torch.from_numpy(~same)
            values, scale = values[keep], (None if scale is None else scale[keep])
        _store(out, name, values, scale)
    return _save(out, {"v": str(VERSION)})


@_guard
def decode_rows(data: bytes, req: PullRequest, dim_of: Mapping[str, int],
                held: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The reply to `req`: exactly its tables, each [len(ids), dim] in req.dtype, finite; returns fp32.
    For a table ``req`` tagged, the reply's rows are those not marked same, and a row marked same
    (only where the request had a tag) is taken from ``held`` (fp32 [len(ids), dim], the asker's
    rows, aligned with the ids)."""
    return _decode_rows(data, req, dim_of, held, with_tags=False)[0]


@_guard
def decode_rows_tagged(data: bytes, req: PullRequest, dim_of: Mapping[str, int],
                       held: Mapping[str, torch.Tensor] | None = None
                       ) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """decode_rows, and the row_tags of every row it returns (what the asker holds from now on and
    tags its next pull with): a row marked same keeps the request's tag, a fresh one is hashed from
    its bytes as they came, which is row_tags of the decoded row without quantizing it again."""
    return _decode_rows(data, req, dim_of, held, with_tags=True)


def _decode_rows(data: bytes, req: PullRequest, dim_of: Mapping[str, int],
                 held: Mapping[str, torch.Tensor] | None, with_tags: bool
                 ) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    blob = _Blob(data)
    _meta(blob.meta, {"v"})
    tagged = {t for t in req.tags if t in req.ids}
    blob.names(_int8_names(set(req.ids), {t: _ST_NAME[req.dtype] for t in req.ids}) | {t + ".same" for t in tagged})
    out, tags = {}, {}

    def take(t: str, n: int, dim: int) -> tuple[torch.Tensor, np.ndarray | None]:
        rows, values, scale = _take_wire(blob, t, (_ST_NAME[req.dtype],), (n, dim), f"rows of {t!r}")
        if not with_tags:
            return rows, None
        return rows, (_wire_tags(values, scale) if values is not None else row_tags(rows, req.dtype))

    for t, ids in req.ids.items():
        if t not in dim_of:
            raise WireError(f"no dim known for table {t!r}")
        n, dim = len(ids), int(dim_of[t])
        if t not in tagged:
            out[t], fresh_tags = take(t, n, dim)
            if with_tags:
                tags[t] = fresh_tags
            continue
        bits = blob.raw(t + ".same", "U8", ((n + 7) // 8,)).numpy()
        flags = np.unpackbits(bits, bitorder="little")
        if flags[n:].any():
            raise WireError(f"{t}.same: bits set past the {n} rows")
        same = flags[:n].astype(bool)
        if (same & (req.tags[t] == 0)).any():
            raise WireError(f"{t}.same marks a row the request held none of")
        fresh, fresh_tags = take(t, n - int(same.sum()), dim)
        if held is None or t not in held or tuple(held[t].shape) != (n, dim):
            raise ValueError(f"rows of {t!r}: the held rows [{n}, {dim}] a tagged request needs")
        rows = held[t].to(torch.float32, copy=True)
        rows[torch.from_numpy(~same)] = fresh
        out[t] = rows
        if with_tags:
            all_tags = np.asarray(req.tags[t], np.uint32).copy()
            all_tags[~same] = fresh_tags
            tags[t] = all_tags
    return out, tags


# ----------------------------------------------------------------------------- push

def encode_push(req: PushRequest, dtype: str = "fp32") -> bytes:
    _check_view(req.view)
    _check_key(req.key)
    _check_dtype(dtype)
    if set(req.ids) != set(req.grads):
        raise WireError("push ids and grads must name the same tables")
    out = {}
    for t, ids in req.ids.items():
        ids = _ids_in(ids, 1 << 31, f"push {t!r}")
        g = req.grads[t]
        if not isinstance(g, torch.Tensor) or g.dim() != 2 or g.shape[0] != ids.size:
            raise WireError(f"grads of {t!r} must be [len(ids), dim]")
        out[f"{t}.ids"] = torch.from_numpy(ids.astype(np.int32))
        _put(out, f"{t}.g", g, dtype, f"grads of {t!r}")
    return _save(out, {"v": str(VERSION), "view": req.view, "key": req.key})


def _per_table(blob: "_Blob", tables: Mapping[str, TableSpec], extra: tuple[str, ...], max_ids: int,
               what: str) -> list[tuple[TableSpec, np.ndarray]]:
    """The tables of a push or replay blob: each is named by exactly "<t>.ids", "<t>.g" (plus
    "<t>.g.scale" when int8 / int4) and the ``extra`` parts; ids are I32, strictly increasing,
    < rows, at most max_ids over all tables. Returns (spec, ids) per table, in the blob's order."""
    allowed = {"ids", "g", "g.scale", *extra}
    names: dict[str, set[str]] = {}
    for n in blob.entries:
        t, part = (n[:-len(".g.scale")], "g.scale") if n.endswith(".g.scale") else n.rpartition(".")[::2]
        if part not in allowed:
            raise WireError(f"unexpected tensor {n[:60]!r}")
        _spec(tables, t)
        names.setdefault(t, set()).add(part)
    out, total = [], 0
    for t, parts in names.items():
        scaled = blob.entries.get(f"{t}.g", ("",))[0] in _SCALED
        if parts != {"ids", "g", *extra} | ({"g.scale"} if scaled else set()):
            others = "".join(f", {t}.{p}" for p in extra)
            raise WireError(f"table {t!r} needs {t}.ids, {t}.g{others} (and {t}.g.scale when int8/int4), nothing else")
        _, shp, _ = blob.entries[f"{t}.ids"]
        if len(shp) != 1:
            raise WireError(f"{t}.ids must be 1-D")
        total += shp[0]
        if total > max_ids:
            raise WireError(f"more than max_ids={max_ids} ids")
        out.append((tables[t], _check_ids(blob.get(f"{t}.ids", ("I32",), shp).numpy(), tables[t].rows, f"{what} {t!r}")))
    return out


@_guard
def decode_push(data: bytes, tables: Mapping[str, TableSpec], max_ids: int) -> PushRequest:
    """Known tables, both "<t>.ids" and "<t>.g" per table, ids strictly increasing < rows, at most
    max_ids in total, grads [len(ids), dim] F32/F16/BF16 and finite; returns fp32 grads."""
    tables = _tables(tables)
    blob = _Blob(data)
    _meta(blob.meta, {"v", "view", "key"})
    view, key = _check_view(blob.meta["view"]), _check_key(blob.meta["key"])
    ids, grads = {}, {}
    for spec, t_ids in _per_table(blob, tables, (), max_ids, "push"):
        ids[spec.name] = t_ids
        grads[spec.name] = _take(blob, f"{spec.name}.g", (*_FLOATS, *_SCALED), (len(t_ids), spec.dim),
                                 f"grads of {spec.name!r}")
    return PushRequest(view, key, ids, grads)


# ----------------------------------------------------------------------------- replica update / slot hand-off

def _kind_of(names: set[str], fixed: set[str], kind: str | None) -> str:
    kinds = [kind] if kind is not None else list(_KINDS)
    for k in kinds:
        if names == fixed | set(state_keys(k)):
            return k
    raise WireError(f"tensors {sorted(names)[:8]} do not match the {' or '.join(kinds)} state")


def _check_state(out: dict[str, torch.Tensor], kind: str, what: str) -> None:
    for k in ("rows", *state_keys(kind)):
        _finite(out[k], f"{what} {k!r}")
        if k not in ("rows", "m") and out[k].numel() and bool((out[k] < 0).any()):
            raise WireError(f"{what} {k!r} has negative values")
    if out["step"].numel() and int(out["step"].min()) < 0:
        raise WireError(f"{what} 'step' has negative values")


def _state_tensors(tensors: dict[str, torch.Tensor], fixed: set[str], n: int | None, dim: int,
                   what: str) -> tuple[dict[str, torch.Tensor], int]:
    if not isinstance(tensors, dict):
        raise WireError(f"{what} must be a dict of tensors")
    kind = _kind_of(set(tensors), fixed, None)
    rows = tensors["rows"]
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != dim:
        raise WireError(f"{what} rows must be [n, {dim}]")
    n = rows.shape[0] if n is None else n
    out = {}
    for k in ("rows", *state_keys(kind)):
        v, shape = tensors[k], state_shape(k, n, dim)
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != torch.float32:
            raise WireError(f"{what} {k!r} must be float32 {list(shape)}")
        out[k] = v
    s = tensors["step"]
    if not isinstance(s, torch.Tensor) or tuple(s.shape) != (n,) or s.dtype != torch.int64:
        raise WireError(f"{what} 'step' must be int64 [{n}]")
    out["step"] = s
    _check_state(out, kind, what)
    return out, n


def encode_replica(table: str, update: dict[str, torch.Tensor], view: str, key: str, mode: str = "heal") -> bytes:
    """Rows' full state (TableShard.read_state()) from their primary, for a replica of `table`.
    ``mode``: "heal" overwrites (the primary saw the replica's counters differ and answers with its
    rows); "catch-up" is taken only by rows with fewer updates than it carries (it may arrive
    after a newer replay: swarm/tables/owed.py)."""
    _check_view(view)
    _check_key(key)
    _check_mode(mode)
    if not isinstance(update, dict) or "ids" not in update or not isinstance(update["ids"], torch.Tensor):
        raise WireError("replica update needs an 'ids' tensor")
    ids = _ids_in(update["ids"], 1 << 31, "replica update")
    rest = {k: v for k, v in update.items() if k != "ids"}
    if "rows" not in rest:
        raise WireError("replica update needs 'rows'")
    dim = rest["rows"].shape[-1] if isinstance(rest["rows"], torch.Tensor) and rest["rows"].dim() == 2 else -1
    out, _ = _state_tensors(rest, {"rows", "step"}, ids.size, dim, "replica update")
    out["ids"] = torch.from_numpy(ids.astype(np.int32))
    return _save(out, {"v": str(VERSION), "table": table, "view": view, "key": key, "mode": mode})


@_guard
def decode_replica(data: bytes, tables: Mapping[str, TableSpec], kind: str | None = None
                   ) -> tuple[str, dict[str, torch.Tensor], str, str, str]:
    """-> (table, {"ids" int64, "rows", state..., "step" int64}, view, key, mode). `kind` (one of
    shard.KINDS) pins the optimizer state expected; None accepts any. An update without a mode
    (an earlier peer's) is a heal."""
    tables = _tables(tables)
    blob = _Blob(data)
    _meta(blob.meta, {"v", "table", "view", "key", "mode"} if "mode" in blob.meta else {"v", "table", "view", "key"})
    mode = _check_mode(blob.meta.get("mode", "heal"))
    spec = _spec(tables, blob.meta["table"])
    view, key = _check_view(blob.meta["view"]), _check_key(blob.meta["key"])
    k = _kind_of(set(blob.entries), {"ids", "rows", "step"}, kind)
    _, shp, _ = blob.entries["ids"]
    if len(shp) != 1:
        raise WireError("ids must be 1-D")
    n = shp[0]
    if n > spec.rows:
        raise WireError(f"more ids than table {spec.name!r} has rows")
    out = {"ids": torch.from_numpy(_check_ids(blob.get("ids", ("I32",), (n,)).numpy(), spec.rows, "replica update"))}
    for name in ("rows", *state_keys(k)):
        out[name] = blob.get(name, ("F32",), state_shape(name, n, spec.dim))
    out["step"] = blob.get("step", ("I64",), (n,))
    _check_state(out, k, "replica update")
    return spec.name, out, view, key, mode


def encode_slot(table: str, slot: int, tensors: dict[str, torch.Tensor], view: str) -> bytes:
    """One held slot (TableShard.export_slot()) for hand-off to a new owner."""
    _check_view(view)
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= int(slot) < 1 << 31:
        raise WireError(f"slot must be a non-negative int, got {slot!r}")
    rows = tensors.get("rows") if isinstance(tensors, dict) else None
    dim = rows.shape[-1] if isinstance(rows, torch.Tensor) and rows.dim() == 2 else -1
    out, _ = _state_tensors(tensors, {"rows", "step"}, None, dim, "slot")
    return _save(out, {"v": str(VERSION), "table": table, "slot": str(int(slot)), "view": view})


@_guard
def decode_slot(data: bytes, tables: Mapping[str, TableSpec],
                slot_rows: Callable[[str, int], tuple[int, int]] | OwnershipMap, kind: str | None = None
                ) -> tuple[str, int, dict[str, torch.Tensor], str]:
    """-> (table, slot, {"rows", state..., "step"}, view); shapes follow slot_rows(table, slot)."""
    tables = _tables(tables)
    if isinstance(slot_rows, OwnershipMap):
        slot_rows = slot_rows.slot_rows
    blob = _Blob(data)
    _meta(blob.meta, {"v", "table", "slot", "view"})
    spec = _spec(tables, blob.meta["table"])
    view = _check_view(blob.meta["view"])
    if not _INT_RE.fullmatch(blob.meta["slot"]):
        raise WireError(f"slot must be a decimal integer, got {blob.meta['slot'][:20]!r}")
    slot = int(blob.meta["slot"])
    try:
        lo, hi = slot_rows(spec.name, slot)
    except Exception as e:
        raise WireError(f"slot {slot} of {spec.name!r} does not exist: {e}") from None
    k = _kind_of(set(blob.entries), {"rows", "step"}, kind)
    n = hi - lo
    out = {name: blob.get(name, ("F32",), state_shape(name, n, spec.dim)) for name in ("rows", *state_keys(k))}
    out["step"] = blob.get("step", ("I64",), (n,))
    _check_state(out, k, "slot")
    return spec.name, slot, out, view


# ----------------------------------------------------------------------------- replica replay

@dataclass
class Replay:
    """A primary's applied push, for a replica to apply the same optimizer step to the same rows.

    ``pre_step`` is each row's update counter before the step: a replica whose counters differ has
    missed or reordered an update must not apply it to those rows (it names them in its reply, and
    the primary sends their full state instead: encode_replay_reply / stale_rows).
    """
    table: str
    view: str
    key: str
    ids: np.ndarray
    grads: torch.Tensor
    pre_step: torch.Tensor
    dtype: str | None = None  # a wire dtype that carries ``grads`` exactly, when the primary knows one


def encode_replays(parts: Sequence[Replay], dtypes: Sequence[str] | None = None) -> bytes:
    """One flush's replays for one replica, every table in one message (one request per replica
    and flush, not per table). ``dtypes``: each part's wire dtype (default: its own, else fp32)."""
    if not parts:
        raise WireError("a replay message needs at least one table")
    view, key = _check_view(parts[0].view), _check_key(parts[0].key)
    out: dict[str, torch.Tensor] = {}
    for i, rp in enumerate(parts):
        dtype = dtypes[i] if dtypes is not None else (rp.dtype or "fp32")
        _check_dtype(dtype)
        if (rp.view, rp.key) != (view, key):
            raise WireError("the parts of a replay message must share one view and key")
        if f"{rp.table}.ids" in out:
            raise WireError(f"table {rp.table!r} twice in one replay message")
        ids = _ids_in(rp.ids, 1 << 31, "replay")
        g, st = rp.grads, rp.pre_step
        if not isinstance(g, torch.Tensor) or g.dim() != 2 or g.shape[0] != ids.size:
            raise WireError("replay grads must be [len(ids), dim]")
        if not isinstance(st, torch.Tensor) or st.dtype != torch.int64 or tuple(st.shape) != (ids.size,):
            raise WireError("replay pre_step must be int64 [len(ids)]")
        out[f"{rp.table}.ids"] = torch.from_numpy(ids.astype(np.int32))
        # update counters fit int32 for ~2 billion steps of one row: send them in 4 bytes, not 8
        out[f"{rp.table}.s"] = st.to(torch.int32) if not st.numel() or int(st.max()) < 2**31 else st
        _put(out, f"{rp.table}.g", g, dtype, f"replay grads of {rp.table!r}")
    return _save(out, {"v": str(VERSION), "view": view, "key": key})


@_guard
def decode_replays(data: bytes, tables: Mapping[str, TableSpec], max_ids: int) -> list[Replay]:
    """Known tables, each with exactly "<t>.ids", "<t>.s" and "<t>.g" (and "<t>.g.scale" when int8 /
    int4); ids strictly increasing < rows (at most max_ids in all), grads [n, dim] finite,
    pre_step >= 0. Returns one Replay per table, in the blob's order."""
    tables = _tables(tables)
    blob = _Blob(data)
    _meta(blob.meta, {"v", "view", "key"})
    view, key = _check_view(blob.meta["view"]), _check_key(blob.meta["key"])
    parts = _per_table(blob, tables, ("s",), max_ids, "replay")
    if not parts:
        raise WireError("a replay message needs at least one table")
    out = []
    for spec, ids in parts:
        t, n = spec.name, len(ids)
        g = _take(blob, f"{t}.g", (*_FLOATS, *_SCALED), (n, spec.dim), f"replay grads of {t!r}")
        st = blob.get(f"{t}.s", ("I32", "I64"), (n,)).to(torch.int64)
        if n and int(st.min()) < 0:
            raise WireError(f"replay pre_step of {t!r} has negative values")
        out.append(Replay(spec.name, view, key, ids, g, st))
    return out


def encode_replay_reply(applied: bool, stale: Mapping[str, np.ndarray]) -> dict:
    """A replica's answer to a replay (JSON): whether it was new, and the rows it left alone
    because their update counters were not the primary's."""
    return {"applied": bool(applied), "stale": {t: np.asarray(ids).tolist() for t, ids in stale.items()}}


def stale_rows(reply: bytes, parts: Sequence[Replay]) -> dict[str, np.ndarray]:
    """The rows a replica's reply names as stale, per table: only tables of the message and ids it
    replayed (a reply is the replica's word; it can make the primary send no more than the state of
    rows it sent replays of). WireError on a reply that is not one."""
    try:
        msg = json.loads(reply)
    except (ValueError, UnicodeDecodeError):
        raise WireError("replay reply is not JSON") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("applied"), bool):
        raise WireError("replay reply must be an object with a boolean 'applied'")
    stale = msg.get("stale", {})
    sent = {rp.table: rp.ids for rp in parts}
    if not isinstance(stale, dict) or not set(stale) <= set(sent):
        raise WireError("replay reply's 'stale' must map tables of the replay to row ids")
    out = {}
    for t, ids in stale.items():
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise WireError(f"replay reply's stale rows of {t!r} must be a list of ints")
        got = np.intersect1d(np.asarray(ids, dtype=np.int64), sent[t].astype(np.int64))
        if got.size != len(ids):
            raise WireError(f"replay reply names rows of {t!r} that the replay did not carry (or twice)")
        if got.size:
            out[t] = got
    return out
