"""A ResNet with BatchNorm (``transformers``' pure-PyTorch ResNet, built from a config) trained by a
swarm on images it generates: four classes of noisy 16x16 patterns (horizontal stripes, vertical
stripes, a checkerboard, a centred blob). BatchNorm's running statistics are buffers: the swarm
keeps them identical on every peer, like the parameters (docs/task.md, "Buffers").

PyPI's torchvision wheels need a CUDA build of torch; transformers' ResNet works with the CPU one.

    python3 -m pip install 'transformers>=4.40'         # or: pip install -e '.[examples]'
    python3 peer.py --task examples/resnet.py:task
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import ResNetConfig, ResNetForImageClassification

import swarm

SIZE, CLASSES = 16, 4


def patterns() -> torch.Tensor:
    """[CLASSES, 3, SIZE, SIZE] clean images of each class."""
    y, x = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
    r = ((y - SIZE / 2 + 0.5) ** 2 + (x - SIZE / 2 + 0.5) ** 2).sqrt()
    imgs = torch.stack([(y // 2 % 2).float(), (x // 2 % 2).float(), ((y // 4 + x // 4) % 2).float(),
                        (r < SIZE / 4).float()])
    return (imgs * 2 - 1).unsqueeze(1).expand(-1, 3, -1, -1).clone()


def make_batch(g: torch.Generator, n: int, clean: torch.Tensor, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    shift = torch.randint(0, 4, (n,), generator=g)
    imgs = torch.stack([torch.roll(clean[c], (int(s), int(s)), dims=(1, 2)) for c, s in zip(labels, shift)])
    return imgs + noise * torch.randn(imgs.shape, generator=g), labels


def task(batch_size: int = 32, lr: float = 2e-3, noise: float = 1.0, width: int = 16) -> swarm.Task:
    clean = patterns()
    cfg = ResNetConfig(num_channels=3, embedding_size=width, hidden_sizes=[width, 2 * width], depths=[1, 1],
                       layer_type="basic", num_labels=CLASSES, downsample_in_first_stage=False)

    def batches(shard: swarm.Shard):
        g = torch.Generator().manual_seed(shard.seed * 1000 + shard.epoch)
        while True:
            yield make_batch(g, batch_size, clean, noise)

    def eval_batches():
        g = torch.Generator().manual_seed(11)  # the same held-out images on every peer
        return [make_batch(g, 64, clean, noise) for _ in range(4)]

    def loss(model, batch):
        images, labels = batch
        return F.cross_entropy(model(pixel_values=images).logits, labels)

    return swarm.Task(
        name="resnet-patterns",
        model=lambda: ResNetForImageClassification(cfg),
        batches=batches,
        loss=loss,
        eval_batches=eval_batches,
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr),
    )
