#!/usr/bin/env python3
"""Run one swarm peer. See README.md, or `python peer.py --help`."""

import sys

from swarm.cli import main

if __name__ == "__main__":
    sys.exit(main())
