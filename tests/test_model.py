import math

import numpy as np
import pytest
import torch

from swarm.tasks.bytelm.model import (NGRAM_TAG, PAD, TABLES, VALUE_TAG, ModelConfig, SwarmLM, hash_symbols,
                         param_sketch)

torch.set_num_threads(1)

SMALL = dict(ngram_rows=4096, value_rows=4096)

# ---------------------------------------------------------------- reference hash (pure Python ints)
MASK = (1 << 64) - 1


def ref_mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def ref_hash(tag, symbols):
    h = ref_mix64(tag & MASK)
    for s in symbols:
        h = ref_mix64(h ^ (((s + 1) * 0x9E3779B97F4A7C15) & MASK))
    return h


# (tag, symbols, full 64-bit hash) -- also listed in docs/model.md
GOLDEN = [
    (NGRAM_TAG + 2, b"ab", 0x09ECAD73C325F225),
    (NGRAM_TAG + 3, b"def", 0xCA42F5B4C7358FDC),
    (NGRAM_TAG + 4, b"\0\0\0a", 0xDCBA7614473FE16E),
    (NGRAM_TAG + 4, b"self", 0x23F17CAEEABA5222),
    (VALUE_TAG + 0, bytes([0, 97]), 0xC352C5F81C481AF2),
    (VALUE_TAG + 1, bytes([32, 115]), 0x14F533B6593E50CB),
]


def make_batch(B=4, T=32, seed=0, P=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (B, P + T + 1), generator=g)


@pytest.mark.parametrize("tag,syms,expected", GOLDEN)
def test_golden_hash_vectors(tag, syms, expected):
    assert ref_hash(tag, list(syms)) == expected
    got = hash_symbols(tag, [np.array([s]) for s in syms])
    assert got.dtype == np.uint64 and int(got[0]) == expected


def test_table_ids_golden_and_reference():
    # default row counts: stream "\0\0\0self" (3 PAD context bytes, then T=4 inputs)
    ids = SwarmLM(ModelConfig()).table_ids(torch.tensor([list(b"\0\0\0self")]))
    assert ids["ngram"].shape == (1, 4, 3) and ids["value"].shape == (2, 1, 4)
    assert ids["ngram"][0].tolist() == [[49589, 51138, 42180], [38161, 14692, 22648],
                                        [51685, 28328, 14807], [41350, 35742, 21026]]
    assert ids["value"][:, 0].tolist() == [[28520, 8130, 13196, 17990], [288, 17308, 56346, 31188]]
    # vectorised ids == pure-Python reference on random tokens, incl. real context bytes
    m = SwarmLM(ModelConfig(**SMALL))
    tok = make_batch(B=3, T=10, seed=5)[:, :-1]
    ids = m.table_ids(tok)
    P, t = 3, tok.tolist()
    for b in range(3):
        for i in range(10):
            for k, n in enumerate((2, 3, 4)):
                want = ref_hash(NGRAM_TAG + n, t[b][P + i - n + 1:P + i + 1]) % 4096
                assert ids["ngram"][b, i, k].item() == want
            for layer in range(2):
                want = ref_hash(VALUE_TAG + layer, [t[b][P + i - 1], t[b][P + i]]) % 4096
                assert ids["value"][layer, b, i].item() == want


def test_shapes_init_and_api():
    cfg = ModelConfig()
    assert cfg.prefix == 3 and PAD == 0
    m = SwarmLM(cfg)
    assert set(m.table_parameters()) == set(TABLES)
    tp = m.table_parameters()
    assert tp["ngram"].shape == (65536, 128) and tp["value"].shape == (65536, 128)
    assert all(float(p.detach().abs().sum()) == 0 for p in tp.values())
    dense = m.dense_parameters()
    assert sum(p.numel() for _, p in dense) == 476416
    assert not any(n.split(".")[0] in TABLES for n, _ in dense)
    batch = make_batch(B=2, T=128)
    logits = m(batch[:, 3:-1], batch[:, :3])
    assert logits.shape == (2, 128, 256)
    assert m(batch[:, 3:-1]).shape == (2, 128, 256)  # ctx=None -> PAD
    with torch.no_grad():
        loss = m.loss(batch).item()
    assert abs(loss - math.log(256)) < 0.1
    # deterministic init from the seed, independent of the global RNG
    torch.manual_seed(123)
    m2 = SwarmLM(cfg)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(m.dense_parameters(), m2.dense_parameters()))
    m3 = SwarmLM(ModelConfig(seed=1))
    assert not torch.equal(m.head.weight, m3.head.weight)


def test_sharded_tables_match_local_tables():
    """The swarm's model (ShardedEmbedding tables, rows bound per forward) computes what the same
    model with local nn.Embedding tables computes, and row gradients land on the bound rows."""
    from swarm.tables.embedding import TableError

    m = SwarmLM(ModelConfig(**SMALL))
    with torch.no_grad():  # non-zero tables so the check is not vacuous
        g = torch.Generator().manual_seed(7)
        for p in m.table_parameters().values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    sharded = SwarmLM(ModelConfig(**SMALL, local_tables=False))
    sharded.load_state_dict({k: v for k, v in m.state_dict().items() if k.split(".")[0] not in TABLES})
    assert set(n for n, _ in sharded.named_parameters()) == set(n for n, _ in m.dense_parameters())
    batch = make_batch(B=4, T=32, seed=3)

    m.zero_grad()
    loss_a = m.loss(batch)
    loss_a.backward()
    dense_a = {n: p.grad.clone() for n, p in m.dense_parameters()}
    table_a = {k: p.grad.clone() for k, p in m.table_parameters().items()}

    uids = m.unique_table_ids(batch)
    rows = {}
    for k, ids in uids.items():
        assert ids.dtype == torch.int64 and torch.equal(ids, torch.unique(ids))
        rows[k] = (ids, m.table_parameters()[k].detach()[ids].clone().requires_grad_())
        getattr(sharded, k).bind(*rows[k])
    loss_b = sharded.loss(batch)
    loss_b.backward()
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    for n, p in sharded.named_parameters():
        assert torch.allclose(dense_a[n], p.grad, atol=1e-6), n
    for k, (ids, r) in rows.items():
        assert torch.allclose(r.grad, table_a[k][ids], atol=1e-6), k
        # every row the batch touches got a gradient, rows it does not touch got none
        untouched = torch.ones(table_a[k].shape[0], dtype=torch.bool)
        untouched[ids] = False
        assert float(table_a[k][untouched].abs().sum()) == 0
    # ids the forward reads that were not pulled are an error, not silently wrong
    ids, r = rows["ngram"]
    sharded.ngram.bind(ids[1:], r[1:])
    with pytest.raises(TableError, match="did not return"):
        sharded.loss(batch)
    sharded.ngram.unbind()
    with pytest.raises(TableError, match="no rows here"):
        sharded.loss(batch)


def test_param_sketch():
    m = SwarmLM(ModelConfig(**SMALL))
    s1 = param_sketch(m.dense_parameters())
    assert len(s1) == 16 and s1 == param_sketch(SwarmLM(ModelConfig(**SMALL)).dense_parameters())
    assert s1 == param_sketch([p for _, p in m.dense_parameters()])
    assert len(param_sketch(m.dense_parameters(), dim=4)) == 4 and param_sketch(m.dense_parameters(), seed=1) != s1
    with torch.no_grad():
        m.table_parameters()["ngram"][0] += 1.0  # tables are not part of the dense sketch
    assert param_sketch(m.dense_parameters()) == s1
    with torch.no_grad():
        m.blocks[1].mlp.fc.weight[3, 5] += 1e-3
    assert param_sketch(m.dense_parameters()) != s1


def test_few_steps_reduce_loss():
    torch.manual_seed(0)
    m = SwarmLM(ModelConfig(**SMALL))
    batch = torch.tensor([list(b"\0\0\0" + b"def f(x):\n    return x + 1\n" * 3)[:3 + 33]] * 2)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        opt.zero_grad()
        loss = m.loss(batch)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    assert m.loss(batch).item() < first - 1.0
