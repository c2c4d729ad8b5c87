"""Self-certifying peers and TLS (docs/security.md): keys and ids (swarm/identity.py), where they are
kept (swarm/credentials.py), a payload or request that names another peer, a request replayed to a
second member, a proxy between two peers that sees only ciphertext and cannot alter a reply, a
wrong pinned fingerprint, and a restarted first peer whose printed join command still works."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import stat
import time

import aiohttp
import pytest
import torch

from swarm import auth, credentials, identity
from swarm.cli import parse_config
from swarm.codec import HEADER, CodecConfig, Compressor
from swarm.config import ConfigError, PeerConfig
from swarm.identity import PeerKey
from swarm.node import Peer
from swarm.server import UNAUTHORIZED_REASON
from swarm.transport import PeerUnreachable

from .conftest import free_port, pin, small_cfg

pytestmark = pytest.mark.timeout(180)

SECRET = "correct horse battery staple 42"


# -- keys, ids, certificates ---------------------------------------------------------------------

def test_an_id_is_its_key_and_a_key_file_keeps_it(tmp_path):
    k = PeerKey.generate()
    assert len(k.id) == identity.ID_HEX and k.id == identity.peer_id_of(k.public)
    assert identity.owns(k.public, k.id) and identity.owns(k.public, f"{k.id}~2")
    other = PeerKey.generate()
    for pid in (other.id, f"{k.id}~", f"{k.id}~x", f"{k.id}~01", k.id.upper(), "", 5):
        assert not identity.owns(k.public, pid), pid
    assert not identity.owns(b"short", k.id)
    path = str(tmp_path / "sub" / "peer.key")
    k2, created = PeerKey.load_or_create(path)
    assert created and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    k3, created = PeerKey.load_or_create(path)
    assert not created and k3.id == k2.id and k3.fingerprint() == k2.fingerprint()
    assert "BEGIN PRIVATE KEY" not in repr(k3) and k3.id in repr(k3)
    (tmp_path / "junk.key").write_bytes(b"not a key")
    with pytest.raises(identity.KeyFileError, match="not an unencrypted PEM private key"):
        PeerKey.load(str(tmp_path / "junk.key"))
    with pytest.raises(identity.KeyFileError, match="cannot read"):
        PeerKey.load(str(tmp_path / "missing.key"))


def test_the_certificate_is_a_function_of_the_key_and_signatures_check():
    k = PeerKey.from_seed(b"\x07" * 32)
    again = PeerKey.from_seed(b"\x07" * 32)
    assert k.cert_der() == again.cert_der() and k.fingerprint() == again.fingerprint()
    assert k.fingerprint() == identity.fingerprint_hex(k.cert_der()) != PeerKey.generate().fingerprint()
    sig = k.sign(b"data")
    assert identity.verify(k.public, sig, b"data")
    assert not identity.verify(k.public, sig, b"datA")
    assert not identity.verify(PeerKey.generate().public, sig, b"data")
    for pub, s in ((b"", sig), (k.public, b""), (k.public, sig[:-1]), (b"\x00" * 32, sig), ("x", sig)):
        assert not identity.verify(pub, s, b"data")
    assert identity.unb64(identity.b64(k.public), 32) == k.public
    for junk in ("", "A" * 42, "A" * 44, "!" * 43, None):
        assert identity.unb64(junk, 32) is None
    fp = k.fingerprint()
    assert identity.parse_fingerprint(fp.upper()) == bytes.fromhex(fp)
    assert identity.parse_fingerprint(":".join(fp[i:i + 2] for i in range(0, 64, 2))) == bytes.fromhex(fp)
    for bad in ("", "ab", fp + "0", "g" * 64):
        with pytest.raises(ValueError, match="64 hex digits"):
            identity.parse_fingerprint(bad)


def test_credentials_live_in_the_key_file_or_the_checkpoint(tmp_path):
    assert credentials.key_path(PeerConfig()) == ""
    assert credentials.key_path(PeerConfig(checkpoint=str(tmp_path))) == str(tmp_path / identity.KEY_FILE)
    assert credentials.key_path(PeerConfig(checkpoint=str(tmp_path), key_file="/x/k")) == "/x/k"
    key, where = credentials.load_key(PeerConfig(checkpoint=str(tmp_path)))
    assert "a new key, saved in" in where and credentials.load_key(PeerConfig(checkpoint=str(tmp_path)))[0].id == key.id
    cfg = PeerConfig(checkpoint=str(tmp_path), secret="generate")
    secret, kept = credentials.generated_secret(cfg)
    assert not kept and len(secret) >= 40
    assert stat.S_IMODE(os.stat(tmp_path / "peer.key.secret").st_mode) == 0o600
    assert credentials.generated_secret(cfg) == (secret, True)
    (tmp_path / "peer.key.secret").write_text("short\n")
    with pytest.raises(ConfigError, match="does not hold a secret"):
        credentials.generated_secret(cfg)
    (tmp_path / "bad.key").write_text("junk")
    with pytest.raises(ConfigError, match="bad.key is not an unencrypted PEM"):
        credentials.load_key(PeerConfig(key_file=str(tmp_path / "bad.key")))
    # nothing kept without a place for it: a new key (and id) every start
    assert credentials.load_key(PeerConfig())[0].id != credentials.load_key(PeerConfig())[0].id
    assert credentials.generated_secret(PeerConfig(secret="generate"))[1] is False


def test_a_generated_secret_never_reads_as_a_flag_and_the_printed_join_command_parses(capsys):
    """A URL-safe token starts with "-" one time in 64: the printed ``--secret -x...`` then failed
    with argparse's "expected one argument" (seen in CI)."""
    made = [auth.generate_secret() for _ in range(2000)]
    assert all(len(s) == 43 and s.isalnum() and s.isascii() for s in made) and len(set(made)) == 2000
    for secret in (made[0], "-starts-with-a-dash-0123456789", "has space and 'quote'"):
        argv = shlex.split(f"--join 127.0.0.1:9#{'ab' * 32} {credentials.secret_arg(secret)}")
        assert parse_config(argv)[0].secret == secret
    with pytest.raises(SystemExit):
        parse_config(["--secret", "-starts-with-a-dash-0123456789"])
    assert "goes as --FLAG=VALUE" in capsys.readouterr().err


# -- requests and payloads that name another peer ------------------------------------------------

async def start(**kw) -> Peer:
    p = Peer(small_cfg(**kw), out=lambda line: None)
    await p.start()
    return p


async def post(s, p: Peer, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    async with s.post(p.addr + path, data=body, headers=headers, ssl=pin(p)) as r:
        return r.status, await r.json(content_type=None)


async def test_a_payload_naming_another_peer_and_a_request_replayed_to_another_member_are_refused():
    a, b = await start(secret=SECRET), await start(secret=SECRET)
    signer = auth.Signer(PeerKey.from_seed(b"\x09" * 32), None, SECRET)
    stranger = PeerKey.from_seed(b"\x0a" * 32).id
    try:
        comp = Compressor(a.replica.manifest, CodecConfig(mode="topk-int8", ratio=0.01), sender=stranger)
        enc = comp.compress(torch.ones(a.replica.numel), 0)
        hdr = {HEADER: enc.mode, "Content-Type": "application/octet-stream"}
        async with aiohttp.ClientSession() as s:
            h = signer.headers("POST", "/v1/grads", enc.blob, time.time(), a.id)
            status, reply = await post(s, a, "/v1/grads", enc.blob, {**hdr, **h})
            assert status == 403 and reply["code"] == "sender" and "signed by" in reply["error"]
            # named by its signer, the same payload gets past that check (to "not a member")
            own = Compressor(a.replica.manifest, CodecConfig(mode="topk-int8", ratio=0.01), sender=signer.peer_id)
            enc2 = own.compress(torch.ones(a.replica.numel), 0)
            h2 = signer.headers("POST", "/v1/grads", enc2.blob, time.time(), a.id)
            status, reply = await post(s, a, "/v1/grads", enc2.blob, {**hdr, **h2})
            assert status == 409 and reply["code"] == "unknown-sender"
            # a request signed for a, captured and replayed to b, within the clock window
            status, _ = await post(s, b, "/v1/grads", enc2.blob, {**hdr, **h2})
            assert status == 401
            fresh = signer.headers("POST", "/v1/grads", enc2.blob, time.time(), a.id)
            status, _ = await post(s, b, "/v1/grads", enc2.blob, {**hdr, **fresh})
            assert status == 401  # named for a, whatever its nonce
        assert a.rejected["sender"] == 2 and b.verifier.refused == 2 and b.verifier.accepted == 0
    finally:
        await a.close()
        await b.close()


# -- a proxy between two peers -------------------------------------------------------------------

class Proxy:
    """A TCP relay that records both directions and, when told, flips a byte of what it forwards."""

    def __init__(self) -> None:
        self.target: int | None = None
        self.seen = bytearray()
        self.tamper = ""  # "", "reply" (server -> client) or "request"
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            w.close()
            return
        await asyncio.gather(self._pipe(r, uw, "request"), self._pipe(ur, w, "reply"), return_exceptions=True)

    async def _pipe(self, r, w, direction: str) -> None:
        try:
            while data := await r.read(65536):
                self.seen += data
                if self.tamper == direction and len(data) > 64:
                    data = data[:-20] + bytes([data[-20] ^ 1]) + data[-19:]
                w.write(data)
                await w.drain()
        finally:
            w.close()

    async def close(self) -> None:
        self.server.close()


async def test_a_proxy_between_two_peers_sees_no_plaintext_and_cannot_alter_a_reply():
    pa, pb = Proxy(), Proxy()
    port_a, port_b = await pa.start(), await pb.start()
    # each peer advertises its proxy: every byte between them goes through one
    pa.target, pb.target = free_port(), free_port()
    a = await start(secret=SECRET, steps=3, min_peers=2, port=pa.target, advertise=f"127.0.0.1:{port_a}")
    b = await start(secret=SECRET, steps=3, min_peers=2, port=pb.target, advertise=f"127.0.0.1:{port_b}",
                    join=f"127.0.0.1:{port_a}")
    try:
        # a byte altered in a reply (or a request): refused (the TLS record does not authenticate)
        c = Peer(small_cfg(secret=SECRET), out=lambda line: None)
        await c.start()
        try:
            c.transport.pin_of = lambda peer_id: b.key.fingerprint()
            body = await c.transport.request("GET", b.addr + "/v1/swarm", to=b.id, timeout=5.0)
            assert body  # untouched: fine
            for direction in ("reply", "request"):
                pb.tamper = direction
                with pytest.raises(PeerUnreachable):
                    await c.transport.request("GET", b.addr + "/v1/swarm", to=b.id, timeout=5.0)
            pb.tamper = ""
            # a proxy that terminates TLS itself has another certificate: the pin refuses it
            c.transport.pin_of = lambda peer_id: a.key.fingerprint()
            with pytest.raises(PeerUnreachable, match="not the pinned"):
                await c.transport.request("GET", b.addr + "/v1/swarm", to=b.id, timeout=5.0)
        finally:
            await c.close()
        ra, rb = await asyncio.wait_for(asyncio.gather(a.run(), b.run()), 150)
        assert ra["steps"] == rb["steps"] == 3 and ra["bytes_received"] > 0 and rb["bytes_received"] > 0
        seen = bytes(pa.seen + pb.seen)
        assert len(seen) > 50_000
        for plain in (b"X-Swarm", b"HTTP/1.1", b"__metadata__", b"membership", b"swarm-peer", b"application/",
                      a.id.encode(), b.id.encode(), SECRET.encode()):
            assert plain not in seen, plain
    finally:
        for p in (a, b):
            await p.close()
        await pa.close()
        await pb.close()


# -- the command line ----------------------------------------------------------------------------

async def test_a_wrong_fingerprint_or_secret_is_one_line_and_a_restarted_first_peer_keeps_its_id_and_join_command(
        spawn, tmp_path):
    from .test_peer_cli import run_cli

    port = free_port()
    args = ("--secret", "generate", "--checkpoint", str(tmp_path / "first"), "--port", str(port),
            "--min-peers", "2", "--steps", "3", "--checkpoint-every", "3600")
    first = spawn(*args)
    pid = (await first.read_until(r"as peer ([0-9a-f]{32})")).group(1)
    m = await first.read_until(r"join this swarm with: (python3 peer.py --join (\S+)#([0-9a-f]{64}) --secret (\S+))")
    command, where, fp, secret = m.groups()
    loop = asyncio.get_running_loop()
    wrong = ("0" if fp[0] != "0" else "1") + fp[1:]
    # a wrong fingerprint, and the right certificate but a wrong secret (a generated secret may
    # start with "x"): both joins at once, each its own `python peer.py`
    bad = ("y" if secret[0] == "x" else "x") + secret[1:]
    r, r_bad = await asyncio.gather(
        loop.run_in_executor(None, lambda: run_cli("--table-rows", "4096", "--join", f"{where}#{wrong}",
                                                   "--secret", secret, "--join-timeout", "3")),
        loop.run_in_executor(None, lambda: run_cli("--table-rows", "4096", "--join", f"{where}#{fp}",
                                                   "--secret", bad)))
    assert r.returncode == 2, r.stderr
    err = [line for line in r.stderr.strip().splitlines() if line]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"is not the peer --join {where}#{wrong} names" in err[0] and "not the pinned" in err[0]
    # the right certificate but a wrong secret: refused, one line, exit 2
    r = r_bad
    err = [line for line in r.stderr.strip().splitlines() if line]
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "refused to let us join" in err[0] and UNAUTHORIZED_REASON in err[0]
    first.kill(signal.SIGTERM)
    await first.finish(60)
    again = spawn(*args)
    # the first run's join command, started with the restart (it retries until the peer listens)
    joiner = spawn(*command.split()[2:], "--min-peers", "2", "--steps", "3", "--join-timeout", "60")
    assert (await again.read_until(r"as peer ([0-9a-f]{32})")).group(1) == pid
    m2 = await again.read_until(r"join this swarm with: (python3 peer.py --join \S+ --secret \S+)")
    assert m2.group(1) == command  # the same address, certificate and secret
    (ca, sa), (cb, sb) = await asyncio.gather(again.finish(150), joiner.finish(150))
    assert ca == 0 and cb == 0 and sa["steps"] == sb["steps"] == 3
    assert sa["peer_id"] == pid and sb["peer_id"] != pid
