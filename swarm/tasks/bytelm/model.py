"""The default swarm model: a small byte-level transformer LM with two hashed tables.

Reads top to bottom:
  1. ModelConfig          -- the whole configuration as one dataclass
  2. the bit-exact hash   -- mix64 / hash_symbols, numpy uint64, wrapping mod 2**64
  3. the transformer      -- pre-LayerNorm blocks, causal SDPA attention, 4x GELU MLP
  4. SwarmLM              -- embeddings + hashed n-gram table + hashed value embeddings
  5. param_sketch         -- a seeded random projection of the dense parameters

Batch layout (shared with swarm.data): a LongTensor ``batch`` of shape [B, P + T + 1]
of byte values 0..255, where P = cfg.prefix (3 for the default n-gram orders (2, 3, 4)):

    batch[:, :P]       leading context bytes (real preceding bytes, or PAD = 0 where the
                       window starts less than P bytes into the stream)
    batch[:, P:-1]     inputs x, T bytes
    batch[:, P+1:]     targets y, T bytes (next byte of each input)

Both tables are zero-initialised, so at init the model is exactly the plain transformer.
The output head is UNTIED from the input byte embedding.
See docs/model.md for the full hash specification and golden vectors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------- config


@dataclass
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    context: int = 128
    ngram_rows: int = 65536
    ngram_orders: tuple[int, ...] = (2, 3, 4)
    value_rows: int = 65536
    seed: int = 0
    # False: the tables live elsewhere (sharded across peers, swarm/tables); every forward then
    # takes the rows it needs as ``table_rows`` and the model allocates no table memory.
    local_tables: bool = True

    def __post_init__(self) -> None:
        self.ngram_orders = tuple(int(n) for n in self.ngram_orders)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        if not self.ngram_orders or min(self.ngram_orders) < 1:
            raise ValueError(f"ngram_orders must be non-empty and >= 1, got {self.ngram_orders}")
        if self.ngram_rows < 1 or self.value_rows < 1:
            raise ValueError("table row counts must be >= 1")

    @property
    def prefix(self) -> int:
        """P: leading context bytes a batch carries (n-grams need n-1, value ids need 1)."""
        return max(max(self.ngram_orders) - 1, 1)


TABLES = ("ngram", "value")
PAD = 0  # byte used for positions before the start of the stream (text corpora contain no NUL)

# ----------------------------------------------------------------------------- hashing
# Everything below is uint64 arithmetic that wraps mod 2**64 (numpy uint64 arrays wrap
# silently and identically on every platform). Spec, with & MASK64 after every + and *:
#
#   mix64(z):  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
#              z = (z ^ (z >> 27)) * 0x94D049BB133111EB
#              return z ^ (z >> 31)                       (splitmix64 finalizer)
#   hash_symbols(tag, s_1..s_k):
#              h = mix64(tag)
#              for s in s_1..s_k:  h = mix64(h ^ ((s + 1) * 0x9E3779B97F4A7C15))
#              return h
#   n-gram row   (order n, bytes b_{t-n+1}..b_t oldest first):
#              hash_symbols(NGRAM_TAG + n, b_{t-n+1}, ..., b_t) % ngram_rows
#   value row    (layer l, previous byte p = b_{t-1}, current byte c = b_t):
#              hash_symbols(VALUE_TAG + l, p, c) % value_rows

MASK64 = (1 << 64) - 1
NGRAM_TAG = 0x6E6772616D000000  # b"ngram\0\0\0" big-endian
VALUE_TAG = 0x76616C7565000000  # b"value\0\0\0" big-endian
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _ONE = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(1)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array (wrapping)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        return z ^ (z >> _S31)


def hash_symbols(tag: int, symbols: Sequence[np.ndarray]) -> np.ndarray:
    """Hash aligned integer arrays (values >= 0), oldest symbol first; returns uint64."""
    shape = np.broadcast_shapes(*(np.shape(s) for s in symbols)) if symbols else ()
    h = mix64(np.full(shape, tag & MASK64, dtype=np.uint64).reshape(shape or (1,)))
    with np.errstate(over="ignore"):
        for s in symbols:
            s = np.asarray(s).astype(np.uint64).reshape(shape or (1,))
            h = mix64(h ^ ((s + _ONE) * _GOLDEN))
    return h.reshape(shape)


# ----------------------------------------------------------------------------- transformer


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, ve: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        v = v + ve  # hashed value embedding, added before splitting heads
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, ve: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), ve)
        return x + self.mlp(self.ln2(x))


# ----------------------------------------------------------------------------- the model

TableRows = dict[str, tuple[torch.Tensor, torch.Tensor]]


class SwarmLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.pos_emb = nn.Embedding(cfg.context, d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)  # untied from tok_emb
        self.tables = nn.ModuleDict({
            "ngram": nn.Embedding(cfg.ngram_rows, d),
            "value": nn.Embedding(cfg.value_rows, d),
        } if cfg.local_tables else {})
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from cfg.seed, in named_parameters() order, local generator."""
        g = torch.Generator().manual_seed(self.cfg.seed)
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        norm_params = {id(p) for m in self.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
        for name, p in self.named_parameters():
            if name.startswith("tables."):
                p.zero_()
            elif id(p) in norm_params:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                std = out_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)

    # --- parameter groups ---------------------------------------------------------------

    def dense_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if not n.startswith("tables.")]

    def table_parameters(self) -> dict[str, nn.Parameter]:
        return {name: self.tables[name].weight for name in TABLES if name in self.tables}

    # --- hashed table ids ---------------------------------------------------------------

    def table_ids(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row ids for the input stream ``tokens`` = [B, P + T] (context bytes then inputs,
        i.e. ``batch[:, :-1]``). Returns int64 ids on tokens.device:
        ``ngram`` [B, T, len(ngram_orders)] and ``value`` [n_layers, B, T]."""
        cfg, P = self.cfg, self.cfg.prefix
        B, L = tokens.shape
        T = L - P
        if T < 1:
            raise ValueError(f"tokens must be [B, P + T] with P={P}, T>=1; got {tuple(tokens.shape)}")
        tok = tokens.detach().cpu().numpy().astype(np.uint64)

        def window(offset: int) -> np.ndarray:  # byte at position t - offset, for t = 0..T-1
            return tok[:, P - offset: P - offset + T]

        ng = np.stack([hash_symbols(NGRAM_TAG + n, [window(j) for j in range(n - 1, -1, -1)])
                       for n in cfg.ngram_orders], axis=-1) % np.uint64(cfg.ngram_rows)
        prev, cur = window(1), window(0)
        val = np.stack([hash_symbols(VALUE_TAG + l, [prev, cur])
                        for l in range(cfg.n_layers)]) % np.uint64(cfg.value_rows)
        return {"ngram": torch.from_numpy(ng.astype(np.int64)).to(tokens.device),
                "value": torch.from_numpy(val.astype(np.int64)).to(tokens.device)}

    def unique_table_ids(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sorted-unique int64 row ids per table that ``loss(batch)`` touches."""
        return {k: torch.unique(v.reshape(-1), sorted=True) for k, v in self.table_ids(batch[:, :-1]).items()}

    def _lookup(self, name: str, ids: torch.Tensor, table_rows: TableRows | None) -> torch.Tensor:
        if table_rows is None or name not in table_rows:
            if name not in self.tables:
                raise KeyError(f"table {name!r} is not local to this model: pass its rows as table_rows")
            return F.embedding(ids, self.tables[name].weight)
        uids, rows = table_rows[name]
        flat = ids.reshape(-1).to(uids.device)
        pos = torch.searchsorted(uids, flat)
        ok = (pos < uids.numel()) & (uids[pos.clamp(max=max(uids.numel() - 1, 0))] == flat) \
            if uids.numel() else torch.zeros_like(flat, dtype=torch.bool)
        if not bool(ok.all()):
            missing = torch.unique(flat[~ok])[:8].tolist()
            raise KeyError(f"table_rows[{name!r}] lacks ids needed by the batch, e.g. {missing}")
        return rows[pos.to(rows.device)].view(*ids.shape, rows.shape[-1])

    # --- forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None,
                table_rows: TableRows | None = None) -> torch.Tensor:
        """x: [B, T] bytes; ctx: [B, <=P] preceding bytes (left-padded with PAD), or None."""
        cfg, P = self.cfg, self.cfg.prefix
        B, T = x.shape
        if T > cfg.context:
            raise ValueError(f"sequence length {T} exceeds context {cfg.context}")
        if ctx is None:
            ctx = x.new_full((B, P), PAD)
        elif ctx.shape[1] >= P:
            ctx = ctx[:, ctx.shape[1] - P:]
        else:
            ctx = torch.cat([x.new_full((B, P - ctx.shape[1]), PAD), ctx.to(x.device)], dim=1)
        ids = self.table_ids(torch.cat([ctx.to(x.device), x], dim=1))

        h = self.tok_emb(x) + self.pos_emb.weight[:T]
        h = h + self._lookup("ngram", ids["ngram"], table_rows).sum(dim=2)
        ve = self._lookup("value", ids["value"], table_rows)  # [n_layers, B, T, d]
        for layer, block in enumerate(self.blocks):
            h = block(h, ve[layer])
        return self.head(self.ln_f(h))

    def loss(self, batch: torch.Tensor, table_rows: TableRows | None = None) -> torch.Tensor:
        """Mean next-byte cross-entropy over ``batch`` [B, P + T + 1] (see module docstring)."""
        P = self.cfg.prefix
        if batch.shape[1] < P + 2:
            raise ValueError(f"batch must be [B, P + T + 1] with P={P}; got {tuple(batch.shape)}")
        ctx, x, y = batch[:, :P], batch[:, P:-1], batch[:, P + 1:]
        logits = self(x, ctx, table_rows)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------------------- sketch

_SKETCH_CHUNK = 1 << 16  # rows of the projection generated at a time


def _dense_tensors(module_or_params) -> list[torch.Tensor]:
    if isinstance(module_or_params, SwarmLM):
        return [p for _, p in module_or_params.dense_parameters()]
    if isinstance(module_or_params, nn.Module):
        return list(module_or_params.parameters())
    return [p[1] if isinstance(p, tuple) else p for p in module_or_params]


@torch.no_grad()
def param_sketch(module_or_params: nn.Module | Iterable, dim: int = 16, seed: int = 1234) -> list[float]:
    """Random projection R^n -> R^dim of the concatenated dense parameters (float64).

    The projection matrix is generated in chunks of 65536 rows from
    torch.Generator().manual_seed(seed) (chunk k covers elements [k*65536, (k+1)*65536)
    of the concatenation, in dense_parameters() order), so it never holds n*dim at once.
    A SwarmLM contributes only dense_parameters(); any other nn.Module all parameters;
    an iterable of tensors or (name, tensor) pairs is used as given.
    """
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in _dense_tensors(module_or_params)])
    g = torch.Generator().manual_seed(seed)
    acc = torch.zeros(dim, dtype=torch.float64)
    for start in range(0, flat.numel(), _SKETCH_CHUNK):
        chunk = flat[start:start + _SKETCH_CHUNK]
        proj = torch.randn(chunk.numel(), dim, generator=g, dtype=torch.float64)
        acc += chunk @ proj
    return (acc / math.sqrt(dim)).tolist()
