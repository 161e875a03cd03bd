"""Cluster behaviour on Ray's multi-node test cluster (``ray.cluster_utils.Cluster``, every node a raylet on
127.0.0.1), with the stand-in verifier engine: tensor-parallel placement, the elastic extraction pool with a
node killed mid-extraction, the pinned verifier service's CLI, and the metrics in the Prometheus export.
Each scenario runs in its own process (tests/cluster_scenarios.py): a driver joins one cluster per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _scenario(name: str, verifier: str, workdir: Path, timeout: int = 480, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, "tests/cluster_scenarios.py", name, "--verifier", verifier,
                           "--workdir", str(workdir), *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"scenario {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.timeout(600)
def test_tp8_replica_lands_on_one_node_and_two_need_two_nodes(tiny_verifier, tmp_path):
    r = _scenario("placement", tiny_verifier, tmp_path)
    assert r["error"] == [] and r["thread_done"]
    # with one 8-GPU node (and a 4-GPU one) only one TP=8 replica can be placed
    assert r["states_with_one_gpu8_node"].get("RUNNING") == 1
    assert sum(r["states_with_one_gpu8_node"].values()) == 2
    # after a second 8-GPU node joins: two STRICT_PACK groups, each whole on one 8-GPU node, on different nodes
    pgs = r["placement_groups"]
    assert len(pgs) == 2
    for pg in pgs:
        assert pg["bundles"] == [{"CPU": 0.5}] + [{"GPU": 1.0}] * 8
        assert len(pg["nodes"]) == 1 and pg["nodes"][0] in r["gpu8_nodes"]
    assert sorted(pg["nodes"][0] for pg in pgs) == sorted(r["gpu8_nodes"])
    assert r["gpu4_node"] not in r["replica_nodes"]
    assert r["replica_nodes"] == sorted(r["gpu8_nodes"])


@pytest.mark.timeout(600)
def test_node_killed_mid_extraction_every_sample_exactly_once(tiny_verifier, tmp_path):
    r = _scenario("node_kill", tiny_verifier, tmp_path)
    ids = r["committed_ids"]
    assert len(ids) == len(set(ids)) == r["prepared_samples"] == 120
    assert sorted(ids) == sorted(r["prepared_ids"])
    assert r["complete"] and r["manifest_samples"] == 120
    assert r["manifest_blocks"] == r["blocks_on_disk"]  # no orphan left, nothing missing
    assert r["mismatched_rows"] == 0  # every row holds the engine's states for its tokens
    # the unit in flight on the killed node was redone elsewhere, and the summary says so
    ev = r["events"]
    assert any(x["node_id"] == ev["killed"] and x["state"] == "ALIVE" for x in ev["replicas_before"])
    assert r["retries"] >= 1 and r["manifest_retries"] == r["retries"]
    # elastic pool: replicas ran on >= 3 nodes (scale-up under queued work, replacement on the node that joined)
    hosts = r["replica_first_alive_s"]
    assert ev["added"] in hosts and ev["killed"] in hosts and len(hosts) >= 3
    # metrics, read from the cluster's Prometheus export
    m = r["metrics"]
    assert m["ray_eagle3ray_extract_tokens_total"] == r["manifest_tokens"]
    assert m["ray_eagle3ray_extract_samples_total"] == 120
    assert m["ray_eagle3ray_extract_blocks_committed_total"] == len(r["manifest_blocks"])
    assert m["ray_eagle3ray_extract_batch_tokens_count"] == len(r["manifest_blocks"])
    assert m["ray_eagle3ray_extract_retries_total"] == r["retries"]
    assert m["ray_eagle3ray_extract_tokens_per_s"] > 0 and m["ray_eagle3ray_verifier_replicas_alive"] >= 1
    assert r["train_steps"] == 4
    assert m["ray_eagle3ray_train_loss"] > 0 and m["ray_eagle3ray_train_tokens_per_s"] > 0
    assert {f"ray_eagle3ray_train_accuracy[position={k}]" for k in range(3)} <= set(m)


@pytest.mark.timeout(600)
def test_pinned_verifier_service_cli(tiny_verifier, tmp_path):
    r = _scenario("service", tiny_verifier, tmp_path)
    assert r["start"]["rc"] == 0 and "is up (pinned)" in r["start"]["out"] + r["start"]["err"]
    (s1,) = json.loads(r["status1"]["out"]).values()
    assert s1["pinned"] and s1["matches_config"] and s1["status"] == "RUNNING" and s1["extract_calls"] == 0
    assert s1["uptime_seconds"] > 0 and s1["load_seconds"] >= 0
    assert r["extract"]["rc"] == 0, r["extract"]["err"]
    assert "reusing running" in r["extract"]["out"]
    (s2,) = json.loads(r["status2"]["out"]).values()
    assert s2["identity_hash"] == s1["identity_hash"] and s2["loads_in_process"] == 1
    assert s2["tokens"] > 0 and s2["extract_calls"] > 0 and s2["uptime_seconds"] > s1["uptime_seconds"]
    # another verifier (other aux layers) is refused, naming the field, instead of starting a second service
    mm = r["mismatch"]
    assert mm["rc"] == 1
    text = " ".join((mm["out"] + mm["err"]).split())
    assert "runs another verifier" in text and "layer_ids: running [2, 4, 5, 8], this config [1, 3, 5, 8]" in text
    assert "Traceback" not in mm["err"]
    assert r["stop"]["rc"] == 0 and "stopped" in r["stop"]["out"] + r["stop"]["err"]
    assert "no verifier service is running" in r["status3"]["out"] + r["status3"]["err"]


@pytest.mark.timeout(600)
def test_engine_crash_hang_and_regeneration_crash_are_survived_and_the_poisonous_sample_rejected(tiny_verifier, tmp_path):
    """Real faults inside a live service (docs/faults.md): the replica's process ends during a regeneration chunk
    (retried: every answer arrives); one extraction call hangs (extract.unit_timeout_s: the replica fails its health
    check and is replaced, the unit is retried); one sample ends the engine's process whenever it is sent (its unit
    is split until it is alone, then rejected as engine_crash). Every other sample is committed exactly once."""
    r = _scenario("engine_faults", tiny_verifier, tmp_path)
    assert r["prepared_samples"] == 40 and not r["crash_generate_left"]  # the crash happened; prepare survived it
    assert not r["hang_left"]  # the hang happened
    ids, crash = r["committed_ids"], r["crash_id"]
    assert len(ids) == len(set(ids)) == 39 and crash not in ids
    assert sorted(ids + [crash]) == sorted(r["prepared_ids"])
    assert r["rejected_extract"]["counts"] == {"engine_crash": 1}  # and no duplicate: no retried unit landed twice
    assert r["rejected_extract"]["examples"]["engine_crash"][0].startswith(crash + ":")
    assert r["complete"] and r["manifest_blocks"] == r["blocks_on_disk"]  # no orphan left by the dead calls
    # at least: the hang's retry, and the crashing unit's two deaths at each split level
    assert r["retries"] == r["summary_retries"] >= 3


@pytest.mark.timeout(900)
def test_driver_sigkilled_mid_extract_and_mid_train_loses_nothing_and_repeats_nothing(tiny_verifier, tmp_path):
    """`eagle3ray extract` SIGKILLed after 3 commits, then run again; a train driver SIGKILLed after its first
    checkpoint, then run again (docs/faults.md). The killed driver's lease is taken over at once (same host, its pid
    gone); the extraction resumes from its commits (its uncommitted block is an orphan, removed); training resumes
    from its newest checkpoint and trains every step once, no sample twice in an epoch."""
    r = _scenario("driver_kill", tiny_verifier, tmp_path, timeout=840)
    assert r["extract_killed_rc"] == -9 and r["commits_at_kill"] >= 3
    assert r["lease_left"]  # nobody released it: the re-run took it over
    k = r["after_kill"]
    assert not k["complete"] and 0 < len(k["committed_ids"]) == len(set(k["committed_ids"])) < 80
    assert r["extract_rerun_rc"] == 0, r["extract_rerun_out"]
    a = r["after_rerun"]
    assert a["complete"] and len(a["committed_ids"]) == len(set(a["committed_ids"])) == 80
    assert sorted(a["committed_ids"]) == sorted(a["prepared_ids"])
    assert set(k["committed_ids"]) <= set(a["committed_ids"])  # nothing committed before the kill was redone
    assert a["manifest_blocks"] == a["blocks_on_disk"]  # the killed run's uncommitted block was removed
    assert not a["rejected_extract"].get("counts", {}).get("duplicate")  # no unit was committed twice
    assert r["train_killed_rc"] == -9 and r["train_rerun_rc"] == 0, r["train_rerun_out"]
    steps, resumed = (int(x) if x != "None" else None for x in
                      r["train_rerun_out"].split("STEPS ", 1)[1].split()[:3:2])
    assert steps == 12 and resumed is not None and resumed >= 3 and resumed % 3 == 0
    assert not r["ray_record_at_rerun"]  # Ray Train had no record: the resume came from the checkpoint's step.json
    traces = list(r["traces"].values())
    first = next(t for t in traces if t[0]["step"] == 1)
    second = next(t for t in traces if t[0]["step"] == resumed + 1)
    assert max(e["step"] for e in first) >= resumed
    kept = [e for e in first if e["step"] <= resumed] + second
    assert sorted(e["step"] for e in kept) == list(range(1, 13))
    for epoch in {e["epoch"] for e in kept}:
        ids = [i for e in kept if e["epoch"] == epoch for i in e["ids"]]
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample trained twice across the driver's death"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["online", "hybrid"])
def test_verifier_node_killed_mid_online_training_every_sample_once_per_epoch_and_the_pool_grows_back(
        tiny_verifier, tmp_path, mode):
    """Issue 18: two pools on one cluster (verifier replicas on two verifier nodes, the train worker on a train node,
    ``train.ray_resources``), ``train.data_source`` online or hybrid. Once the train worker has started, the node of
    a busy replica is killed, then a verifier node joins: training completes; no sample is trained twice in an epoch and epoch 0 trains
    every training sample (less the counted tail); the lost unit was retried; a replica comes up on the new node;
    online stores nothing, hybrid commits every sample exactly once (a complete, sealed manifest, no orphan)."""
    from test_train import _lineage

    r = _scenario("online_node_kill", tiny_verifier, tmp_path, 540, "--mode", mode)
    assert r["errors"] == [], r["errors"]
    assert r["steps"] == 40
    ev = r["events"]
    assert ev["killed"] in r["verifier_nodes"] and 0 <= ev["killed_at_step"] < 40
    assert any(x["node_id"] == ev["killed"] and x["state"] == "ALIVE" for x in ev["replicas_before"])
    # the two pools stayed apart: replicas only on verifier nodes, the train worker only on the train node
    assert set(r["placed"]["replica"]) <= set(r["verifier_nodes"]) | {ev["added"]}
    assert r["placed"]["train_worker"] == [r["train_node"]]
    assert ev["added"] in r["replica_first_alive_s"]  # the pool grew back on the node that joined
    assert r["metrics"]["ray_eagle3ray_online_retries_total"] >= 1  # the unit in flight on the dead node
    m = r["metrics"]
    assert m["ray_eagle3ray_online_tokens_streamed_total"] > 0 and m["ray_eagle3ray_train_tokens_total"] > 0
    assert 0 <= m["ray_eagle3ray_train_data_wait_fraction"] <= 1
    kept = _lineage(Path(r["trace"]))
    assert [e["step"] for e in kept] == list(range(1, 41))
    epochs = sorted({e["epoch"] for e in kept})
    assert len(epochs) >= 2, "the test needs epoch 0 to end"
    for epoch in epochs:
        ids = [i for e in kept if e["epoch"] == epoch for i in e["ids"]]
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample was trained twice"
    epoch0 = {i for e in kept if e["epoch"] == 0 for i in e["ids"]}
    assert epoch0 <= set(r["train_ids"])
    tail = next(t for t in r["tail"] if t is not None)
    assert len(r["train_ids"]) - len(epoch0) == tail, (len(epoch0), tail)  # 1 worker: no row left by the split
    if mode == "online":
        assert not r["hidden_states_exist"]
    else:
        c = r["committed"]
        assert c["complete"] and r["hybrid"]["complete"]
        assert sorted(c["committed_ids"]) == sorted(r["train_ids"] + r["val_ids"])
        assert len(c["committed_ids"]) == len(set(c["committed_ids"]))
        assert c["manifest_blocks"] == c["blocks_on_disk"]
        assert r["metrics"]["ray_eagle3ray_online_tokens_from_storage_total"] > 0  # epoch 1 read back
