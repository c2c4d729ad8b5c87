"""The default swarm corpus: the Python standard library's own .py sources (no download),
or the user's text files (``--data PATH``).

Every peer must enumerate, split and hash the corpus identically:

  * stdlib: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, skipping any path with
    a directory component in EXCLUDED_DIRS (test, tests, idle_test -- which covers
    idlelib/idle_test --, site-packages, __pycache__) and the build-specific files
    ``_sysconfigdata*.py`` and ``config-*/``; sorted by relative posix path.
  * --data PATH: a file, or a directory walked recursively (hidden entries and __pycache__
    skipped) for text files: non-empty, no NUL byte, valid UTF-8. Sorted by relative path.
  * validation files: int.from_bytes(sha256(rel_path_utf8), "big") % 20 == 0
    (fallbacks for tiny corpora in _split_files); the rest are training files.
  * corpus hash: sha256 over all files in sorted order of
        rel_path_utf8 + b"\\0" + len(content).to_bytes(8, "little") + content  -> hexdigest.
  * peer shards: int.from_bytes(sha256(b"swarm-shard\\0" + rel_path_utf8), "big") % k == i.

Batches use the layout of swarm.model: LongTensor [B, P + T + 1] of byte values, P leading
context bytes (PAD = 0 before the start of the stream), then T inputs, the last T being the
targets. Files are concatenated (in sorted order) into one byte stream per split/shard and
windows are drawn anywhere in that stream, so a window may span a file boundary.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
VAL_MODULUS = 20
PREFIX = 3  # == ModelConfig().prefix for the default n-gram orders (2, 3, 4)
PAD = 0


@dataclass(frozen=True, eq=False)
class Corpus:
    """The corpus as loaded and hashed. It keeps the validation bytes, not the training bytes: a
    peer trains on its shard, a quarter of them at 4 peers, which its BatchSampler reads from the
    files when it is made (train_file), each file checked against the digest taken at load. Held
    whole, the stdlib's 11.4 MB sat in every peer's memory for nothing (docs/benchmarks.md,
    "Memory per peer")."""

    name: str
    hash: str                 # sha256 hex over (path, content) of all files, see module doc
    val: np.ndarray           # uint8, validation files concatenated in sorted order (read-only)
    train_files: list[str]    # relative posix paths, sorted
    val_files: list[str]
    train_offsets: np.ndarray  # int64 [len(train_files) + 1]: file i is train[off[i]:off[i+1]]
    val_offsets: np.ndarray
    root: str                 # the files' directory (or the one file of a single-file corpus)
    # per training file: the byte range of the file that is in the stream (all of it, but for a
    # single-file corpus's 95% and a --max-bytes cut), and the sha256 of those bytes
    train_spans: tuple[tuple[int, int], ...]
    train_digests: tuple[bytes, ...]

    @property
    def num_bytes(self) -> int:
        return int(self.train_offsets[-1] + self.val.size)

    @property
    def train(self) -> np.ndarray:
        """uint8, the training files concatenated in sorted order: read from the files now, a new
        array each time (the whole corpus's; a shard's sampler reads only its files)."""
        if not self.train_files:
            return np.zeros(0, dtype=np.uint8)
        return np.concatenate([self.train_file(i) for i in range(len(self.train_files))])

    def train_file(self, i: int) -> np.ndarray:
        """Training file ``i``'s bytes in the stream (uint8), read from its file now. A file that
        changed since the corpus was loaded is refused: the swarm agreed on the corpus's hash."""
        rel, (lo, hi) = self.train_files[i], self.train_spans[i]
        path = Path(self.root) if Path(self.root).is_file() else Path(self.root) / rel
        try:
            with open(path, "rb") as f:
                f.seek(lo)
                data = f.read(hi - lo)
        except OSError as e:
            raise ValueError(f"corpus file {rel!r} can no longer be read ({e.strerror or e}); "
                             "restart the peer on the corpus as it is now") from None
        if len(data) != hi - lo or hashlib.sha256(data).digest() != self.train_digests[i]:
            raise ValueError(f"corpus file {rel!r} changed since the corpus was loaded (the swarm agreed "
                             "on it as it was); restart the peer on the corpus as it is now")
        return np.frombuffer(data, dtype=np.uint8)


# ----------------------------------------------------------------------------- enumeration


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        for f in filenames:
            if f.endswith(".py") and not f.startswith("_sysconfigdata"):
                full = Path(dirpath, f)
                out.append((full.relative_to(root).as_posix(), full))
    return sorted(out)


def _user_files(root: Path) -> list[tuple[str, Path]]:
    if root.is_file():
        return [(root.name, root)]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for f in filenames:
            if not f.startswith("."):
                full = Path(dirpath, f)
                if full.is_file():
                    out.append((full.relative_to(root).as_posix(), full))
    return sorted(out)


def _is_text(content: bytes) -> bool:
    if not content or b"\0" in content:
        return False
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def path_hash(rel: str, salt: bytes = b"") -> int:
    return int.from_bytes(hashlib.sha256(salt + rel.encode("utf-8")).digest(), "big")


def _split_files(rels: list[str]) -> tuple[set[str], set[str]]:
    """(train, val) names. val = path_hash % 20 == 0; with >= 2 files both sides are made
    non-empty by moving the file with the smallest path_hash; a single file is in both
    (its bytes are split 95/5 by the caller)."""
    if len(rels) == 1:
        return set(rels), set(rels)
    val = {r for r in rels if path_hash(r) % VAL_MODULUS == 0}
    if not val or len(val) == len(rels):
        val = {min(rels, key=path_hash)}
    return set(rels) - val, val


# ----------------------------------------------------------------------------- loading


def load_corpus(path: str | os.PathLike | None = None, *, max_bytes: int | None = None) -> Corpus:
    """The stdlib corpus (path=None) or the user's text files. Cached per process; the cache
    key includes every candidate file's (path, size, mtime_ns), so edited files are re-read.
    max_bytes caps the total: files are taken in sorted order, the last one truncated."""
    if path is None:
        root, files, name = stdlib_dir(), _stdlib_files(stdlib_dir()), f"stdlib-{sys.version_info[0]}.{sys.version_info[1]}"
    else:
        root = Path(path).expanduser().resolve()
        if not root.exists():
            raise ValueError(f"--data {path}: no such file or directory")
        files, name = _user_files(root), f"data:{root.name}"
    stamp = tuple((rel, st.st_size, st.st_mtime_ns) for rel, st in ((r, p.stat()) for r, p in files))
    return _load(str(root), name, stamp, path is None, max_bytes)


@functools.lru_cache(maxsize=8)
def _load(root: str, name: str, stamp: tuple, is_stdlib: bool, max_bytes: int | None) -> Corpus:
    contents: dict[str, bytes] = {}
    total = 0
    for rel, _, _ in stamp:
        if max_bytes is not None and total >= max_bytes:
            break
        full = Path(root) / rel if not Path(root).is_file() else Path(root)
        data = full.read_bytes()
        if not is_stdlib and not _is_text(data):
            continue
        if max_bytes is not None:
            data = data[:max_bytes - total]
        contents[rel] = data
        total += len(data)
    if not contents or total == 0:
        raise ValueError(f"--data {root}: no usable text files found (need non-empty, valid UTF-8 files "
                         f"without NUL bytes; {len(stamp)} candidate file(s) skipped)")

    rels = sorted(contents)
    h = hashlib.sha256()
    for rel in rels:
        h.update(rel.encode("utf-8") + b"\0" + len(contents[rel]).to_bytes(8, "little"))
        h.update(contents[rel])

    train_set, val_set = _split_files(rels)
    train_rels = [r for r in rels if r in train_set]
    val_rels = [r for r in rels if r in val_set]
    # per file: the byte range of it in each split (the whole file, but for a single file's 95/5)
    if len(rels) == 1:  # single file: first 95% train, last 5% val
        size = len(contents[rels[0]])
        cut = size - max(1, size // VAL_MODULUS) if size > 1 else size
        train_spans, val_spans = [(0, cut)], [(cut, size)]
    else:
        train_spans = [(0, len(contents[r])) for r in train_rels]
        val_spans = [(0, len(contents[r])) for r in val_rels]

    def offsets(spans: list[tuple[int, int]]) -> np.ndarray:
        off = np.zeros(len(spans) + 1, dtype=np.int64)
        np.cumsum([hi - lo for lo, hi in spans], out=off[1:])
        off.setflags(write=False)
        return off

    val = np.frombuffer(b"".join(contents[r][lo:hi] for r, (lo, hi) in zip(val_rels, val_spans)), dtype=np.uint8)
    digests = tuple(hashlib.sha256(contents[r][lo:hi]).digest() for r, (lo, hi) in zip(train_rels, train_spans))
    return Corpus(name=name, hash=h.hexdigest(), val=val, train_files=train_rels, val_files=val_rels,
                  train_offsets=offsets(train_spans), val_offsets=offsets(val_spans), root=root,
                  train_spans=tuple(train_spans), train_digests=digests)


# ----------------------------------------------------------------------------- batches


def _windows(stream: np.ndarray, starts: np.ndarray, context: int, prefix: int) -> torch.Tensor:
    """Rows stream[s - prefix : s + context + 1] for each target-window start s; PAD before 0."""
    idx = starts[:, None] + np.arange(-prefix, context + 1, dtype=np.int64)[None, :]
    out = stream[np.maximum(idx, 0)].astype(np.int64)
    out[idx < 0] = PAD
    return torch.from_numpy(out)


class BatchSampler:
    """Random windows from this peer's shard of the training files.

    shard = (i, k): training files whose path_hash(rel, b"swarm-shard\\0") % k == i
    (all training files if that selection is empty). next() returns a LongTensor
    [batch_size, prefix + context + 1], drawn with np.random.default_rng(seed)."""

    def __init__(self, corpus: Corpus, batch_size: int, context: int, seed: int,
                 shard: tuple[int, int] = (0, 1), *, prefix: int = PREFIX):
        i, k = shard
        if not (k >= 1 and 0 <= i < k):
            raise ValueError(f"bad shard {shard}: need 0 <= index < count")
        self.batch_size, self.context, self.prefix = batch_size, context, prefix
        picked = [j for j, rel in enumerate(corpus.train_files) if path_hash(rel, b"swarm-shard\0") % k == i]
        if not picked or len(picked) == len(corpus.train_files):
            picked = list(range(len(corpus.train_files)))
            self.stream = corpus.train
        else:
            self.stream = np.concatenate([corpus.train_file(j) for j in picked])
        self.files = [corpus.train_files[j] for j in picked]
        if self.stream.size < context + 1:
            raise ValueError(f"shard {shard} of corpus {corpus.name!r} has {self.stream.size} bytes; "
                             f"need at least context + 1 = {context + 1}")
        self.rng = np.random.default_rng(seed)

    def next(self) -> torch.Tensor:
        starts = self.rng.integers(0, self.stream.size - self.context, size=self.batch_size, dtype=np.int64)
        return _windows(self.stream, starts, self.context, self.prefix)

    __next__ = next

    def __iter__(self):
        return self


def val_batches(corpus: Corpus, batch_size: int, context: int, max_batches: int = 8, *,
                prefix: int = PREFIX) -> list[torch.Tensor]:
    """Fixed, evenly spaced windows over the validation stream, identical on every peer:
    n = min(max_batches * batch_size, number of distinct starts) windows with starts
    floor(j * (len(val) - context - 1) / max(n - 1, 1)) for j = 0..n-1, in batches of
    batch_size (the last may be smaller). [] if the validation stream is shorter than
    context + 1 bytes."""
    span = corpus.val.size - context - 1
    if span < 0:
        return []
    n = min(max_batches * batch_size, span + 1)
    starts = (np.arange(n, dtype=np.int64) * span) // max(n - 1, 1)
    return [_windows(corpus.val, starts[j:j + batch_size], context, prefix) for j in range(0, n, batch_size)]
