import hashlib
import time

import numpy as np
import pytest
import torch

from swarm.tasks.bytelm.corpus import (EXCLUDED_DIRS, PAD, PREFIX, BatchSampler, Corpus, load_corpus, path_hash,
                        val_batches)
from swarm.tasks.bytelm.model import ModelConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    t = time.perf_counter()
    c = load_corpus()
    assert time.perf_counter() - t < 5.0  # target < 2 s; slack for a shared CI box
    return c


def write_tree(root, files):
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)


def test_stdlib_file_list(stdlib):
    files = stdlib.train_files + stdlib.val_files
    assert len(files) > 300 and stdlib.num_bytes > 1_000_000
    allsorted = sorted(files)
    assert stdlib.train_files == sorted(stdlib.train_files) and stdlib.val_files == sorted(stdlib.val_files)
    assert len(set(files)) == len(files)
    for rel in files:
        parts = rel.split("/")
        assert rel.endswith(".py") and "\\" not in rel
        assert not set(parts[:-1]) & EXCLUDED_DIRS, rel
        assert "idlelib/idle_test" not in rel and "lib2to3/tests" not in rel
    assert "os.py" in allsorted and "json/decoder.py" in allsorted + stdlib.val_files
    # validation rule and disjointness
    assert not set(stdlib.train_files) & set(stdlib.val_files)
    assert all(path_hash(r) % 20 == 0 for r in stdlib.val_files)
    assert all(path_hash(r) % 20 != 0 for r in stdlib.train_files)
    assert stdlib.train.dtype == np.uint8 and stdlib.train.size == stdlib.train_offsets[-1]
    assert stdlib.val.size == stdlib.val_offsets[-1] and stdlib.val.size > 0
    assert load_corpus() is stdlib  # cached
    assert stdlib.name.startswith("stdlib-") and len(stdlib.hash) == 64


def test_hash_stable_and_changes(tmp_path):
    files = {f"pkg/m{i}.py": f"x = {i}\n".encode() * 50 for i in range(30)}
    files["README.txt"] = b"hello\n" * 100
    write_tree(tmp_path, files)
    a = load_corpus(str(tmp_path))
    b = load_corpus(str(tmp_path))
    assert a.hash == b.hash
    # reference hash from the spec
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + len(files[rel]).to_bytes(8, "little") + files[rel])
    assert a.hash == h.hexdigest()
    assert sorted(a.train_files + a.val_files) == sorted(files)
    assert a.val_files and not set(a.train_files) & set(a.val_files)
    (tmp_path / "pkg/m3.py").write_bytes(b"x = 3  # edited, different length\n")
    c = load_corpus(str(tmp_path))
    assert c.hash != a.hash
    d = load_corpus(str(tmp_path), max_bytes=500)
    assert d.num_bytes == 500 and d.hash != c.hash


def test_data_dir_skips_binaries_and_errors(tmp_path):
    write_tree(tmp_path, {
        "a.txt": b"some text " * 40,
        "sub/b.md": "caf\u00e9 na\u00efve ".encode() * 40,
        "bin.dat": b"abc\0def" * 10,
        "latin1.txt": b"caf\xe9" * 10,
        "empty.txt": b"",
        ".git/config": b"[core]\n",
    })
    c = load_corpus(str(tmp_path))
    assert sorted(c.train_files + c.val_files) == ["a.txt", "sub/b.md"]
    assert len(c.train_files) == 1 and len(c.val_files) == 1
    batch = BatchSampler(c, batch_size=2, context=16, seed=0).next()
    assert batch.shape == (2, PREFIX + 17)
    # a single file works too (95/5 byte split)
    single = load_corpus(str(tmp_path / "a.txt"))
    assert single.train.size + single.val.size == 400 and single.val.size == 20
    bad = tmp_path / "bad"
    write_tree(bad, {"x.bin": b"\0\1\2", "y.txt": b"\xff\xfe"})
    with pytest.raises(ValueError, match="no usable text files"):
        load_corpus(str(bad))
    with pytest.raises(ValueError, match="no such file"):
        load_corpus(str(tmp_path / "missing"))


def test_batch_layout_and_determinism(stdlib):
    assert PREFIX == ModelConfig().prefix and PAD == 0
    s1 = BatchSampler(stdlib, batch_size=8, context=128, seed=42)
    s2 = BatchSampler(stdlib, batch_size=8, context=128, seed=42)
    s3 = BatchSampler(stdlib, batch_size=8, context=128, seed=43)
    b1, b2, b3 = s1.next(), s2.next(), s3.next()
    assert b1.dtype == torch.int64 and b1.shape == (8, PREFIX + 128 + 1)
    assert torch.equal(b1, b2) and not torch.equal(b1, b3)
    assert torch.equal(s1.next(), s2.next())
    assert int(b1.min()) >= 0 and int(b1.max()) <= 255
    # every row is a contiguous slice of the training stream (context bytes included)
    stream = stdlib.train.tobytes()
    for row in b1.tolist():
        assert bytes(row) in stream or bytes(row).lstrip(b"\0") in stream


def test_shards_disjoint(stdlib):
    shards = [BatchSampler(stdlib, 4, 64, seed=0, shard=(i, 3)) for i in range(3)]
    sets = [set(s.files) for s in shards]
    assert all(sets) and not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert set.union(*sets) == set(stdlib.train_files)
    assert not set.union(*sets) & set(stdlib.val_files)
    # batches come from the shard's own bytes
    s0 = shards[0]
    stream = s0.stream.tobytes()
    for row in s0.next().tolist():
        assert bytes(row) in stream or bytes(row).lstrip(b"\0") in stream
    # shard index must be < shard count
    with pytest.raises(ValueError):
        BatchSampler(stdlib, 4, 64, seed=0, shard=(3, 3))


def test_val_batches(stdlib):
    v1 = val_batches(stdlib, batch_size=8, context=128, max_batches=3)
    v2 = val_batches(stdlib, batch_size=8, context=128, max_batches=3)
    assert len(v1) == 3 and all(b.shape == (8, PREFIX + 129) for b in v1)
    assert all(torch.equal(a, b) for a, b in zip(v1, v2))
    val = stdlib.val.tobytes()
    for b in v1:
        for row in b.tolist():
            assert bytes(row) in val or bytes(row).lstrip(b"\0") in val
    assert v1[0][0, :PREFIX].tolist() == [PAD] * PREFIX  # first window starts at the stream start


def test_empty_shard_falls_back_to_all(tmp_path):
    write_tree(tmp_path, {f"f{i}.txt": b"text " * 40 for i in range(3)})
    c = load_corpus(str(tmp_path))
    samplers = [BatchSampler(c, 2, 8, seed=0, shard=(i, 50)) for i in range(50)]
    assert any(s.files == c.train_files for s in samplers)
    assert all(len(s.files) >= 1 for s in samplers)


def test_the_corpus_keeps_no_training_bytes_and_a_shard_reads_its_own(stdlib):
    # what a peer holds: the validation bytes and the offsets, not the 11 MB training stream
    held = [v for v in vars(stdlib).values() if isinstance(v, np.ndarray)]
    assert sum(a.nbytes for a in held) < stdlib.val.nbytes + 64 * (len(stdlib.train_files) + len(stdlib.val_files) + 2)
    whole = stdlib.train
    assert whole.size == stdlib.train_offsets[-1] and whole is not stdlib.train  # read anew each time
    for i in (0, len(stdlib.train_files) // 2, len(stdlib.train_files) - 1):
        lo, hi = stdlib.train_offsets[i], stdlib.train_offsets[i + 1]
        assert np.array_equal(stdlib.train_file(i), whole[lo:hi])
    s = BatchSampler(stdlib, 4, 64, seed=0, shard=(1, 4))
    picked = [stdlib.train_files.index(f) for f in s.files]
    assert s.stream.tobytes() == b"".join(whole[stdlib.train_offsets[j]:stdlib.train_offsets[j + 1]].tobytes()
                                          for j in picked)


def test_a_training_file_changed_after_loading_is_refused(tmp_path):
    write_tree(tmp_path, {f"pkg/m{i}.py": f"x = {i}\n".encode() * 50 for i in range(30)})
    c = load_corpus(str(tmp_path))
    before = c.train.tobytes()
    BatchSampler(c, 2, 16, seed=0, shard=(0, 2))
    rel = c.train_files[0]
    (tmp_path / rel).write_bytes((tmp_path / rel).read_bytes().replace(b"x", b"y"))  # same length
    with pytest.raises(ValueError, match=f"{rel!r} changed since the corpus was loaded"):
        c.train_file(0)
    with pytest.raises(ValueError, match="changed since the corpus was loaded"):
        BatchSampler(c, 2, 16, seed=0, shard=(0, 1))
    (tmp_path / rel).unlink()
    with pytest.raises(ValueError, match=f"{rel!r} can no longer be read"):
        c.train_file(0)
    # loading again takes the corpus as it is now (another hash), and reads it
    (tmp_path / rel).write_bytes(b"z = 1\n" * 40)
    d = load_corpus(str(tmp_path))
    assert d.hash != c.hash and d.train.tobytes() != before


def test_cut_corpora_read_back_what_was_hashed(tmp_path):
    write_tree(tmp_path, {f"f{i}.txt": f"line {i}\n".encode() * 30 for i in range(6)})
    cut = load_corpus(str(tmp_path), max_bytes=500)
    assert cut.num_bytes == 500 and cut.train.size == cut.train_offsets[-1]
    single = load_corpus(str(tmp_path / "f1.txt"))
    assert single.train.tobytes() + single.val.tobytes() == (tmp_path / "f1.txt").read_bytes()
