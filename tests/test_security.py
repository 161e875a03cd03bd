"""eagle3ray runs only where callers are checked, pins the code it trusts, and keeps secrets off command lines,
out of images and out of configs (issue 16, item 8). One test (or a few) per guarantee, each named after it.

The one test that starts a Ray cluster (``ray start --head`` without token authentication, on free ports of
127.0.0.1 with its own temp dir) is marked slow and stops exactly the processes it started.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import pytest
import yaml

from conftest import cluster_ports, free_port, stop_cluster
from eagle3ray.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
SECRET_VARS = ("RAY_AUTH_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
               "AWS_SESSION_TOKEN")


# ------------------------------------------------------------------------- 1. attach only to a guarded cluster
def _fake_gcs(refuse: bool):
    """A gRPC server answering the probe's call like a GCS with token auth on (refuse) or off."""
    import grpc
    from ray.core.generated import gcs_service_pb2

    def get_all_node_info(request, context):
        if refuse:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "Invalid or missing authentication token")
        return gcs_service_pb2.GetAllNodeInfoReply()

    handler = grpc.method_handlers_generic_handler("ray.rpc.NodeInfoGcsService", {
        "GetAllNodeInfo": grpc.unary_unary_rpc_method_handler(
            get_all_node_info, request_deserializer=gcs_service_pb2.GetAllNodeInfoRequest.FromString,
            response_serializer=gcs_service_pb2.GetAllNodeInfoReply.SerializeToString)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_the_auth_probe_asks_the_cluster_not_this_process(monkeypatch):
    """'token' only when the GCS refuses a call without a token; this process's RAY_AUTH_MODE changes nothing;
    a GCS that does not answer is an error, never 'token'."""
    from eagle3ray.machine import cluster_auth_mode

    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # this driver would send a token; the probe sends none
    for refuse, expected in ((True, "token"), (False, "disabled")):
        server, address = _fake_gcs(refuse)
        try:
            assert cluster_auth_mode(address) == expected
        finally:
            server.stop(0)
    with pytest.raises(ConnectionError, match="UNAVAILABLE"):
        cluster_auth_mode(f"127.0.0.1:{free_port()}", timeout_s=2)


def test_an_unknown_or_disabled_auth_mode_is_refused_unless_the_config_allows_it(monkeypatch):
    import eagle3ray.machine as machine

    def cannot_ask():
        raise ConnectionError("gRPC UNAVAILABLE")

    for probe, allowed in ((cannot_ask, "unknown"), (lambda: "disabled", "disabled")):
        monkeypatch.setattr(machine, "connected_cluster_auth_mode", probe)
        with pytest.raises(machine.UnguardedClusterError, match="RAY_AUTH_MODE=token.*ray.allow_unauthenticated"):
            machine.require_guarded_cluster(False, "h:6379")
        assert machine.require_guarded_cluster(True, "h:6379") == allowed
    monkeypatch.setattr(machine, "connected_cluster_auth_mode", lambda: "token")
    assert machine.require_guarded_cluster(False, "h:6379") == "token"


def test_no_local_cluster_starts_when_RAY_AUTH_MODE_turns_token_auth_off(monkeypatch):
    import ray

    from eagle3ray.machine import UnguardedClusterError, ensure_ray

    def must_not_start(**kw):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", must_not_start)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(UnguardedClusterError, match="RAY_AUTH_MODE=disabled"):
        ensure_ray(load_config(None))
    assert load_config(None).ray.allow_unauthenticated is False  # the default refuses


_DRIVER = """
import sys
from eagle3ray.config import load_config
from eagle3ray.machine import UnguardedClusterError, ensure_ray
try:
    ensure_ray(load_config(None, sys.argv[1:]))
except UnguardedClusterError as e:
    print("REFUSED", e)
else:
    import ray
    print("ATTACHED", len(ray.nodes()), "GCS", ray.get_runtime_context().gcs_address)
"""


@pytest.mark.slow
def test_an_unauthenticated_ray_start_cluster_is_refused_unless_the_config_allows_it(tmp_path):
    """A real `ray start --head` with RAY_AUTH_MODE=disabled: a driver with the default config is refused with
    the way out, one with ray.allow_unauthenticated=true attaches."""
    from eagle3ray.machine import cluster_auth_mode

    tmp_root = f"/tmp/e3r-sec-{os.getpid()}"  # short: Ray's socket paths must stay under 108 chars
    temp_dir = f"{tmp_root}/ray"  # Ray's default place under RAY_TMPDIR=tmp_root: drivers there find this cluster
    gcs, _, port_args = cluster_ports(temp_dir)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    try:
        r = subprocess.run([str(VENV_BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                            "--include-dashboard=false", *port_args], env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert cluster_auth_mode(f"127.0.0.1:{gcs}") == "disabled"
        driver_env = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}  # a driver as a user would run it
        out = {}
        for name, extra in (("default", [f"ray.address=127.0.0.1:{gcs}"]),
                            ("allowed", [f"ray.address=127.0.0.1:{gcs}", "ray.allow_unauthenticated=true"]),
                            ("local", ["ray.num_cpus=1"])):
            d = subprocess.run([sys.executable, "-c", _DRIVER, *extra], env={**driver_env, "RAY_TMPDIR": tmp_root},
                               capture_output=True, text=True, timeout=120, cwd=tmp_path)
            out[name] = d.stdout + d.stderr
        assert "REFUSED" in out["default"] and "answers calls that carry no authentication token" in out["default"]
        assert "RAY_AUTH_MODE=token" in out["default"], out["default"]
        assert f"ATTACHED 1 GCS 127.0.0.1:{gcs}" in out["allowed"], out["allowed"]
        # no ray.address: a local cluster of its own (with token auth), not the `ray start` one already running here
        # (ray.init() alone attached to it, and with ray.num_cpus failed: "When connecting to an existing cluster,
        # num_cpus and num_gpus must not be provided")
        assert "ATTACHED 1 GCS" in out["local"] and f"GCS 127.0.0.1:{gcs}" not in out["local"], out["local"]
    finally:
        stop_cluster(temp_dir, gcs)


# ----------------------------------------------------------------- 2. trusted remote code is a pinned commit
def test_trust_remote_code_needs_a_pinned_full_commit_revision():
    with pytest.raises(ConfigError, match="pin verifier.revision"):
        load_config(None, ["verifier.trust_remote_code=true"])
    for moving in ("main", "v1.0", "4d01dfe", "4D01DFE0332D63057C186E0B262165819EFB6611"):
        with pytest.raises(ConfigError, match="full commit hash"):
            load_config(None, ["verifier.trust_remote_code=true", f"verifier.revision={moving}"])
    sha = "0123456789abcdef0123456789abcdef01234567"
    cfg = load_config(None, ["verifier.trust_remote_code=true", f"verifier.revision={sha}"])
    assert cfg.verifier.revision == sha


def test_every_shipped_config_that_trusts_remote_code_pins_a_revision():
    trusting = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        v = load_config(path, resolved=False).verifier  # validates: a trusting config without a pin fails here
        if v.trust_remote_code:
            trusting.append(path.name)
            assert re.fullmatch(r"[0-9a-f]{40}", v.revision), path.name
    assert "kimi-k2.5.yaml" in trusting


def test_the_revision_reaches_the_verifier_identity_only_when_set():
    from eagle3ray.verifier import VerifierSpec

    plain = VerifierSpec(model_path="org/model", layer_ids=[2, 4, 5])
    pinned = VerifierSpec(model_path="org/model", layer_ids=[2, 4, 5], revision="ab" * 20)
    assert "revision" not in plain.identity()  # identities (and service names) of unpinned verifiers unchanged
    assert pinned.identity()["revision"] == "ab" * 20 and pinned.identity_hash() != plain.identity_hash()


# ------------------------------------------------------------- 3. `ray up`: no token on a docker command line
def _strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _secret_on_command_line(text: str) -> list[str]:
    """`NAME=value` or `$NAME` / `${NAME}` of a secret variable (a *_PATH variable names a file: allowed)."""
    names = "|".join(SECRET_VARS)
    return re.findall(rf"\b(?:{names})=\S*|\$\{{?(?:{names})\b\}}?", text)


def test_the_ray_up_launcher_puts_no_secret_on_the_docker_run_command_line():
    from ray.autoscaler._private.docker import docker_start_cmds

    launcher = yaml.safe_load((ROOT / "cluster/launcher/aws.yaml").read_text())
    docker = launcher["docker"]
    options = docker.get("run_options", []) + docker.get("head_run_options", []) + docker.get("worker_run_options", [])
    # the very command Ray's launcher runs on each node (ray.autoscaler's DockerCommandRunner)
    run = docker_start_cmds("ubuntu", docker["image"], launcher.get("file_mounts", {}), docker["container_name"],
                            options, launcher["cluster_name"], "/home/ray", "docker")
    assert "RAY_AUTH_MODE=token" in run
    assert _secret_on_command_line(run) == [], run
    # nor on any other command the launcher runs (setup, ray start, ...)
    assert _secret_on_command_line("\n".join(_strings(launcher))) == []
    # the tokens arrive as files: each *_PATH variable points into a mounted directory from outside the repository
    paths = dict(re.findall(r"--env (RAY_AUTH_TOKEN_PATH|HF_TOKEN_PATH)=(\S+)", run))
    assert set(paths) == {"RAY_AUTH_TOKEN_PATH", "HF_TOKEN_PATH"}, run
    mounts = launcher["file_mounts"]
    for path in paths.values():
        (dst,) = [d for d in mounts if path.startswith(d.rstrip("/") + "/")]
        assert mounts[dst].startswith("~/") and f"-v /tmp/ray_tmp_mount/eagle3ray/{dst}:{dst}" in run


def test_the_secret_check_sees_a_token_on_a_command_line():
    """The check above can fail: the options main shipped put the tokens on `docker run`."""
    assert _secret_on_command_line("--env RAY_AUTH_TOKEN=$RAY_AUTH_TOKEN --env HF_TOKEN=$HF_TOKEN")
    assert _secret_on_command_line("-e AWS_SECRET_ACCESS_KEY=abc")
    assert not _secret_on_command_line("--env RAY_AUTH_TOKEN_PATH=/opt/s/ray_auth_token --env RAY_AUTH_MODE=token")


# ------------------------------------------------------- 4. KubeRay: only the cluster's own pods reach its ports
HEAD_PORTS = {"gcs": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions would need more than this reader
    match = selector.get("matchLabels") or {}
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def _pods(doc: dict) -> dict[str, dict]:
    """Labels of every pod a RayCluster/RayJob creates (KubeRay adds ray.io/node-type to the template's)."""
    spec = doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]
    pods = {"head": {**spec["headGroupSpec"]["template"].get("metadata", {}).get("labels", {}),
                     "ray.io/node-type": "head"}}
    for g in spec["workerGroupSpecs"]:
        pods[g["groupName"]] = {**g["template"].get("metadata", {}).get("labels", {}), "ray.io/node-type": "worker"}
    if doc["kind"] == "RayJob":
        pods["submitter"] = doc["spec"]["submitterPodTemplate"].get("metadata", {}).get("labels", {})
    return pods


def _peers_allowed(policy: dict, port: int, pods: dict[str, dict]) -> set[str]:
    """Who may connect to ``port`` under ``policy``: names of the cluster's pods, or 'namespace:NAME'.
    Anything broader (an empty selector, an ipBlock, a namespace chosen by other labels) fails the test."""
    allowed = set()
    for rule in policy["spec"].get("ingress", []):
        ports = {p["port"] for p in rule.get("ports", [])}
        if ports and port not in ports:
            continue
        assert rule.get("from"), f"an ingress rule without `from` admits everyone: {rule}"
        for peer in rule["from"]:
            assert set(peer) <= {"podSelector", "namespaceSelector"}, f"peer too broad: {peer}"
            if "namespaceSelector" in peer:
                ns = peer["namespaceSelector"].get("matchLabels", {})
                assert set(ns) == {"kubernetes.io/metadata.name"} and "podSelector" not in peer, peer
                assert ports, f"a namespace may reach named ports only: {rule}"
                allowed.add(f"namespace:{ns['kubernetes.io/metadata.name']}")
            else:
                members = {name for name, labels in pods.items() if _selects(peer["podSelector"], labels)}
                assert members, f"peer selects none of the cluster's pods: {peer}"
                allowed |= members
    return allowed


@pytest.mark.parametrize("path", sorted((ROOT / "cluster/kuberay").glob("*.yaml")), ids=lambda p: p.name)
def test_kuberay_head_ports_are_reachable_only_from_the_clusters_pods_and_named_namespaces(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    (cluster,) = [d for d in docs if d["kind"] in ("RayCluster", "RayJob")]
    pods = _pods(cluster)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy" and _selects(d["spec"]["podSelector"], pods["head"])]
    assert policies, f"{path.name}: no NetworkPolicy selects the head pod"
    for policy in policies:
        assert "Ingress" in policy["spec"]["policyTypes"]
    # pods of one cluster must not select another's: the label differs between the files
    assert all(p.get("eagle3ray.io/cluster") == pods["head"]["eagle3ray.io/cluster"] for p in pods.values()), pods
    for name, port in HEAD_PORTS.items():
        allowed = set().union(*(_peers_allowed(p, port, pods) for p in policies))
        assert allowed, (name, port)
        outsiders = {a for a in allowed if a.startswith("namespace:")}
        if name in ("gcs", "client", "serve"):  # run code / reach the verifier: the cluster's own pods only
            assert not outsiders, (name, outsiders)
        assert allowed - outsiders <= set(pods), (name, allowed)
    # the cluster's own pods reach each other on any port (raylet, object manager, workers)
    assert {"head", *(set(pods) - {"submitter"})} <= _peers_allowed(policies[0], 23456, pods)


def test_the_network_policy_check_fails_an_open_policy():
    pods = {"head": {"eagle3ray.io/cluster": "c", "ray.io/node-type": "head"}}
    open_to_all = {"spec": {"ingress": [{"from": [{"namespaceSelector": {}}]}]}}
    with pytest.raises(AssertionError):
        _peers_allowed(open_to_all, 6379, pods)
    with pytest.raises(AssertionError):
        _peers_allowed({"spec": {"ingress": [{}]}}, 6379, pods)


# --------------------------------------------------------------------- 5. no local secret enters an image
def _dockerignore_regex(pattern: str) -> re.Pattern:
    """One .dockerignore pattern as Docker (moby/patternmatcher) reads it: relative to the context root,
    `**` any number of directories, `*` and `?` within one path element."""
    pattern = pattern.strip().lstrip("/")
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
                out += "(.*/)?"
            else:
                out += ".*"
            continue
        out += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c))
        i += 1
    return re.compile(f"^{out}$")


def _excluded(path: str, lines: list[str]) -> bool:
    """Whether the build context leaves ``path`` out: the last pattern matching it or a parent directory wins
    (a directory left out is not walked); ``!pattern`` takes it back."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rx = _dockerignore_regex(line[1:] if negate else line)
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded


LOCAL_SECRETS = [".env", ".env.local", "configs/.env", "scripts/.env.prod", "key.pem", "certs/tls.pem",
                 "cluster/ssh.key", ".aws/credentials", "sub/.aws/config", "auth_token", ".ray/auth_token",
                 "home/.ray/auth_token", ".ssh/id_ed25519", ".netrc"]


def test_dockerignore_keeps_local_secrets_out_of_images():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert [p for p in LOCAL_SECRETS if not _excluded(p, lines)] == []
    # ... and not what the image needs (docker/ COPYs the context and runs scripts/setup.sh)
    needed = ["pyproject.toml", "scripts/setup.sh", "eagle3ray/config.py", "configs/kimi-k2.5.yaml",
              "configs/verifiers/Kimi-K2.5/config.json", "jobs/run.py"]
    assert [p for p in needed if _excluded(p, lines)] == []


def test_the_dockerignore_reader_follows_dockers_root_anchoring():
    """`*.pem` only matches at the context's root, as in Docker: the reason the file uses **/ patterns."""
    assert _excluded("a.pem", ["*.pem"]) and not _excluded("certs/a.pem", ["*.pem"])
    assert _excluded("certs/a.pem", ["**/*.pem"]) and _excluded(".aws/credentials", [".aws"])
    assert not _excluded(".env", [".env", "!.env"])


# ------------------------------------------------------------ 6. no credentials in a config's URLs
URL_FIELDS = [
    ("run.storage", "s3://AKIAEXAMPLEKEY:s3cr3tvalue@bucket/runs"),
    ("run.storage", "s3://s3cr3tvalue@bucket/runs"),
    ("run.endpoint_url", "http://user:s3cr3tvalue@127.0.0.1:9000"),
    ("ray.address", "ray://admin:s3cr3tvalue@head:10001"),
    ("verifier.model", "s3://key:s3cr3tvalue@models/llama"),
    ("verifier.config_path", "https://user:s3cr3tvalue@example.org/config.json"),
    ("data.train", [{"kind": "chat", "path": "https://example.org/d.jsonl?X-Amz-Signature=s3cr3tvalue"}]),
    ("validation.reference_drafts", ["https://example.org/draft?token=s3cr3tvalue"]),
]


@pytest.mark.parametrize("key,value", URL_FIELDS, ids=[k for k, _ in URL_FIELDS])
def test_a_url_with_credentials_is_rejected_in_any_field_without_echoing_them(tmp_path, key, value):
    tree = copy.deepcopy(yaml.safe_load((ROOT / "configs/smollm2-135m-cpu.yaml").read_text()))
    section, name = key.split(".")
    tree.setdefault(section, {})[name] = value
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match="carries credentials") as e:
        load_config(f, resolved=False)
    assert key.split(".")[1] in str(e.value) and "s3cr3tvalue" not in str(e.value) and "AKIA" not in str(e.value)


def test_urls_without_credentials_still_load():
    cfg = load_config(None, ["run.endpoint_url=http://127.0.0.1:9000", "ray.address=ray://head:10001",
                             "run.storage=s3://bucket/runs?region=us-east-1"], resolved=False)
    assert cfg.ray.address == "ray://head:10001"
