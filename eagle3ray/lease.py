"""One writer per run: a lease file at ``<run>/writer.lease``, created exclusively, renewed while the writer works.

Two jobs writing the same run (a resubmitted Ray Job, a laptop run and a RayJob on the same ``s3://`` prefix)
would each rewrite the manifests and delete the other's blocks. Every stage that writes a run holds its lease
(:func:`held`, used by :func:`eagle3ray.pipeline.run_stage`):

- **acquire**: create ``writer.lease`` exclusively: ``O_CREAT | O_EXCL`` on local disk, a conditional put
  (``If-None-Match: *``, s3fs ``mode="create"``) on object stores. The lease records the holder: host, pid,
  Ray job id (when run as a Ray Job), the command, since when, and when it was last renewed;
- **renew**: a daemon thread rewrites ``renewed_at`` every ``ttl / 3`` seconds while the stage runs, after
  checking that the lease on storage is still its own;
- **release**: the lease is deleted when the stage ends (normally or by an exception);
- **refuse**: a second writer finds the lease and raises :class:`LeaseHeld`, naming the holder and how to take
  over; **take over**: a lease not renewed for ``ttl`` seconds (its holder was killed, or its node lost), or one
  whose holder ran on this host and whose process is gone (a driver SIGKILLed here), is removed and acquired anew
  by the next writer, which logs whose lease it took.

Limits: taking over an expired lease is read-check-delete-create, so two writers that find the same expired
lease at the same instant may both delete it; the exclusive create then lets only one of them in, unless the
second delete lands after the first create (a window of one storage round trip). Behind the lease, the manifest's
writes are conditional too (:class:`eagle3ray.blocks.ManifestConflict`): each commit file is created exclusively,
and a snapshot rewrite first checks that the stored snapshot is still the version this writer read.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager

from . import storage

log = logging.getLogger(__name__)

LEASE_FILE = "writer.lease"
DEFAULT_TTL_S = 60.0


class LeaseHeld(RuntimeError):
    """Another writer holds the run's lease; the message names it and how to take over."""


def lease_path(paths: storage.RunPaths) -> str:
    return paths.sub(LEASE_FILE)


TEMP_MIN_AGE_S = 60.0  # a temp lease file this old is no live attempt to take the lease (those live for ms)


def process_space() -> str:
    """This machine's boot id and this process's pid namespace: two processes whose pids can be compared have the
    same (containers with host networking share the host name, not the pid space)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _holder(stage: str) -> dict:
    now = time.time()
    return {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "pid_space": process_space(),
            "ray_job_id": os.environ.get("RAY_JOB_ID") or os.environ.get("RAY_JOB_SUBMISSION_ID"),
            "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300],
            "stage": stage, "since": now, "renewed_at": now}


def _create_exclusive(fs, path: str, data: bytes) -> bool:
    """Create ``path`` only if it does not exist; False when it does (:func:`eagle3ray.storage.create_exclusive`)."""
    return storage.create_exclusive(fs, path, data)


def _read(fs, path: str) -> dict | None:
    try:
        return storage.read_json(fs, path)
    except (json.JSONDecodeError, UnicodeDecodeError):  # a lease being written right now: treat as held
        return {"host": "?", "pid": "?", "since": time.time(), "renewed_at": time.time(), "token": "?"}


def _holder_gone(h: dict) -> bool:
    """True when the holder ran on this host, in this pid space (same boot, same pid namespace), and its process no
    longer exists (a driver SIGKILLed or OOM-killed here): its lease is taken over at once instead of after its ttl. False for any other host (a pod, a node:
    only the ttl can tell), and when the pid exists, even if reused by another process (the safe side)."""
    here = process_space()
    if (h.get("host") != socket.gethostname() or not here or h.get("pid_space") != here
            or not isinstance(h.get("pid"), int) or h["pid"] == os.getpid()):
        return False
    try:
        os.kill(h["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, another user's
        return False
    return False


def describe(h: dict) -> str:
    age = time.time() - float(h.get("renewed_at", 0))
    job = f", Ray job {h['ray_job_id']}" if h.get("ray_job_id") else ""
    return (f"host {h.get('host')}, pid {h.get('pid')}{job}, stage {h.get('stage')}, since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(h.get('since', 0))))}, last renewed "
            f"{age:.0f} s ago ({h.get('command', '')})")


def acquire(paths: storage.RunPaths, stage: str, ttl_s: float = DEFAULT_TTL_S) -> dict:
    """Take the run's lease for ``stage``; returns the holder record written.

    Raises:
        LeaseHeld: a live lease (renewed within ``ttl_s``) belongs to another writer.
    """
    fs, path = paths.fs, lease_path(paths)
    me = _holder(stage)
    data = json.dumps(me).encode()
    for _ in range(3):
        if _create_exclusive(fs, path, data):
            return me
        other = _read(fs, path)
        if other is None:  # released between our create and our read: try again
            continue
        if time.time() - float(other.get("renewed_at", 0)) <= ttl_s and not _holder_gone(other):
            raise LeaseHeld(
                f"{paths.uri}: another writer holds this run ({describe(other)}). Two writers would delete each "
                f"other's blocks. Wait for it, stop it (`ray job stop <id>` or kill pid {other.get('pid')} on "
                f"{other.get('host')}), or, if it is gone, its lease expires {ttl_s:.0f} s after its last renewal "
                f"and the next command takes over; to take over now, delete {paths.uri}/{LEASE_FILE}.")
        if _read(fs, path) == other:  # still the same expired lease: remove it, then race for a fresh create
            log.warning("%s: taking over %s lease (%s)", paths.uri,
                        "a dead process's" if _holder_gone(other) else "an expired", describe(other))
            try:
                fs.rm_file(path)
            except FileNotFoundError:
                pass
    raise LeaseHeld(f"{paths.uri}: could not take the writer lease ({LEASE_FILE}) after 3 tries; another writer "
                    "is taking it at the same time")


def renew(paths: storage.RunPaths, me: dict) -> bool:
    """Rewrite ``renewed_at`` if the lease is still ``me``'s; False (and nothing written) if it is not."""
    cur = _read(paths.fs, lease_path(paths))
    if not cur or cur.get("token") != me["token"]:
        return False
    me["renewed_at"] = time.time()
    storage.write_json_atomic(paths.fs, lease_path(paths), me)
    return True


def release(paths: storage.RunPaths, me: dict) -> None:
    """Delete the lease if it is still ``me``'s."""
    cur = _read(paths.fs, lease_path(paths))
    if cur and cur.get("token") == me["token"]:
        try:
            paths.fs.rm_file(lease_path(paths))
        except FileNotFoundError:
            pass


@contextmanager
def held(paths: storage.RunPaths, stage: str, ttl_s: float = DEFAULT_TTL_S):
    """Hold the run's lease while the block runs (acquire, renew every ``ttl_s / 3`` s, release).

    On taking the lease, the ``*.tmp-*`` files in the run's folders (local disk; :func:`_sweep_temp_files`) are
    removed: only a writer killed mid-write leaves them (a temp
    lease file younger than :data:`TEMP_MIN_AGE_S` is spared: another process may be trying to take the lease).

    Re-entrant within a process: a stage run inside another stage's lease (``with_needs``) reuses it.
    A renewal that finds the lease taken over logs an error (the stage goes on; its commits follow the
    manifests' exactly-once rules).
    """
    key = paths.uri
    if key in _HELD:
        yield _HELD[key]
        return
    me = acquire(paths, stage, ttl_s)
    _HELD[key] = me
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(ttl_s / 3):
            try:
                if not renew(paths, me):
                    log.error("%s: the writer lease was taken over by another writer; stop this one", paths.uri)
                    return
            except Exception as e:  # noqa: BLE001 - storage blip: try again next period
                log.warning("%s: lease renewal failed (%s); retrying", paths.uri, e)

    t = threading.Thread(target=loop, daemon=True, name="eagle3ray-lease")
    t.start()
    try:
        _sweep_temp_files(paths)
        yield me
    finally:
        stop.set()
        t.join(timeout=5)
        _HELD.pop(key, None)
        try:
            release(paths, me)
        except Exception as e:  # noqa: BLE001 - the lease then expires on its own
            log.warning("%s: could not release the writer lease (%s); it expires in %.0f s", paths.uri, e, ttl_s)


_HELD: dict[str, dict] = {}


def _sweep_temp_files(paths: storage.RunPaths) -> None:
    """Remove the temp files a writer killed mid-write left in the run's own folders (its lease is ours now).
    Ray Train's checkpoint folders (none of ours there) and set-aside ``*.superseded-*`` folders are not walked;
    a file that cannot be removed is logged, never fatal."""
    if not storage.is_local(paths.fs) or not os.path.isdir(paths.root):
        return
    swept = []
    for name in sorted(os.listdir(paths.root)):
        folder = os.path.join(paths.root, name)
        if ".superseded-" in name or not os.path.isdir(folder):
            continue
        try:
            swept += storage.remove_temp_files(paths.fs, folder, recursive=True, skip=("train",))
        except OSError as e:
            log.warning("%s: could not sweep temp files in %s (%s)", paths.uri, folder, e)
    try:
        swept += storage.remove_temp_files(paths.fs, paths.root, young=(LEASE_FILE, TEMP_MIN_AGE_S))
    except OSError as e:
        log.warning("%s: could not sweep temp files in %s (%s)", paths.uri, paths.root, e)
    if swept:
        log.info("%s: removed %d temp file(s) left by a killed writer, e.g. %s", paths.uri, len(swept), swept[0])


def exit_on_sigterm() -> None:
    """Turn SIGTERM (``ray job stop``, Kubernetes) into ``SystemExit(143)`` in the main thread, so that a stopped
    command releases its lease and closes what it holds instead of leaving the lease to expire."""
    import signal

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
