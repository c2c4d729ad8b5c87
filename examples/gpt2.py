"""A Hugging Face ``transformers`` GPT-2 trained by a swarm, its token embedding sharded.

The model is built from a config (random init, nothing downloaded); its token embedding
``transformer.wte`` is sharded across the peers, everything else is replicated. The LM head is
untied from the embedding (``tie_word_embeddings=False``): a sharded table cannot share its weight.
Text: the Python standard library's own sources, as bytes (vocabulary 256), so nothing is fetched.

    python3 -m pip install 'transformers>=4.40'         # or: pip install -e '.[examples]'
    python3 peer.py --task examples/gpt2.py:task
    python3 peer.py --task examples/gpt2.py:task --task-arg layers=4 --task-arg width=256 --join HOST:PORT
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import swarm

PACKAGES = ("json", "email", "asyncio", "http", "xml", "logging", "unittest", "concurrent")


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """(train, val) byte streams: a few stdlib packages' sources, every 10th file held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py") if "test" not in p.parts)
    train, val = [], []
    for p in files:
        held_out = hashlib.sha256(p.relative_to(root).as_posix().encode()).digest()[0] % 10 == 0
        (val if held_out else train).append(p.read_bytes())
    return np.frombuffer(b"".join(train), np.uint8), np.frombuffer(b"".join(val), np.uint8)


def task(layers: int = 2, width: int = 64, heads: int = 4, context: int = 64, batch_size: int = 8,
         lr: float = 1e-3, table_lr: float = 0.01) -> swarm.Task:
    train, val = corpus()
    cfg = GPT2Config(vocab_size=256, n_positions=context, n_embd=width, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)

    def windows(stream: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.stack([stream[s:s + context] for s in starts]).astype(np.int64))

    def batches(shard: swarm.Shard):
        part = np.array_split(train, shard.count)[shard.index]  # this peer's slice of the text
        rng = np.random.default_rng(shard.seed)
        while True:
            yield windows(part, rng.integers(0, len(part) - context, batch_size))

    def eval_batches():
        starts = np.linspace(0, len(val) - context - 1, 4 * batch_size).astype(np.int64)
        return [windows(val, starts[i:i + batch_size]) for i in range(0, len(starts), batch_size)]

    return swarm.Task(
        name="gpt2-bytes",
        model=lambda: GPT2LMHeadModel(cfg),
        batches=batches,
        loss=lambda model, ids: model(input_ids=ids, labels=ids).loss,
        eval_batches=eval_batches,
        tables={"transformer.wte": lambda ids: ids},
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        table_lr=table_lr,
        tokens_per_sample=context,
    )
