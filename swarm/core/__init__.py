"""The peer's protocol decisions, sans-I/O: typed member metadata (meta.py), which peers a round
expects and when a peer is behind (rounds.py), and the peer's lifecycle (lifecycle.py). Plain,
synchronous functions of their inputs (metadata, the round book's counters, ``now``): the step
loop in swarm/node.py asks them and carries out what they say."""
