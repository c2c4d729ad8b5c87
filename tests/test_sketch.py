"""param_sketch streams the concatenation chunk by chunk (swarm/sketch.py): its values must be the
ones its definition gives, bit for bit, since peers compare sketches across processes and runs."""
import math

import pytest
import torch

from swarm.sketch import SKETCH_CHUNK, param_sketch

torch.set_num_threads(1)


def reference(tensors, dim=16, seed=1234):
    """The definition, held whole: the float64 concatenation, projected by chunks of SKETCH_CHUNK
    rows generated in turn from one seeded generator."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    acc = torch.zeros(dim, dtype=torch.float64)
    for start in range(0, flat.numel(), SKETCH_CHUNK):
        chunk = flat[start:start + SKETCH_CHUNK]
        acc += chunk @ torch.randn(chunk.numel(), dim, generator=g, dtype=torch.float64)
    return (acc / math.sqrt(dim)).tolist()


C = SKETCH_CHUNK


@pytest.mark.parametrize("sizes", [[], [0], [7], [C], [C + 1], [C - 1, 2], [1, C - 1, 0, 2 * C + 3], [3 * C + 5]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_the_sketch_is_its_definition_bit_for_bit(sizes, dtype):
    gen = torch.Generator().manual_seed(sum(sizes) + 1)
    tensors = [(torch.randn(n, generator=gen) * 10).to(dtype) for n in sizes]
    for dim, seed in ((16, 1234), (3, 7)):
        assert param_sketch(tensors, dim=dim, seed=seed) == reference(tensors, dim, seed)


def test_pieces_and_names_sketch_as_their_concatenation():
    a, b = torch.randn(C + 10, 2), torch.randn(5)
    whole = torch.cat([a.reshape(-1), b])
    assert param_sketch([("a", a), ("b", b)]) == param_sketch([whole]) == reference([whole])
    assert param_sketch([]) == [0.0] * 16
