"""Host groups: the ranks of one torchrun on one host join the swarm together, moving rows and
dense gradients between themselves through torch.distributed (docs/design.md, "Host groups")."""
