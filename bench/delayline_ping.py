#!/usr/bin/env python3
"""ICMP echo round trips to one address, for bench/wan.py's check of its delay line (this machine
has no `ping` binary). Needs root (a raw socket); run it inside a peer's namespace.

    python3 bench/delayline_ping.py 10.77.0.2 --count 5

Prints one line per reply and a last line `rtt min/avg/median/max = A/B/C/D ms, N/M replies` (what
bench/wan.py's parse_ping reads). The first round trip also resolves the address (ARP: one more
round trip), so the median is the figure to use. Exit 1 when no reply came back."""
from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import struct
import sys
import time


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of `data`."""
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def echo_request(ident: int, seq: int, payload: bytes = b"swarm-wan-ping") -> bytes:
    head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    return struct.pack("!BBHHH", 8, 0, checksum(head + payload), ident, seq) + payload


def main() -> int:
    ap = argparse.ArgumentParser(description="ICMP echo round-trip times (root)")
    ap.add_argument("host")
    ap.add_argument("--count", type=int, default=5)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each reply")
    a = ap.parse_args()
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    except PermissionError:
        print("delayline_ping.py needs root (a raw ICMP socket)", file=sys.stderr)
        return 2
    ident, rtts = os.getpid() & 0xFFFF, []
    for seq in range(1, a.count + 1):
        t0 = time.perf_counter()
        sock.sendto(echo_request(ident, seq), (a.host, 0))
        deadline = t0 + a.timeout
        while (left := deadline - time.perf_counter()) > 0:
            if not select.select([sock], [], [], left)[0]:
                break
            pkt = sock.recv(65535)
            ihl = (pkt[0] & 0x0F) * 4
            typ, _, _, rid, rseq = struct.unpack("!BBHHH", pkt[ihl:ihl + 8])
            if typ == 0 and rid == ident and rseq == seq:
                rtts.append((time.perf_counter() - t0) * 1000)
                print(f"reply from {a.host}: seq {seq} time {rtts[-1]:.2f} ms", flush=True)
                break
        time.sleep(a.interval)
    if not rtts:
        print(f"rtt none, 0/{a.count} replies")
        return 1
    med = statistics.median(rtts)
    print(f"rtt min/avg/median/max = {min(rtts):.2f}/{sum(rtts) / len(rtts):.2f}/{med:.2f}/{max(rtts):.2f} ms, "
          f"{len(rtts)}/{a.count} replies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
