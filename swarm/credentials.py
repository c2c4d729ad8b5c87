"""Where a peer keeps what makes it itself across restarts: its key (swarm/identity.py) and, on the
first peer, the secret ``--secret generate`` made, so the join command it printed keeps working.

``--key-file PATH``, else ``peer.key`` in the ``--checkpoint`` directory, else nothing is kept (a new
key, so a new id, every start). A generated secret lives next to the key, in ``PATH.secret``.
"""

from __future__ import annotations

import os
import shlex
import tempfile

from . import auth
from .config import ConfigError, PeerConfig
from .identity import KEY_FILE, KeyFileError, PeerKey

__all__ = ["key_path", "load_key", "generated_secret"]


def key_path(cfg: PeerConfig) -> str:
    """The key file's path, or "" when the peer keeps none."""
    if cfg.key_file:
        return cfg.key_file
    return os.path.join(cfg.checkpoint, KEY_FILE) if cfg.checkpoint else ""


def load_key(cfg: PeerConfig) -> tuple[PeerKey, str]:
    """(the peer's key, a line saying where it came from); ConfigError for a bad key file."""
    path = key_path(cfg)
    if not path:
        return PeerKey.generate(), "a new key (give --key-file or --checkpoint to keep this id)"
    try:
        key, created = PeerKey.load_or_create(path)
    except KeyFileError as e:
        raise ConfigError(str(e)) from None
    return key, f"{'a new key, saved in' if created else 'the key in'} {path}"


def generated_secret(cfg: PeerConfig) -> tuple[str, bool]:
    """For ``--secret generate``: (the secret saved next to the key, or a new one saved there;
    whether it was kept from an earlier start)."""
    path = key_path(cfg)
    where = path + ".secret" if path else ""
    if where and os.path.exists(where):
        try:
            with open(where, encoding="utf-8") as f:
                secret = f.read(1024).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the saved secret {where}: {e}") from None
        if len(secret) < 16 or not secret.isprintable():
            raise ConfigError(f"{where} does not hold a secret (at least 16 printable characters): remove it")
        return secret, True
    secret = auth.generate_secret()
    if where:
        folder = os.path.dirname(os.path.abspath(where))
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".secret-", dir=folder)
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(secret + "\n")
            os.replace(tmp, where)
        except OSError as e:
            raise ConfigError(f"cannot save the generated secret in {where}: {e.strerror or e}") from None
    return secret, False


def secret_arg(secret: str) -> str:
    """The ``--secret`` of a printed join command, safe to paste into a shell: ``--secret=VALUE``
    when the value starts with "-" (a secret kept from an older start may), which argparse would
    otherwise read as a flag."""
    quoted = shlex.quote(secret)
    return f"--secret={quoted}" if secret.startswith("-") else f"--secret {quoted}"
