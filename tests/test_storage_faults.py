"""Real storage failures in the middle of an extraction: a full disk (ENOSPC on a small tmpfs) and the S3 endpoint
going away (its TCP front stopped: connections reset, then refused). Each run fails naming the cause, leaves
what it committed intact and never looks complete; once storage is back, a re-run finishes with every sample
exactly once and no stray block left (docs/faults.md).

The verifier is the shared tiny vLLM engine of tests/test_extract.py (same identity: the service is reused).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from eagle3ray import blocks, storage
from eagle3ray.extract import extract
from eagle3ray.prepare import prepare

from conftest import fill_disk, free_port, write_chat_jsonl
from test_extract import _convs

pytestmark = pytest.mark.slow


class _Stop(Exception):
    pass


def _settle(cfg, quiet_s: float = 15.0, limit_s: float = 120.0) -> None:
    """Wait until no new file has appeared under ``hidden_states/blocks`` for ``quiet_s`` seconds (at most
    ``limit_s``): late writes of a failed run's writers land before the test goes on."""
    paths = storage.run_paths(cfg)
    t0 = seen_at = time.time()
    seen = None
    while time.time() - t0 < limit_s:
        paths.fs.invalidate_cache()
        try:
            now = set(paths.fs.ls(f"{paths.hidden_states}/blocks", detail=False))
        except FileNotFoundError:
            now = set()
        if now != seen:
            seen, seen_at = now, time.time()
        elif time.time() - seen_at >= quiet_s:
            return
        time.sleep(1.0)


def _state(cfg) -> dict:
    paths = storage.run_paths(cfg)
    paths.fs.invalidate_cache()
    man, _ = blocks.read_committed(paths.fs, paths.hidden_states)
    listed = sorted(b["path"] for b in man["blocks"])
    on_storage = sorted("blocks/" + f.rsplit("/", 1)[-1]
                        for f in paths.fs.ls(f"{paths.hidden_states}/blocks", detail=False))
    return {"complete": bool(man.get("complete")), "listed": listed, "on_storage": on_storage,
            "ids": blocks.committed_sample_ids(paths.fs, paths.hidden_states, man)}


def test_a_full_disk_mid_extraction_fails_naming_it_and_a_rerun_finishes_exactly_once(ray_session, tmp_path,
                                                                                      make_cfg, small_disk):
    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(24, words=25, seed=7))
    cfg = make_cfg([train], "extract.max_tokens_per_batch=256", storage=f"file://{small_disk}/runs")
    prepare(cfg)
    filler: list[str] = []

    def fill_after_two(manifest):
        if len(manifest["blocks"]) >= 2 and not filler:
            filler.append(fill_disk(small_disk))

    with pytest.raises(Exception) as e:
        extract(cfg, on_commit=fill_after_two, progress=False)
    assert filler, "the disk was never filled: the run ended first"
    assert "No space left on device" in str(e.value) or "ENOSPC" in str(e.value) or "Errno 28" in str(e.value)
    os.remove(filler[0])
    mid = _state(cfg)
    assert not mid["complete"] and len(mid["ids"]) == len(set(mid["ids"])) >= 2
    assert set(mid["listed"]) <= set(mid["on_storage"])  # every committed block is there
    s = extract(cfg, progress=False)
    assert s.resumed_from == len(mid["ids"])
    end = _state(cfg)
    assert end["complete"] and sorted(end["ids"]) == sorted(f"chat:c{i}" for i in range(24))
    assert end["listed"] == end["on_storage"]  # a block cut short by the full disk is an orphan, removed
    leftovers = [p for p in (small_disk / "runs").rglob("*") if p.is_file() and ".tmp" in p.name]
    assert not leftovers, leftovers


class TcpFront:
    """A TCP forwarder on 127.0.0.1 in front of a server, which a test can stop (live connections reset, new ones
    refused) and start again on the same port: the S3 endpoint going away and coming back with its data."""

    def __init__(self, target_port: int):
        self.target, self.port = target_port, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.start()

    def start(self) -> None:
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", self.port))
        self._srv.listen(64)
        self._running = True
        threading.Thread(target=self._accept, args=(self._srv,), daemon=True).start()

    def stop(self) -> None:
        self._running = False
        try:
            self._srv.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close() alone does not, on Linux)
        except OSError:
            pass
        self._srv.close()
        with self._lock:
            for c in self._conns:
                try:
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # RST, not FIN
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()
                except OSError:
                    pass
            self._conns.clear()

    def _accept(self, srv) -> None:
        while self._running:
            try:
                client, _ = srv.accept()
            except OSError:
                return
            if not self._running:
                client.close()
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass


def test_the_s3_endpoint_stopped_mid_extraction_fails_and_a_rerun_finishes_exactly_once(ray_session, tmp_path,
                                                                                          make_cfg, s3_endpoint):
    front = TcpFront(int(s3_endpoint.rsplit(":", 1)[1]))
    train = write_chat_jsonl(tmp_path / "train.jsonl", _convs(24, words=25, seed=8))
    cfg = make_cfg([train], "extract.max_tokens_per_batch=256", f"run.endpoint_url={front.url}",
                   storage="s3://eagle3ray/outage")
    prepare(cfg)
    stopped: list[int] = []

    def stop_after_two(manifest):
        if len(manifest["blocks"]) >= 2 and not stopped:
            front.stop()
            stopped.append(len(manifest["blocks"]))

    with pytest.raises(Exception) as e:
        extract(cfg, on_commit=stop_after_two, progress=False)
    assert stopped, "the endpoint was never stopped: the run ended first"
    msg = f"{e.value!r} {e.value}"
    assert f"127.0.0.1:{front.port}" in msg and ("Could not connect" in msg or "Connection" in msg), msg[:2000]
    front.start()
    # The failed run's block writers (Ray Data actors) may still be retrying a PUT that the outage cut; with the
    # endpoint back, such a block lands late. It is an orphan (never listed, never read) that a resume's start
    # sweep removes, but one landing after the rerun's end sweep would outlive it (seen once in CI, 2026-12-06):
    # let the listing settle so this test checks the rerun, not that race.
    _settle(cfg)
    mid = _state(cfg)
    assert not mid["complete"] and len(mid["ids"]) == len(set(mid["ids"])) >= 2
    assert set(mid["listed"]) <= set(mid["on_storage"])
    s = extract(cfg, progress=False)
    assert s.resumed_from == len(mid["ids"])
    end = _state(cfg)
    assert end["complete"] and sorted(end["ids"]) == sorted(f"chat:c{i}" for i in range(24))
    assert end["listed"] == end["on_storage"]
    front.stop()
