"""The verifier replica's health check: a broken or hung engine fails it (Serve then replaces the replica)."""
import asyncio
import threading
import time

import pytest

from eagle3ray import verifier_service
from eagle3ray.verifier import VerifierError


class FakeEngine:
    def __init__(self, fail=None, block: threading.Event | None = None):
        self.fail, self.block = fail, block
        self.probes, self.probe_fail = 0, None

    def probe(self):
        self.probes += 1
        if self.probe_fail is not None:
            raise self.probe_fail

    def extract(self, samples, storage_dtype):
        if self.block is not None:
            self.block.wait(10)
        if self.fail is not None:
            raise self.fail
        return [{"sample_id": s["sample_id"]} for s in samples]


class _Sync:
    """The replica with its coroutine health check run to completion (as Serve's event loop would)."""

    def __init__(self, r):
        self.r = r

    def __getattr__(self, name):
        return getattr(self.r, name)

    def check_health(self):
        return asyncio.run(self.r.check_health())


def replica(monkeypatch, engine, hang_s="1800"):
    monkeypatch.setenv("EAGLE3RAY_ENGINE_HANG_S", hang_s)
    monkeypatch.setattr(verifier_service, "make_engine", lambda spec: engine)
    cls = verifier_service.VerifierDeployment.func_or_class
    return _Sync(cls({}))


def test_a_healthy_replica_passes_and_bad_input_keeps_it_healthy(monkeypatch):
    r = replica(monkeypatch, FakeEngine())
    assert r.extract([{"sample_id": "a"}]) == [{"sample_id": "a"}]
    r.check_health()
    r.engine.fail = VerifierError("sample a: 9000 tokens > max_model_len")
    with pytest.raises(VerifierError):
        r.extract([{"sample_id": "a"}])
    r.check_health()  # the engine is fine; the input was not


def test_an_engine_failure_fails_the_health_check_and_every_later_call(monkeypatch):
    r = replica(monkeypatch, FakeEngine(fail=RuntimeError("EngineDeadError: EngineCore encountered an issue")))
    with pytest.raises(RuntimeError):
        r.extract([{"sample_id": "a"}])
    with pytest.raises(RuntimeError, match="engine failed: RuntimeError: EngineDeadError"):
        r.check_health()
    r.engine.fail = None
    with pytest.raises(RuntimeError, match="unhealthy, waiting for Serve to replace it"):
        r.extract([{"sample_id": "b"}])  # no call reaches a broken engine


def test_a_hung_call_fails_the_health_check(monkeypatch):
    release = threading.Event()
    r = replica(monkeypatch, FakeEngine(block=release), hang_s="0.2")
    t = threading.Thread(target=r.extract, args=([{"sample_id": "a"}],))
    t.start()
    time.sleep(0.5)
    with pytest.raises(RuntimeError, match="hung"):
        r.check_health()
    release.set()
    t.join()
    r.check_health()  # the call returned: healthy again


def test_a_call_past_its_own_deadline_fails_the_health_check(monkeypatch):
    """extract.unit_timeout_s travels with the call: the replica is unhealthy once that call runs past it, while
    the process-wide EAGLE3RAY_ENGINE_HANG_S (here 1800 s) would not have fired yet."""
    release = threading.Event()
    r = replica(monkeypatch, FakeEngine(block=release))
    t = threading.Thread(target=r.extract, args=([{"sample_id": "a"}], "bfloat16", 0.2))
    t.start()
    time.sleep(0.05)
    r.check_health()  # within its deadline
    time.sleep(0.4)
    with pytest.raises(RuntimeError, match="past its deadline of 0 s: hung"):
        r.check_health()
    release.set()
    t.join()
    r.check_health()


def test_a_unit_whose_every_attempt_times_out_raises_unit_timeout_naming_it_and_the_setting(caplog):
    """The client side of a hang, every attempt: each call that gets no answer within unit_timeout_s x
    (queue_depth + 1) is cancelled and sent again (logged), and after the last retry UnitTimeout names the unit and
    extract.unit_timeout_s. (A real hang in a live replica, once, is the cluster test's; here the service is a
    stand-in whose responses never answer.)"""
    from eagle3ray.extract import BlockWriter, UnitTimeout

    cancelled, sent = [], []

    class NeverAnswers:
        def result(self, timeout_s):
            time.sleep(min(timeout_s, 0.05))
            raise TimeoutError(f"no result in {timeout_s} s")

        def cancel(self):
            cancelled.append(1)

    class Method:
        def remote(self, *args):
            sent.append(args)
            return NeverAnswers()

    class Handle:
        extract = Method()

    w = BlockWriter.__new__(BlockWriter)
    w.handle, w.block_writer, w.storage_dtype = Handle(), "data_actor", "bfloat16"
    w.max_retries, w.retry_pause_s, w.unit_timeout_s, w.wait_s = 2, 0.0, 0.02, 0.04
    samples = [{"sample_id": f"s{i}", "input_ids": [1, 2, 3]} for i in range(3)]
    with caplog.at_level("WARNING", logger="eagle3ray.extract"):
        with pytest.raises(UnitTimeout, match=r"unit s0..s2 \(3 samples\): no answer in 0 s .*on all 3 attempts; "
                                              r"raise extract.unit_timeout_s"):
            w._call(samples)
    assert len(sent) == 3 and len(cancelled) == 3
    assert all(a[2] == 0.02 for a in sent)  # every call carries the replica's deadline
    assert caplog.text.count("retry ") == 2


def test_an_idle_engine_that_died_fails_the_probe_of_the_health_check(monkeypatch):
    """Item 5: the health check calls the engine (a one-token decode) once the replica has been idle
    EAGLE3RAY_ENGINE_PROBE_S: an engine that died while idle is found before a unit is sent to it."""
    monkeypatch.setenv("EAGLE3RAY_ENGINE_PROBE_S", "0")
    r = replica(monkeypatch, FakeEngine())
    r.check_health()
    assert r.engine.probes == 1  # idle: probed
    r.engine.probe_fail = RuntimeError("EngineDeadError: EngineCore encountered an issue")
    with pytest.raises(RuntimeError, match="engine failed its probe: RuntimeError: EngineDeadError"):
        r.check_health()
    with pytest.raises(RuntimeError, match="unhealthy"):
        r.extract([{"sample_id": "a"}])  # no unit reaches it; Serve replaces the replica


def test_the_probe_never_calls_the_engine_while_a_request_holds_it(monkeypatch):
    monkeypatch.setenv("EAGLE3RAY_ENGINE_PROBE_S", "0")
    gate = threading.Event()
    r = replica(monkeypatch, FakeEngine(block=gate))
    t = threading.Thread(target=r.extract, args=([{"sample_id": "a"}],))
    t.start()
    deadline = time.time() + 5
    while r.busy is None and time.time() < deadline:
        time.sleep(0.01)
    assert r.busy is not None
    r.check_health()  # within its deadline: healthy, and no probe beside the running call
    assert r.engine.probes == 0
    r.busy = None  # as if the request had just finished: the probe finds the engine still held and skips
    r.check_health()
    assert r.engine.probes == 0
    gate.set()
    t.join(5)
    r.check_health()
    assert r.engine.probes == 1


def test_the_service_announcement_does_not_wait_forever_behind_a_busy_replica(monkeypatch, capsys):
    """Every remote call has a timeout: the one-line announcement of a reused service asks its replica for info,
    which queues behind a running unit (one request at a time); past ANNOUNCE_TIMEOUT_S it says so and returns."""
    monkeypatch.setattr(verifier_service, "ANNOUNCE_TIMEOUT_S", 0.05)
    cancelled = []

    class Busy:
        def result(self, timeout_s=None):
            assert timeout_s == 0.05
            time.sleep(timeout_s)
            raise TimeoutError

        def cancel(self):
            cancelled.append(1)

    class Handle:
        class info:
            @staticmethod
            def remote():
                return Busy()

    verifier_service._announce("reused", "eagle3ray-verifier-x", Handle())
    assert "eagle3ray-verifier-x reused: its replica is busy with a request" in capsys.readouterr().out
    assert cancelled == [1]
