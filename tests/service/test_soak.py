"""The soak test: concurrent clients on two servers doing random prefills, decodes, forks, releases and
transfers, with calls cancelled and streams dropped on the way, for SOAK_S seconds (20 in CI; ``make soak``
runs 600).

At the end every block of both servers is free, no sequence is left, every call got a status its client
could expect (OK; RESOURCE_EXHAUSTED when the pool is full; CANCELLED or DEADLINE_EXCEEDED for the calls it
cancelled itself), and each server's RSS is within SOAK_RSS_MIB (64) of its level after the warm-up.
"""

from __future__ import annotations

import collections
import os
import random
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from chunkattn_client import BatchEntry, ChunkAttnClient, ChunkAttnError, codec, wire
from chunkattn_client._pb.chunkattn.v1 import chunkattn_pb2 as pb
from tests.helpers.rawrpc import SERVICE, rss_mib
from tests.helpers.server_process import SMALL, ServerProcess

pytestmark = pytest.mark.server

H, HKV, D, LAYERS = 4, 2, 16, 4
SOAK_S = float(os.environ.get("SOAK_S", "20"))
RSS_BOUND_MIB = float(os.environ.get("SOAK_RSS_MIB", "64"))
CLIENTS = 6
OK, FULL = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED
OWN_CANCEL = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServerProcess, ServerProcess]]:
    flags = [*SMALL, "--num-blocks", "1024", "--idle-timeout-s", "0", "--stream-idle-s", "10"]
    with ServerProcess(*flags) as a, ServerProcess(*flags) as b:
        yield a, b


class Client:
    """One client's session: its sequences (id -> (server index, tokens in every layer)) and what it saw."""

    def __init__(self, n: int, targets: list[str], seed: int) -> None:
        self.n = n
        self.targets = targets
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.clients = [ChunkAttnClient(t, timeout_s=60) for t in targets]
        self.channels = [grpc.insecure_channel(t) for t in targets]
        self.seqs: dict[str, tuple[int, int]] = {}
        self.next = 0
        self.seen: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for ch in self.channels:
            ch.close()

    def _id(self) -> str:
        self.next += 1
        return f"c{self.n}-{self.next}"

    def _tensors(self, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(self.np.standard_normal((t, h, D), np.float32) for h in (H, HKV, HKV))  # type: ignore[return-value]

    def _note(self, op: str, code: grpc.StatusCode, expected: set[grpc.StatusCode], message: str = "") -> None:
        self.seen[f"{op} {code.name}"] += 1
        if code not in expected:
            self.unexpected.append(f"{op}: {code.name}: {message}")

    def _steps(self, server: int, seq: str, position: int, n: int, stream: bool) -> bool:
        """n tokens of ``seq`` through every layer (unary calls or one stream)."""
        c = self.clients[server]
        try:
            if stream:
                with c.stream() as s:
                    for layer in range(LAYERS):
                        out = s.attend(layer, [BatchEntry(seq, position, n)], *self._tensors(n))
                        assert np.isfinite(out).all()
            else:
                for layer in range(LAYERS):
                    out = c.attend(layer, [BatchEntry(seq, position, n)], *self._tensors(n))
                    assert np.isfinite(out).all()
        except ChunkAttnError as e:
            self._note("attend", e.code, {FULL}, e.message)
            self._forget(seq)
            return False
        self.seen["attend OK"] += 1
        return True

    def _forget(self, seq: str) -> None:
        """Release a sequence whose state the client no longer knows (a call failed or was cancelled midway)."""
        server = self.seqs.pop(seq, (None, 0))[0]
        for c in self.clients if server is None else [self.clients[server]]:
            c.release([seq], missing_ok=True)

    def step(self) -> None:
        op = self.rng.choice(
            ["prefill", "prefill", "decode", "decode", "decode", "fork", "release", "transfer", "cancel", "drop"]
        )
        mine = sorted(self.seqs)
        if op == "prefill" or not mine:
            seq, server = self._id(), self.rng.randrange(2)
            n = self.rng.randint(1, 40)
            if self._steps(server, seq, 0, n, self.rng.random() < 0.5):
                self.seqs[seq] = (server, n)
            return
        seq = self.rng.choice(mine)
        server, length = self.seqs[seq]
        if op == "decode":
            for i in range(self.rng.randint(1, 6)):
                if not self._steps(server, seq, length + i, 1, i % 2 == 0):
                    return
                self.seqs[seq] = (server, length + i + 1)
        elif op == "fork":
            child = self._id()
            try:
                self.clients[server].fork(seq, child)
            except ChunkAttnError as e:
                self._note("fork", e.code, {FULL}, e.message)
                return
            self.seen["fork OK"] += 1
            self.seqs[child] = (server, length)
        elif op == "release":
            self.clients[server].release([seq])
            self.seen["release OK"] += 1
            del self.seqs[seq]
        elif op == "transfer":
            other = 1 - server
            try:
                self.clients[server].transfer_kv(seq, self.targets[other], release_after=True)
            except ChunkAttnError as e:
                lost = e.code == grpc.StatusCode.UNAVAILABLE and "grpc/grpc#36066" in e.message  # see kv_service
                self._note("transfer", e.code, {FULL} | ({e.code} if lost else set()), e.message)
                return
            self.seen["transfer OK"] += 1
            self.seqs[seq] = (other, length)
        elif op == "cancel":
            q, k, v = (codec.to_raw(t) for t in self._tensors(1))
            entry = pb.SequenceEntry(seq_id=seq, position=length, num_tokens=1)
            request = wire.encode_attend_request(0, [entry], q, k, v)
            attend: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self.channels[server].unary_unary(SERVICE + "Attend")
            call = attend.future(request, timeout=self.rng.choice([0.0005, 5]))
            if self.rng.random() < 0.7:
                call.cancel()
            try:
                call.result()
                self.seen["attend OK"] += 1
            except grpc.FutureCancelledError:
                self.seen["attend CANCELLED"] += 1
            except grpc.RpcError as e:
                self._note("cancelled attend", e.code(), {FULL} | OWN_CANCEL, e.details() or "")
            self._forget(seq)  # whether layer 0 took the token is not known: start over
        elif op == "drop":
            s = self.clients[server].stream()
            try:
                s.attend(0, [BatchEntry(seq, length, 1)], *self._tensors(1))
            except ChunkAttnError as e:
                self._note("streamed attend", e.code, {FULL}, e.message)
            s.cancel()  # dropped mid-session, without closing
            self.seen["stream dropped"] += 1
            self._forget(seq)

    def finish(self) -> None:
        for seq in list(self.seqs):
            self._forget(seq)


def state(s: ServerProcess) -> tuple[int, int, int]:
    with ChunkAttnClient(s.target) as c:
        info = c.info()
    return info.free_blocks, info.num_blocks, info.active_sequences


def test_soak(servers: tuple[ServerProcess, ServerProcess]) -> None:
    a, b = servers
    targets = [a.target, b.target]
    clients = [Client(i, targets, seed=i) for i in range(CLIENTS)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(c: Client) -> None:
        try:
            while not stop.is_set():
                c.step()
            c.finish()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    time.sleep(min(10.0, SOAK_S / 4))
    warm = [rss_mib(s.proc.pid) for s in servers]
    time.sleep(max(0.0, SOAK_S - min(10.0, SOAK_S / 4)))
    stop.set()
    for t in threads:
        t.join(120)
    for c in clients:
        c.close()
    end = [rss_mib(s.proc.pid) for s in servers]
    seen = sum((c.seen for c in clients), collections.Counter())
    print(f"\nsoak: {SOAK_S:g} s, {CLIENTS} clients, {sum(seen.values())} operations: {dict(seen.most_common())}")
    print(f"soak: RSS after warm-up {warm[0]:.0f} / {warm[1]:.0f} MiB, at the end {end[0]:.0f} / {end[1]:.0f} MiB")
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads), "a client hung"
    unexpected = [u for c in clients for u in c.unexpected]
    assert not unexpected, unexpected[:10]
    for s in servers:
        free, total, active = state(s)
        assert (free, active) == (total, 0), f"{s.target}: {total - free} blocks and {active} sequences left"
    for w, e in zip(warm, end, strict=True):
        assert e - w < RSS_BOUND_MIB, f"RSS grew from {w:.0f} to {e:.0f} MiB"
