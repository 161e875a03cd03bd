"""One writer per run: a real second process is refused, a killed holder's lease expires and is taken over."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from eagle3ray import lease, storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def holder(uri: str, ttl: float, seconds: float) -> subprocess.Popen:
    """A separate process holding the run's lease for ``seconds``; prints READY once it holds it."""
    code = textwrap.dedent(f"""
        import time
        from eagle3ray import lease, storage
        paths = storage.RunPaths.create({uri!r}, "r")
        lease.exit_on_sigterm()
        with lease.held(paths, "extract", ttl_s={ttl}):
            print("READY", flush=True)
            time.sleep({seconds})
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "READY"
    return p


def test_a_second_writer_is_refused_naming_the_holder_and_the_lease_goes_with_it(tmp_path):
    uri = f"file://{tmp_path}"
    paths = storage.RunPaths.create(uri, "r")
    p = holder(uri, ttl=30, seconds=60)
    try:
        with pytest.raises(lease.LeaseHeld) as e:
            lease.acquire(paths, "train")
        msg = str(e.value)
        assert f"pid {p.pid}" in msg and "stage extract" in msg and "writer.lease" in msg and "since" in msg
    finally:
        p.terminate()  # SIGTERM (what `ray job stop` sends): the holder exits through its finally blocks
        p.wait()
    assert not paths.fs.exists(lease.lease_path(paths))
    lease.release(paths, lease.acquire(paths, "train"))


def test_a_normal_exit_releases_the_lease(tmp_path):
    uri = f"file://{tmp_path}"
    paths = storage.RunPaths.create(uri, "r")
    p = holder(uri, ttl=30, seconds=0.2)
    assert p.wait() == 0
    assert not paths.fs.exists(lease.lease_path(paths))
    me = lease.acquire(paths, "prepare")
    lease.release(paths, me)


def test_a_killed_holders_lease_on_this_host_is_taken_over_at_once(tmp_path):
    uri = f"file://{tmp_path}"
    paths = storage.RunPaths.create(uri, "r")
    p = holder(uri, ttl=30, seconds=60)
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(paths, "train")
    os.kill(p.pid, signal.SIGKILL)  # a driver SIGKILLed (OOM killer, kill -9): nothing released the lease
    p.wait()
    assert storage.read_json(paths.fs, lease.lease_path(paths))["pid"] == p.pid
    me = lease.acquire(paths, "train")  # its pid is gone from this host: no need to wait out the 30 s ttl
    assert storage.read_json(paths.fs, lease.lease_path(paths))["token"] == me["token"]


def test_a_lease_of_another_host_is_taken_over_only_when_expired(tmp_path):
    import json

    uri = f"file://{tmp_path}"
    paths = storage.RunPaths.create(uri, "r")
    other = {"token": "x", "host": "another-node", "pid": 999999, "stage": "extract", "since": time.time(),
             "renewed_at": time.time()}  # a pid that does not exist here: only the ttl may say it is gone
    paths.fs.makedirs(paths.uri.removeprefix("file://"), exist_ok=True)
    paths.fs.pipe_file(lease.lease_path(paths), json.dumps(other).encode())
    with pytest.raises(lease.LeaseHeld, match="host another-node"):
        lease.acquire(paths, "train", ttl_s=1.5)
    time.sleep(2.0)  # not renewed for longer than the ttl (its node was lost)
    me = lease.acquire(paths, "train", ttl_s=1.5)
    assert storage.read_json(paths.fs, lease.lease_path(paths))["token"] == me["token"]


def test_the_cli_refuses_a_second_writer_before_any_work(tmp_path):
    uri = f"file://{tmp_path}"
    p = holder(uri, ttl=30, seconds=60)
    try:
        t = time.time()
        r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "eagle3ray"), "prepare",
                            f"run.storage={uri}", "run.name=r", "data.max_samples=4"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 1, r.stderr[-2000:]
        assert "another writer holds this run" in r.stderr and f"pid {p.pid}" in r.stderr
        assert not os.path.exists(tmp_path / "r" / "conversations")  # nothing was written
    finally:
        p.kill()
        p.wait()


def test_exclusive_create_on_object_storage(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    paths = storage.RunPaths.create("s3://eagle3ray/runs", "r", s3_endpoint)
    me = lease.acquire(paths, "extract")
    with pytest.raises(lease.LeaseHeld, match="another writer holds this run"):
        lease.acquire(paths, "extract")
    assert lease.renew(paths, me)
    lease.release(paths, me)
    lease.release(paths, lease.acquire(paths, "train"))


def test_temp_files_of_a_writer_killed_mid_write_are_removed_by_the_next_holder(tmp_path):
    """A writer SIGKILLed inside write_bytes_atomic (after its temp file is written, before the rename) leaves
    ``manifest.json.tmp-*``; the next holder of the lease (taken over at once: same host, its pid gone) removes it,
    and the temp files of killed writers elsewhere in the run (vocab, checkpoints), while a young temp lease file
    (another process trying to take the lease) stays."""
    uri = f"file://{tmp_path}"
    paths = storage.RunPaths.create(uri, "r")
    code = textwrap.dedent(f"""
        import os, time
        from eagle3ray import lease, storage
        paths = storage.RunPaths.create({uri!r}, "r")
        with lease.held(paths, "extract"):
            os.replace = lambda *a: (print("WRITTEN", flush=True), time.sleep(600))  # killed before the rename
            storage.write_bytes_atomic(paths.fs, paths.sub("hidden_states", "manifest.json"), b"{{}}" * 1000)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "WRITTEN"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    left = list((tmp_path / "r" / "hidden_states").glob("manifest.json.tmp-*"))
    assert len(left) == 1 and left[0].stat().st_size == 2000  # the killed writer's temp file, whole
    for rel in ("vocab/vocab.json.tmp-0badc0de", "checkpoints/metrics.jsonl.tmp-deadbeef"):
        (tmp_path / "r" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "r" / rel).write_text("half")
    attempt = tmp_path / "r" / "writer.lease.tmp-12345678"  # another process's lease attempt, in flight
    attempt.write_text("{}")
    not_ours = tmp_path / "r" / "reports" / "notes.tmp-keep.txt"
    not_ours.parent.mkdir(parents=True)
    not_ours.write_text("a user's file")
    with lease.held(paths, "extract"):
        assert not left[0].exists()
        assert not (tmp_path / "r" / "vocab" / "vocab.json.tmp-0badc0de").exists()
        assert not (tmp_path / "r" / "checkpoints" / "metrics.jsonl.tmp-deadbeef").exists()
        assert attempt.exists() and not_ours.exists()
    assert attempt.exists()
    old = time.time() - 2 * lease.TEMP_MIN_AGE_S
    os.utime(attempt, (old, old))  # an attempt that old was a killed process's too
    with lease.held(paths, "extract"):
        assert not attempt.exists()


def test_a_held_lease_is_renewed_while_the_work_runs_and_a_taken_over_one_is_not_overwritten(tmp_path, caplog):
    """held() renews every ttl/3 in its thread: a stage longer than the ttl keeps its lease (another writer is
    refused after several ttls), and once another writer took the lease over, the renewal logs it and writes
    nothing over the new holder's lease."""
    paths = storage.RunPaths.create(f"file://{tmp_path}", "r")
    ttl = 0.6
    with lease.held(paths, "extract", ttl_s=ttl) as me:
        first = me["renewed_at"]
        time.sleep(3 * ttl)  # three ttls: without renewal the lease would have expired twice over
        cur = json.loads((tmp_path / "r" / lease.LEASE_FILE).read_text())
        assert cur["token"] == me["token"] and cur["renewed_at"] > first + ttl
        with pytest.raises(lease.LeaseHeld):
            lease.acquire(paths, "train", ttl_s=ttl)
        thief = dict(cur, token="another-writer", pid=cur["pid"] + 1)
        (tmp_path / "r" / lease.LEASE_FILE).write_text(json.dumps(thief))  # taken over (as after an expiry)
        with caplog.at_level("ERROR", logger="eagle3ray.lease"):
            time.sleep(ttl)
        assert json.loads((tmp_path / "r" / lease.LEASE_FILE).read_text())["token"] == "another-writer"
        assert "taken over by another writer" in caplog.text
