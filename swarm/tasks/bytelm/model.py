"""The default swarm model: a small byte-level transformer LM with two hashed tables.

Reads top to bottom:
  1. ModelConfig          -- the whole configuration as one dataclass
  2. the hashed ids       -- swarm.hashing's mix64 / hash_symbols, numpy uint64, wrapping mod 2**64
  3. the transformer      -- pre-LayerNorm blocks, causal SDPA attention, 4x GELU MLP
  4. SwarmLM              -- embeddings + hashed n-gram table (``ngram``) + hashed value
                             embeddings (``value``): the two tables a swarm shards

Batch layout (shared with swarm.tasks.bytelm.corpus): a LongTensor ``batch`` of shape [B, P + T + 1]
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

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ...hashing import hash_symbols, mix64
from ...sketch import param_sketch
from ...tables.embedding import ShardedEmbedding

__all__ = ["ModelConfig", "SwarmLM", "TABLES", "PAD", "NGRAM_TAG", "VALUE_TAG", "table_ids", "hash_symbols", "mix64",
           "param_sketch"]

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
    # False: the tables are ShardedEmbeddings whose rows live on their owners across the swarm
    # (swarm/tables); the model allocates no table memory
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
# swarm.hashing's mix64 / hash_symbols (bit-exact uint64 arithmetic, wrapping mod 2**64):
#   n-gram row   (order n, bytes b_{t-n+1}..b_t oldest first):
#              hash_symbols(NGRAM_TAG + n, b_{t-n+1}, ..., b_t) % ngram_rows
#   value row    (layer l, previous byte p = b_{t-1}, current byte c = b_t):
#              hash_symbols(VALUE_TAG + l, p, c) % value_rows

NGRAM_TAG = 0x6E6772616D000000  # b"ngram\0\0\0" big-endian
VALUE_TAG = 0x76616C7565000000  # b"value\0\0\0" big-endian


def table_ids(cfg: ModelConfig, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Row ids for the input stream ``tokens`` = [B, P + T] (context bytes then inputs, i.e.
    ``batch[:, :-1]``). Returns int64 ids on tokens.device: ``ngram`` [B, T, len(ngram_orders)] and
    ``value`` [n_layers, B, T]."""
    P = cfg.prefix
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
        # the hashed tables, last so that they draw nothing from the init order of the rest:
        # local nn.Embeddings, or (in a swarm) ShardedEmbeddings whose zero rows live on their owners
        if cfg.local_tables:
            self.ngram: nn.Module = nn.Embedding(cfg.ngram_rows, d)
            self.value: nn.Module = nn.Embedding(cfg.value_rows, d)
        else:
            self.ngram = ShardedEmbedding(cfg.ngram_rows, d, std=0.0)
            self.value = ShardedEmbedding(cfg.value_rows, d, std=0.0)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from cfg.seed, in named_parameters() order, local generator."""
        g = torch.Generator().manual_seed(self.cfg.seed)
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        norm_params = {id(p) for m in self.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
        for name, p in self.named_parameters():
            if name.split(".", 1)[0] in TABLES:
                p.zero_()
            elif id(p) in norm_params:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                std = out_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)

    # --- parameter groups ---------------------------------------------------------------

    def dense_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if n.split(".", 1)[0] not in TABLES]

    def table_parameters(self) -> dict[str, nn.Parameter]:
        return {name: getattr(self, name).weight for name in TABLES if isinstance(getattr(self, name), nn.Embedding)}

    # --- hashed table ids ---------------------------------------------------------------

    def table_ids(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """See the module-level table_ids."""
        return table_ids(self.cfg, tokens)

    def unique_table_ids(self, batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sorted-unique int64 row ids per table that ``loss(batch)`` touches."""
        return {k: torch.unique(v.reshape(-1), sorted=True) for k, v in self.table_ids(batch[:, :-1]).items()}

    # --- forward ------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor:
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
        h = h + self.ngram(ids["ngram"]).sum(dim=2)
        ve = self.value(ids["value"])  # [n_layers, B, T, d]
        for layer, block in enumerate(self.blocks):
            h = block(h, ve[layer])
        return self.head(self.ln_f(h))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy over ``batch`` [B, P + T + 1] (see module docstring)."""
        P = self.cfg.prefix
        if batch.shape[1] < P + 2:
            raise ValueError(f"batch must be [B, P + T + 1] with P={P}; got {tuple(batch.shape)}")
        ctx, x, y = batch[:, :P], batch[:, P:-1], batch[:, P + 1:]
        logits = self(x, ctx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
