"""The manifest: one fixed, hashed order for all dense parameters.

Both peers flatten gradients into the same flat index space, so a payload only has
to carry flat indices; the manifest hash in every payload guards against a peer
running a different model (different names, shapes or dtypes).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

import torch

from .errors import CodecError


@dataclass(frozen=True)
class ManifestEntry:
    """One parameter (kind "param") or module buffer (kind "buffer": its per-step change travels
    in the flat space and is added, not stepped by the optimizer): name, shape, dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = "param"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"manifest entry name must be a non-empty string, got {self.name!r}")
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"manifest entry {self.name!r} has a negative dimension: {shape}")
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"manifest entry {self.name!r} needs a dtype name, got {self.dtype!r}")
        if self.kind not in ("param", "buffer"):
            raise ValueError(f"manifest entry {self.name!r}: kind must be 'param' or 'buffer', got {self.kind!r}")

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Manifest:
    """Ordered parameter list defining the flat gradient index space."""

    entries: tuple[ManifestEntry, ...]

    def __post_init__(self) -> None:
        entries = tuple(self.entries)
        object.__setattr__(self, "entries", entries)
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ValueError("manifest has duplicate parameter names")

    @classmethod
    def from_module(cls, module: torch.nn.Module) -> "Manifest":
        """Trainable parameters in named_parameters() order (shared params appear once)."""
        return cls(tuple(
            ManifestEntry(name, tuple(p.shape), _dtype_name(p.dtype))
            for name, p in module.named_parameters()
            if p.requires_grad
        ))

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start offset of each entry in the flat space (plus the total at the end)."""
        out = [0]
        for e in self.entries:
            out.append(out[-1] + e.numel)
        return tuple(out)

    @property
    def numel(self) -> int:
        """Total number of entries n in the flat space."""
        return self.offsets[-1]

    @cached_property
    def hash(self) -> str:
        """16 hex chars of sha256 over a canonical JSON description (order matters)."""
        desc = json.dumps(
            {"v": 1, "e": [[e.name, list(e.shape), e.dtype] + (["buffer"] if e.kind == "buffer" else [])
                           for e in self.entries]},
            separators=(",", ":"), ensure_ascii=True,
        )
        return hashlib.sha256(desc.encode("utf-8")).hexdigest()[:16]

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate tensors into one fp32 [n] vector; KeyError if missing, ValueError on mismatch."""
        extra = set(tensors) - {e.name for e in self.entries}
        if extra:
            raise ValueError(f"tensors not in manifest: {sorted(extra)[:5]}")
        out = torch.empty(self.numel, dtype=torch.float32)
        for e, off in zip(self.entries, self.offsets):
            if e.name not in tensors:
                raise KeyError(f"tensor {e.name!r} missing (required by manifest {self.hash})")
            t = tensors[e.name]
            if tuple(t.shape) != e.shape:
                raise ValueError(f"tensor {e.name!r} has shape {tuple(t.shape)}, manifest says {e.shape}")
            out[off:off + e.numel].copy_(t.detach().reshape(-1))
        return out

    def flatten_grads(self, module: torch.nn.Module) -> torch.Tensor:
        """The module's .grad fields as one fp32 [n] vector; zeros where .grad is None."""
        params = {name: p for name, p in module.named_parameters() if p.requires_grad}
        if list(params) != [e.name for e in self.entries]:
            raise ValueError("module parameters do not match the manifest")
        out = torch.zeros(self.numel, dtype=torch.float32)
        for e, off in zip(self.entries, self.offsets):
            p = params[e.name]
            if tuple(p.shape) != e.shape:
                raise ValueError(f"parameter {e.name!r} has shape {tuple(p.shape)}, manifest says {e.shape}")
            if p.grad is not None:
                out[off:off + e.numel].copy_(p.grad.detach().reshape(-1))
        return out

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped per entry (no copy: writes go through)."""
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(f"flat vector must have shape [{self.numel}], got {tuple(flat.shape)}")
        return {e.name: flat[off:off + e.numel].view(e.shape)
                for e, off in zip(self.entries, self.offsets)}

    def check_hash(self, h: str) -> None:
        if h != self.hash:
            raise CodecError(f"manifest hash mismatch: payload {h!r}, ours {self.hash!r}")
