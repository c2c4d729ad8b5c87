"""The swarm's settings: what shapes the update of the shared model, agreed at join (sans-I/O).

A swarm trains one model, so every setting that changes how the shared parameters move is the
swarm's, fixed by the peer that starts it (and kept in its checkpoints), not each peer's. A setting
counts as *given* when it is on the command line or in a SWARM_* variable (PeerConfig.given), not
when it is a default. A joiner adopts every setting it did not give; one it gave with another value
is refused, naming the setting and both values. Everything else (batch size, threads, ports, the
data path of a task that allows it, --steps as "when this peer leaves") stays per peer.

``budget`` is the swarm's step budget: the learning-rate schedule runs on it (the built-in task's
cosine ends there), so a joiner with another ``--steps`` sees the same learning rate at every step.
It is the first peer's ``--budget``, else its ``--steps``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from .config import ConfigError, PeerConfig

# setting -> its flag, in the order a refusal names them
SWARM_WIDE: dict[str, str] = {
    "seed": "--seed", "budget": "--budget", "lr": "--lr", "aggregation": "--aggregation", "trim": "--trim",
    "msg_clip": "--msg-clip", "compression": "--compression", "ratio": "--ratio", "chunk": "--chunk", "warmup_steps": "--warmup-steps",
    "min_payload": "--min-payload", "clip_norm": "--clip-norm", "table_lr": "--table-lr",
    "push_dtype": "--push-dtype", "max_staleness": "--max-staleness", "sketch_every": "--sketch-every",
    "ef_decay": "--ef-decay", "sync_every": "--sync-every", "outer_lr": "--outer-lr",
    "outer_momentum": "--outer-momentum", "outer_nesterov": "--outer-nesterov", "overlap": "--overlap",
    "row_ratio": "--row-ratio", "row_state": "--row-state", "max_contributors": "--max-contributors",
    "cap_by": "--cap-by", "row_clip": "--row-clip",
}
_TYPES = {f.name: type(f.default) for f in dataclasses.fields(PeerConfig) if f.name in SWARM_WIDE}
# settings added after others were already kept in checkpoints and sent at join: a checkpoint or a
# peer that does not name one ran with its value here (what the code did before the setting existed)
ADDED_LATER: dict[str, Any] = {"chunk": 0, "ef_decay": 1.0, "sync_every": 1, "outer_lr": 1.0,
                               "outer_momentum": 0.0, "outer_nesterov": 0, "overlap": 0, "row_ratio": 1.0, "row_state": "full",
                               "max_contributors": 0, "row_clip": 0.0, "cap_by": "rounds"}


def of(cfg: PeerConfig) -> dict[str, Any]:
    """The swarm settings ``cfg`` stands for (budget: --budget, else --steps)."""
    out = {name: getattr(cfg, name) for name in SWARM_WIDE}
    if not cfg.budget:
        out["budget"] = cfg.steps
    return out


def given(cfg: PeerConfig) -> dict[str, Any]:
    """The swarm settings this peer was given explicitly (the others it adopts)."""
    return {name: v for name, v in of(cfg).items() if cfg.is_given(name)}


def parse(raw: Any) -> dict[str, Any]:
    """Settings from the network or a checkpoint: exactly the known names, each of its type and finite
    (ConfigError otherwise); the values are then validated like flags by PeerConfig.validate."""
    if isinstance(raw, Mapping):
        raw = {**{k: v for k, v in ADDED_LATER.items() if k not in raw}, **raw}
    if not isinstance(raw, Mapping) or set(raw) != set(SWARM_WIDE):
        missing = sorted(set(SWARM_WIDE) - set(raw)) if isinstance(raw, Mapping) else []
        unknown = sorted(str(k)[:20] for k in set(raw) - set(SWARM_WIDE)) if isinstance(raw, Mapping) else []
        raise ConfigError(f"the swarm's settings are malformed (missing {missing[:3]}, unknown {unknown[:3]})")
    out = {}
    for name, kind in _TYPES.items():
        v = raw[name]
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if type(v) is not kind or (kind is float and not math.isfinite(v)) or (kind is str and len(v) > 64):
            raise ConfigError(f"the swarm's setting {name} is malformed: {str(v)[:40]!r}")
        out[name] = v
    return out


def conflict(swarm: Mapping[str, Any], mine: Mapping[str, Any]) -> str | None:
    """One line naming the first setting in ``mine`` that differs from the swarm's, or None."""
    for name, flag in SWARM_WIDE.items():
        if name in mine and name in swarm and mine[name] != swarm[name]:
            return (f"{flag} is a swarm-wide setting: this swarm uses {swarm[name]!r}, this peer gives "
                    f"{mine[name]!r} (leave it out to adopt the swarm's)")
    return None


def adopt(cfg: PeerConfig, swarm: Mapping[str, Any]) -> None:
    """Take every swarm setting ``cfg`` was not given from ``swarm`` (in place; validated)."""
    for name, v in swarm.items():
        if not cfg.is_given(name):
            setattr(cfg, name, v)
    cfg.validate()
