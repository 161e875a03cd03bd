"""Multi-node Ray scenarios on one machine (``ray.cluster_utils.Cluster``: every node is a raylet on
127.0.0.1), each run in its own process by ``tests/test_cluster.py`` (a driver can join one cluster per
process, and the other tests share an in-process cluster). The verifier is the stand-in engine
(``verifier.engine: stand_in``): these scenarios are about placement, elasticity, failures, the
service's life cycle and metrics, not about the model.

    python tests/cluster_scenarios.py {placement|node_kill|service} --verifier DIR --workdir DIR

prints one JSON line (prefixed ``RESULT ``) with what it observed; the test asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

# Loopback everywhere: without this Ray resolves 127.0.0.1 to the machine's address (FIELD_NOTES).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Token authentication on, as eagle3ray requires of a cluster it attaches to (ray.allow_unauthenticated stays
# false): the nodes this process starts and the CLIs it runs share one token, set before Ray is imported.
# No automatic reconnection: after ray.shutdown() a Serve router thread of this driver still pushes metrics, and
# its ray.wait() would call ray.init() again; the reconnected driver then makes cluster.shutdown() refuse to remove
# the head ("Removing a node that is connected to this Ray client"). That race failed the node-kill scenario after
# its extraction had passed (the flake of issue 16: 2 of 20 fault runs here). Read by Ray at import.
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
ROOT = Path(__file__).resolve().parent.parent
_T0 = time.time()


def mark(what: str) -> None:
    """A phase's seconds since the scenario's start, on stderr (the test shows it when the scenario fails; run a
    scenario by hand to see where its time goes)."""
    print(f"[scenario +{time.time() - _T0:6.1f} s] {what}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_data(path: Path, n: int) -> Path:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    with open(path, "w") as f:
        for i in range(n):
            q = " ".join(words[(i + k) % len(words)] for k in range(5 + i % 7))
            a = " ".join(words[(i * 3 + k) % len(words)] for k in range(20 + (i * 7) % 40))
            f.write(json.dumps({"id": f"s{i}", "messages": [{"role": "user", "content": f"Question {i}: {q}?"},
                                                            {"role": "assistant", "content": f"Answer {i}: {a}."}]}) + "\n")
    return path


def write_config(workdir: Path, verifier_dir: str, data: Path, **sections) -> Path:
    tree = {
        "run": {"name": "scenario", "storage": f"file://{workdir}/runs"},
        "verifier": {"model": verifier_dir, "aux_layer_ids": [2, 4, 5], "max_model_len": 512, "engine": "stand_in",
                     "num_cpus": 0, "ray_resources": {"verifier_slot": 1}, "stand_in_tokens_per_s": 400},
        "data": {"train": [{"kind": "chat", "path": str(data)}], "eval": [{"kind": "mtbench"}]},
        "extract": {"max_tokens_per_batch": 256, "min_replicas": 1, "max_replicas": 2, "max_unit_retries": 5},
        "vocab": {"draft_vocab_size": 512},
        "train": {"num_workers": 1, "cpus_per_worker": 0.5, "max_steps": 4, "checkpoint_every": 2,
                  "max_tokens_per_batch": 256, "warmup_steps": 1, "val_fraction": 0.2},
    }
    for sec, vals in sections.items():
        tree.setdefault(sec, {}).update(vals)
    p = workdir / "cfg.yaml"
    p.write_text(yaml.safe_dump(tree))
    return p


def start_cluster(head_cpus: float, metrics_port: int | None = None):
    from ray.cluster_utils import Cluster

    args = dict(num_cpus=head_cpus, node_ip_address="127.0.0.1", include_dashboard=False)
    if metrics_port:
        args["metrics_export_port"] = metrics_port
    return Cluster(initialize_head=True, head_node_args=args)


def add_node(cluster, attempts: int = 3, **kw):
    """``cluster.add_node`` on 127.0.0.1, started again when Ray's node start times out.

    ``ray/_private/node.py`` (Ray 2.60) waits a hard-coded 30 s for a new raylet to register with the GCS. On two
    busy cores (these scenarios inside a full test run) it sometimes takes longer: ``Node.__init__`` then raises
    "The current node timed out during startup" with the node's processes running and the ``Node`` lost to the
    cluster, so it could never be removed. Those processes (the Ray processes that the failed start added as direct
    children of this process, with their descendants) are killed and the node is started again, up to
    ``attempts`` times; any other error, or the last timeout, is raised.
    """
    import psutil

    kw.setdefault("node_ip_address", "127.0.0.1")
    fixed_port = "metrics_export_port" in kw
    me = psutil.Process()
    for attempt in range(1, attempts + 1):
        if not fixed_port:
            kw["metrics_export_port"] = free_port()
        before = {p.pid for p in me.children()}
        try:
            return cluster.add_node(**kw)
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            stray = []
            for p in me.children():
                try:
                    if p.pid not in before and "ray" in " ".join(p.cmdline()):
                        stray += [p, *p.children(recursive=True)]
                except psutil.Error:
                    pass
            for p in stray:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(stray, timeout=10)
            mark(f"add_node: attempt {attempt} timed out ({e}); killed {len(stray)} processes of it, starting again")


def serve_replicas() -> list[dict]:
    """Serve replica actors of the verifier app: [{"node_id", "pid", "state"}] (GCS actor table)."""
    import ray

    out = []
    for a in ray._private.state.actors().values():
        if "VerifierDeployment" in (a.get("ActorClassName") or "") or "ServeReplica:eagle3ray-verifier" in (
                a.get("ActorClassName") or ""):
            out.append({"node_id": a["Address"]["NodeID"], "pid": a.get("Pid"), "state": a["State"]})
    return out


def replica_states() -> dict:
    """{state: count} of the verifier deployment's replicas (Serve status)."""
    from ray import serve

    for name, app in serve.status().applications.items():
        if name.startswith("eagle3ray-verifier-"):
            for dep in app.deployments.values():
                return {str(k).rsplit(".", 1)[-1]: v for k, v in dep.replica_states.items()}
    return {}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


# ------------------------------------------------------------------------------------------ scenarios
def placement(args) -> dict:
    """TP=8 replicas (logical GPUs): each lands on one node (STRICT_PACK); two replicas need two 8-GPU nodes."""
    import ray
    from ray import serve

    from eagle3ray.config import load_config
    from eagle3ray.machine import ensure_ray
    from eagle3ray.verifier_service import start_for_config

    workdir = Path(args.workdir)
    cluster = start_cluster(head_cpus=2)
    gpu8_a = add_node(cluster, num_cpus=1, num_gpus=8)
    gpu4 = add_node(cluster, num_cpus=1, num_gpus=4)
    cfg_path = write_config(workdir, args.verifier, write_data(workdir / "d.jsonl", 4),
                            verifier={"device": "cuda", "tensor_parallel_size": 8, "num_cpus": 0.5, "ray_resources": {}},
                            extract={"min_replicas": 2, "max_replicas": 2})
    cfg = load_config(cfg_path, [f"ray.address={cluster.address}"])
    ensure_ray(cfg)
    err: list = []

    def run():
        try:
            start_for_config(cfg)
        except Exception as e:  # reported in the result
            err.append(repr(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    states_one_node: dict = {}
    deadline = time.time() + 60
    while time.time() < deadline:  # one 8-GPU node: one replica runs, the other cannot be placed
        states_one_node = replica_states()
        if states_one_node.get("RUNNING") == 1 and sum(states_one_node.values()) == 2:
            time.sleep(5)  # and it stays unplaced
            states_one_node = replica_states()
            break
        time.sleep(1)
    gpu8_b = add_node(cluster, num_cpus=1, num_gpus=8)
    t.join(timeout=120)
    pgs = [p for p in ray.util.placement_group_table().values() if p["state"] == "CREATED"
           and p["strategy"] == "STRICT_PACK"]
    result = {
        "error": err, "thread_done": not t.is_alive(), "states_with_one_gpu8_node": states_one_node,
        "gpu8_nodes": [gpu8_a.node_id, gpu8_b.node_id], "gpu4_node": gpu4.node_id,
        "placement_groups": [{"bundles": [dict(b) for b in p["bundles"].values()],
                              "nodes": sorted(set(p["bundles_to_node_id"].values()))} for p in pgs],
        "replica_nodes": sorted(r["node_id"] for r in serve_replicas() if r["state"] == "ALIVE"),
    }
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()
    return result


def _wait_busy_worker_node(cluster, busy_dir: Path, timeout: float = 30):
    """The worker node whose stand-in replica is mid-call right now (its busy marker exists)."""
    deadline = time.time() + timeout
    by_id = {n.node_id: n for n in cluster.worker_nodes}
    while time.time() < deadline:
        pids = {int(p.stem) for p in busy_dir.glob("*.busy")}
        for r in serve_replicas():
            if r["state"] == "ALIVE" and r["pid"] in pids and r["node_id"] in by_id:
                return by_id[r["node_id"]]
        time.sleep(0.05)
    raise TimeoutError("no replica was busy")


def node_kill(args) -> dict:
    """Kill the node of a busy replica mid-extraction, let a new node join; then train a few steps.
    Reports exactly-once facts, retries, replica placement and the Prometheus metrics."""
    import ray

    from eagle3ray import blocks, storage
    from eagle3ray.config import load_config
    from eagle3ray.extract import extract
    from eagle3ray.prepare import prepare
    from eagle3ray.train import train
    from eagle3ray.verifier import StandInEngine
    from eagle3ray.vocab import build_vocab

    workdir = Path(args.workdir)
    busy = workdir / "busy"
    busy.mkdir()
    os.environ["EAGLE3RAY_STAND_IN_BUSY_DIR"] = str(busy)  # inherited by the raylets started below
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    mport = free_port()
    cluster = start_cluster(head_cpus=3, metrics_port=mport)
    # worker nodes hold verifier replicas only (no CPUs: Ray Data and training stay on the head)
    add_node(cluster, num_cpus=0, resources={"verifier_slot": 1})
    add_node(cluster, num_cpus=0, resources={"verifier_slot": 1})
    cfg = load_config(write_config(workdir, args.verifier, write_data(workdir / "d.jsonl", 120)),
                      [f"ray.address={cluster.address}"])
    mark("cluster up")
    prep = prepare(cfg)
    mark("prepared")
    events: dict = {}

    def on_commit(man):
        if len(man["blocks"]) == 15 and "killed" not in events:
            victim = _wait_busy_worker_node(cluster, busy)
            events["killed"] = victim.node_id
            events["replicas_before"] = serve_replicas()
            cluster.remove_node(victim, allow_graceful=False)
            events["killed_at_s"] = time.time() - t0
            events["added"] = add_node(cluster, num_cpus=0, resources={"verifier_slot": 1}).node_id

    seen: dict = {}  # metric -> last value scraped while the stages run (gauges live while they are set)
    stop = threading.Event()

    def scraper():
        while not stop.is_set():
            try:
                for line in scrape(mport).splitlines():
                    if line.startswith("ray_eagle3ray_") and 'run="scenario"' in line:
                        key = line.split("{", 1)[0] + (
                            "[position=" + line.split('position="')[1].split('"')[0] + "]" if 'position="' in line else "")
                        seen[key] = float(line.rsplit(" ", 1)[1])
                for r in serve_replicas():
                    if r["state"] == "ALIVE":
                        alive_on.setdefault(r["node_id"], round(time.time() - t0, 1))
            except Exception as e:  # noqa: BLE001 - reported in the result
                scrape_errors.append(repr(e)[:200])
            time.sleep(0.5)

    scrape_errors: list = []
    alive_on: dict = {}  # node id -> seconds into extraction when a replica there was first seen ALIVE
    t0 = time.time()
    scraping = threading.Thread(target=scraper, daemon=True)
    scraping.start()
    s = extract(cfg, on_commit=on_commit, progress=False)
    extract_s = time.time() - t0
    mark("extracted")
    # the pool re-grows on the node that joined: Serve replaces the dead replica once its health check
    # fails (every 10 s); wait for it if extraction finished first
    deadline = time.time() + 90
    while events.get("added") and events["added"] not in alive_on and time.time() < deadline:
        time.sleep(1)
    paths = storage.run_paths(cfg)
    man, files = blocks.read_committed(paths.fs, paths.hidden_states)
    ids = blocks.committed_sample_ids(paths.fs, paths.hidden_states, man)
    on_disk = sorted("blocks/" + f.rsplit("/", 1)[-1] for f in paths.fs.ls(f"{paths.hidden_states}/blocks", detail=False))
    # content of every block is the engine's (a retried unit wrote the same states)
    import pyarrow.parquet as pq

    mismatched = 0
    for b in man["blocks"]:
        with paths.fs.open(f"{paths.hidden_states}/{b['path']}", "rb") as f:
            for row in pq.read_table(f).to_pylist():
                want = StandInEngine.states(row["input_ids"], row["num_layers"], row["hidden_size"])
                if abs(blocks.decode_states(row) - want).max() > 1e-2:
                    mismatched += 1
    from eagle3ray.artifacts import read_conversations

    prepared_ids = read_conversations(paths)[1]["sample_id"].to_pylist()
    replicas_after = serve_replicas()
    mark("regrown and checked")
    # training on the same cluster, to see its metrics too
    build_vocab(cfg)
    tr = train(cfg)
    mark("trained")
    time.sleep(5)  # two report intervals: the last counter values reach the agent
    stop.set()
    scraping.join(timeout=30)  # its Ray calls must end before ray.shutdown(), or one reconnects the driver
    result = {
        "prepared_samples": prep.samples, "prepared_ids": prepared_ids, "committed_ids": ids, "manifest_samples": man["counts"]["samples"],
        "manifest_tokens": man["counts"]["tokens"], "complete": man.get("complete"),
        "manifest_blocks": sorted(b["path"] for b in man["blocks"]), "blocks_on_disk": on_disk,
        "retries": s.retries, "manifest_retries": man.get("retries"), "orphans_removed_end": s.orphans_removed_end,
        "duplicates": (man["rejected"]["extract"].get("counts") or {}).get("duplicate", 0),
        "mismatched_rows": mismatched, "events": events, "replicas_after": replicas_after,
        "replica_first_alive_s": alive_on, "scrape_errors": scrape_errors[:5],
        "extract_seconds": extract_s, "train_steps": tr.steps,
        "metrics": seen,
    }
    ray.shutdown()
    cluster.shutdown()
    return result


def service(args) -> dict:
    """`eagle3ray verifier start|status|stop` against a running cluster, a job attaching to the pinned service,
    and one with another verifier refused."""
    workdir = Path(args.workdir)
    cluster = start_cluster(head_cpus=3)
    add_node(cluster, num_cpus=0, resources={"verifier_slot": 2})
    cfg_path = write_config(workdir, args.verifier, write_data(workdir / "d.jsonl", 20))
    env = {**os.environ, "RAY_ADDRESS": cluster.address}

    def cli(*a, timeout=300):
        p = subprocess.run([sys.executable, "-m", "eagle3ray.cli", *a, "-c", str(cfg_path)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=timeout)
        return {"rc": p.returncode, "out": p.stdout, "err": p.stderr[-4000:]}

    r = {"start": cli("verifier", "start")}
    r["status1"] = cli("verifier", "status", "--json")
    r["extract"] = cli("extract", "--no-progress")
    r["status2"] = cli("verifier", "status", "--json")
    r["mismatch"] = cli("extract", "--no-progress", "verifier.aux_layer_ids=[1,3,5]", "run.name=other")
    r["stop"] = cli("verifier", "stop")
    r["status3"] = cli("verifier", "status")
    cluster.shutdown()
    return r


def _committed(cfg) -> dict:
    """What the run's manifest commits: ids (with repeats, if any), whether complete, blocks listed vs on storage,
    rejected counts of extract."""
    from eagle3ray import blocks, storage
    from eagle3ray.artifacts import read_conversations

    paths = storage.run_paths(cfg)
    man, _ = blocks.read_committed(paths.fs, paths.hidden_states)
    on_disk = sorted("blocks/" + f.rsplit("/", 1)[-1] for f in paths.fs.ls(f"{paths.hidden_states}/blocks",
                                                                            detail=False))
    return {"committed_ids": blocks.committed_sample_ids(paths.fs, paths.hidden_states, man),
            "prepared_ids": read_conversations(paths)[1]["sample_id"].to_pylist(),
            "complete": bool(man.get("complete")), "manifest_blocks": sorted(b["path"] for b in man["blocks"]),
            "blocks_on_disk": on_disk, "rejected_extract": man["rejected"].get("extract", {}),
            "retries": man.get("retries")}


def engine_faults(args) -> dict:
    """Real engine faults in a live service (stand-in engine, ``EAGLE3RAY_STAND_IN_FAULT_DIR``): the replica's
    process ends during a regeneration chunk; one extraction call hangs; one sample kills the engine whenever it
    is in a unit. One replica, so every retry waits for Serve's replacement."""
    from eagle3ray.config import load_config
    from eagle3ray.extract import extract
    from eagle3ray.prepare import prepare

    workdir = Path(args.workdir)
    faults = workdir / "faults"
    faults.mkdir()
    os.environ["EAGLE3RAY_STAND_IN_FAULT_DIR"] = str(faults)  # inherited by the raylets started below
    cluster = start_cluster(head_cpus=3)
    add_node(cluster, num_cpus=0, resources={"verifier_slot": 1})
    cfg = load_config(write_config(workdir, args.verifier, write_data(workdir / "d.jsonl", 40)),
                      [f"ray.address={cluster.address}", "extract.max_replicas=1", "extract.unit_timeout_s=6",
                       "data.regenerate=true", "data.max_new_tokens=8", "verifier.max_num_seqs=8"])
    (faults / "crash_generate_once").touch()
    t0 = time.time()
    mark("cluster up")
    prep = prepare(cfg)
    mark("prepared")
    r: dict = {"prepare_seconds": time.time() - t0, "prepared_samples": prep.samples,
               "crash_generate_left": (faults / "crash_generate_once").exists()}
    ids = _committed_ids_of_conversations(cfg)
    crash_id = ids[17]
    (faults / "crash_samples").write_text(crash_id + "\n")
    (faults / "hang_extract_once").touch()
    t0 = time.time()
    s = extract(cfg, progress=False)
    mark("extracted")
    r.update(_committed(cfg), extract_seconds=time.time() - t0, crash_id=crash_id, summary_retries=s.retries,
             hang_left=(faults / "hang_extract_once").exists(), rejected_summary=s.rejected.get("extract", {}))
    ray_shutdown()
    cluster.shutdown()
    return r


def _committed_ids_of_conversations(cfg) -> list[str]:
    from eagle3ray import storage
    from eagle3ray.artifacts import read_conversations

    return read_conversations(storage.run_paths(cfg))[1]["sample_id"].to_pylist()


def ray_shutdown() -> None:
    import ray

    ray.shutdown()


def _wait_for(pred, timeout: float, what: str, poll: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


def driver_kill(args) -> dict:
    """The driver SIGKILLed mid-extract (`eagle3ray extract`, a process of its own) and mid-train (a driver with
    the worker trace hook), each run again: nothing done is lost, nothing is done twice."""
    import signal

    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.prepare import prepare

    workdir = Path(args.workdir)
    cluster = start_cluster(head_cpus=3)
    add_node(cluster, num_cpus=0, resources={"verifier_slot": 1})
    cfg_path = write_config(workdir, args.verifier, write_data(workdir / "d.jsonl", 80),
                            train={"max_steps": 12, "checkpoint_every": 3, "num_workers": 1, "val_fraction": 0.2})
    over = [f"ray.address={cluster.address}", "extract.max_replicas=1"]
    cfg = load_config(cfg_path, over)
    mark("cluster up")
    prepare(cfg)
    mark("prepared")
    paths = storage.run_paths(cfg)
    commits = f"{paths.hidden_states}/commits"
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    cli = [sys.executable, "-m", "eagle3ray.cli"]
    r: dict = {}

    def n_commits() -> int:
        return len(paths.fs.ls(commits, detail=False)) if paths.fs.exists(commits) else 0

    p = subprocess.Popen([*cli, "extract", "--no-progress", "-c", str(cfg_path), *over], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: n_commits() >= 3 or p.poll() is not None, 240, "3 commits of the first extract")
    p.send_signal(signal.SIGKILL)  # (a no-op if it already ended: then its rc says so)
    r["extract_killed_rc"] = p.wait()
    mark("extract killed")
    r["commits_at_kill"] = n_commits()
    r["lease_left"] = paths.fs.exists(paths.sub("writer.lease"))
    r["after_kill"] = _committed(cfg)
    q = subprocess.run([*cli, "extract", "--no-progress", "-c", str(cfg_path), *over], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    r["extract_rerun_rc"], r["extract_rerun_out"] = q.returncode, (q.stdout + q.stderr)[-3000:]
    mark("extract re-run")
    r["after_rerun"] = _committed(cfg)
    v = subprocess.run([*cli, "vocab", "-c", str(cfg_path), *over], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    r["vocab_rc"] = v.returncode
    mark("vocab")
    trace = workdir / "trace"
    code = (f"import sys; sys.argv = ['train']\n"
            f"from eagle3ray.config import load_config\nfrom eagle3ray.pipeline import run_stage\n"
            f"from eagle3ray.train_worker import WorkerHooks\nfrom eagle3ray import train as T\n"
            f"cfg = load_config({str(cfg_path)!r}, {over!r})\n"
            f"hooks = WorkerHooks(trace_dir={str(trace)!r})\n"
            f"s = T.train(cfg, hooks=hooks, progress=False)\n"
            f"print('STEPS', s.steps, 'RESUMED', s.resumed_from, flush=True)\n")
    ck = paths.sub("checkpoints")

    def checkpoints() -> list[str]:
        return [f for f in paths.fs.glob(f"{ck}/train/checkpoint_*") if not f.endswith(".json")] \
            if paths.fs.exists(ck) else []

    p = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    _wait_for(lambda: checkpoints() or p.poll() is not None, 300, "the first checkpoint")
    time.sleep(1.0)
    p.send_signal(signal.SIGKILL)
    r["train_killed_rc"] = p.wait()
    mark("train killed")
    r["checkpoints_at_kill"] = sorted(c.rsplit("/", 1)[-1] for c in checkpoints())
    # Ray Train's own record of its checkpoints, removed if the killed driver got to write it (it writes it a
    # poll or two after the report, so often it did not): the re-run must find the newest checkpoint on storage by
    # itself (step.json)
    snap = f"{ck}/train/checkpoint_manager_snapshot.json"
    r["ray_snapshot_existed"] = paths.fs.exists(snap)
    if r["ray_snapshot_existed"]:
        paths.fs.rm(snap)
    r["ray_record_at_rerun"] = paths.fs.exists(snap)
    q = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    r["train_rerun_rc"], r["train_rerun_out"] = q.returncode, (q.stdout + q.stderr)[-3000:]
    mark("train re-run")
    r["traces"] = {}
    for f in sorted(trace.glob("*.jsonl")):
        r["traces"][f.name] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    cluster.shutdown()
    return r


def online_node_kill(args) -> dict:
    """Two pools on one cluster, ``train.data_source: online`` (or ``--mode hybrid``): verifier replicas on two
    verifier nodes (no CPUs), the train worker on a train node (``train.ray_resources``), Ray Data's stream actors
    on the head. The node of a busy replica is killed mid-training, then a verifier node is added. Reports the
    workers' traces, where each actor ran, the stream's metrics and what was committed (hybrid)."""
    import ray

    from eagle3ray import storage
    from eagle3ray.artifacts import read_metrics
    from eagle3ray.config import load_config
    from eagle3ray.machine import ensure_ray
    from eagle3ray.online import split_samples
    from eagle3ray.pipeline import _train, run_stage
    from eagle3ray.prepare import prepare
    from eagle3ray.train_worker import WorkerHooks

    workdir = Path(args.workdir)
    busy, trace = workdir / "busy", workdir / "trace"
    busy.mkdir()
    os.environ["EAGLE3RAY_STAND_IN_BUSY_DIR"] = str(busy)  # inherited by the raylets started below
    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    mport = free_port()
    cluster = start_cluster(head_cpus=3, metrics_port=mport)
    verifier_nodes = [add_node(cluster, num_cpus=0, resources={"verifier_slot": 1}).node_id for _ in range(2)]
    tport = free_port()
    train_node = add_node(cluster, num_cpus=1, resources={"train_slot": 1}, metrics_export_port=tport).node_id
    cfg = load_config(write_config(workdir, args.verifier, write_data(workdir / "d.jsonl", 80),
                                   train={"data_source": args.mode, "ray_resources": {"train_slot": 1},
                                          "max_steps": 40, "checkpoint_every": 5},
                                   # a pool of 2 kept up: Serve must replace the lost replica, and only the node
                                   # added has a free verifier slot
                                   extract={"min_replicas": 2, "max_replicas": 2},
                                   # slower than the workers: epoch 0 is still streaming once training has begun,
                                   # also in hybrid mode, whose later epochs read storage
                                   verifier={"stand_in_tokens_per_s": 100}),
                      [f"ray.address={cluster.address}"])
    mark("cluster up")
    prepare(cfg)
    run_stage(cfg, "vocab", progress=False)
    mark("prepared, vocab")
    ensure_ray(cfg)  # the scraper asks Ray's state API from the start
    # a node is added from the watcher thread while the main thread trains; Ray's Node registers a SIGTERM handler,
    # which only the main thread may do (this process is never sent SIGTERM)
    import ray._private.utils as ray_utils

    set_handler = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda h: set_handler(h) if threading.current_thread() is threading.main_thread() \
        else None
    events: dict = {}
    placed: dict = {}  # actor class -> sorted node ids it ran on
    alive_on: dict = {}  # verifier node id -> seconds into training when a replica there was first ALIVE
    seen: dict = {}
    errors: list = []
    stop, release = threading.Event(), threading.Event()

    def steps_done() -> int:
        return max((json.loads(line)["step"] for f in trace.glob("*.jsonl") for line in f.read_text().splitlines()
                    if line.strip()), default=0)

    def watcher():
        try:
            _wait_for(lambda: any(trace.glob("*.jsonl")), 300, "the train worker's start")  # training has begun
            victim = _wait_busy_worker_node(cluster, busy)
            mark(f"node killed at step {steps_done()}")
            events.update(killed=victim.node_id, killed_at_step=steps_done(), replicas_before=serve_replicas())
            cluster.remove_node(victim, allow_graceful=False)
            events["added"] = add_node(cluster, num_cpus=0, resources={"verifier_slot": 1}).node_id
        except Exception as e:  # noqa: BLE001 - reported in the result
            errors.append(repr(e)[:500])
        # Ray starts a node's processes with PR_SET_PDEATHSIG, which fires when the *thread* that started them
        # ends: this thread lives until the cluster is shut down
        release.wait(timeout=600)

    def scraper():
        while not stop.is_set():
            try:
                for a in ray._private.state.actors().values():
                    if a["State"] == "ALIVE":
                        name = a.get("ActorClassName") or ""
                        kind = ("replica" if "eagle3ray-verifier" in name or "VerifierDeployment" in name else
                                "train_worker" if "RayTrainWorker" in name else
                                "stream" if "StateRows" in name or "MapWorker" in name else None)
                        if kind:
                            placed.setdefault(kind, set()).add(a["Address"]["NodeID"])
                for r in serve_replicas():
                    if r["state"] == "ALIVE":
                        alive_on.setdefault(r["node_id"], round(time.time() - t0, 1))
                now: dict = {}  # counters summed over every series of the head and the train node; gauges: last
                for port in (mport, tport):
                    for line in scrape(port).splitlines():
                        if line.startswith("ray_eagle3ray_") and 'run="scenario"' in line:
                            name, v = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
                            now[name] = now.get(name, 0.0) + v if name.endswith("_total") else v
                seen.update(now)
            except Exception as e:  # noqa: BLE001
                errors.append("scrape: " + repr(e)[:200])
            time.sleep(0.5)

    t0 = time.time()
    threads = [threading.Thread(target=f, daemon=True) for f in (watcher, scraper)]
    for t in threads:
        t.start()
    s = _train(cfg, False, hooks=WorkerHooks(trace_dir=str(trace)))
    train_s = time.time() - t0
    mark("trained")
    if "killed" not in events:
        errors.append(f"training ended (step {steps_done()}) before the watcher killed a node")
    try:
        _wait_for(lambda: events.get("added") in alive_on or not events.get("added"), 90, "a replica on the added node")
    except TimeoutError as e:
        errors.append(f"{e}; replicas: {serve_replicas()}; states: {replica_states()}")
    mark("regrown")
    time.sleep(3)  # the last counter values reach the metrics agent
    stop.set()
    threads[1].join(timeout=30)
    paths = storage.run_paths(cfg)
    train_samples, val_samples, _ = split_samples(cfg, paths)
    result = {
        "steps": s.steps, "train_seconds": train_s, "events": events, "errors": errors[:5],
        "verifier_nodes": verifier_nodes, "train_node": train_node,
        "placed": {k: sorted(v) for k, v in placed.items()}, "replica_first_alive_s": alive_on, "metrics": seen,
        "train_ids": [x["sample_id"] for x in train_samples], "val_ids": [x["sample_id"] for x in val_samples],
        "tail": [m.get("epoch_tail_samples") for m in read_metrics(paths) if m.get("event") is None],
        "hidden_states_exist": paths.fs.exists(paths.hidden_states), "hybrid": s.hybrid,
        "trace": str(trace),
    }
    if args.mode == "hybrid":
        result["committed"] = _committed(cfg)
    ray.shutdown()
    cluster.shutdown()
    release.set()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["placement", "node_kill", "service", "engine_faults", "driver_kill",
                                         "online_node_kill"])
    ap.add_argument("--mode", default="online", help="online_node_kill: train.data_source (online | hybrid)")
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    result = {"placement": placement, "node_kill": node_kill, "service": service, "engine_faults": engine_faults,
              "driver_kill": driver_kill, "online_node_kill": online_node_kill}[args.scenario](args)
    mark("done")
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
