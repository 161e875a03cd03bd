"""The verifier service: a Ray Serve application of long-lived :class:`VerifierEngine` replicas.

Why Serve (DESIGN.md): replicas are long-lived actors that outlive the job that started them,
autoscale between ``min_replicas`` and ``max_replicas`` from queued requests, are replaced when
they die, reserve a tensor-parallel replica's GPUs as one placement group, and show up in the
dashboard. The application is named after the verifier's identity hash
(``eagle3ray-verifier-<hash>``), so a later stage or job with the same verifier settings finds it
running and uses it instead of loading the model again.

Each replica serves one request at a time (``max_ongoing_requests=1``): a request is already a
token-budgeted batch, and vLLM's offline ``LLM`` is not re-entrant.
"""

from __future__ import annotations

import logging
import time

import ray
from ray import serve

from .verifier import VerifierEngine, VerifierSpec

log = logging.getLogger(__name__)

APP_PREFIX = "eagle3ray-verifier-"


def app_name(spec: VerifierSpec) -> str:
    return APP_PREFIX + spec.identity_hash()


def _replica_options(spec: VerifierSpec, num_cpus: float) -> dict:
    """Ray resources of one replica. TP>1 on GPUs: one STRICT_PACK placement group (one node), a
    bundle for the replica and one GPU bundle per tensor-parallel rank, which vLLM's Ray executor
    uses for its workers (vLLM docs, "Serving with Ray Serve")."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(int(max(1, spec.cpu_kv_cache_gib)))} if spec.device == "cpu" else {}
    opts: dict = {"ray_actor_options": {"num_cpus": num_cpus, "runtime_env": {"env_vars": env}}}
    if spec.device == "cuda":
        if spec.tensor_parallel_size == 1:
            opts["ray_actor_options"]["num_gpus"] = 1
        else:
            opts["placement_group_bundles"] = [{"CPU": num_cpus}] + [{"GPU": 1}] * spec.tensor_parallel_size
            opts["placement_group_strategy"] = "STRICT_PACK"
    return opts


@serve.deployment(max_ongoing_requests=1, health_check_period_s=30, health_check_timeout_s=120,
                  graceful_shutdown_timeout_s=30)
class VerifierDeployment:
    """Serve wrapper around :class:`VerifierEngine` (methods forwarded unchanged)."""

    def __init__(self, spec: dict):
        self.engine = VerifierEngine(spec)

    def info(self) -> dict:
        return self.engine.info()

    def extract(self, samples: list[dict], storage_dtype: str = "bfloat16") -> list[dict]:
        return self.engine.extract(samples, storage_dtype)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int | None = None) -> list[dict]:
        return self.engine.generate(prompts, max_new_tokens, temperature, seed)


def _running_apps() -> dict:
    try:
        return serve.status().applications
    except Exception:  # Serve not started on this cluster yet
        return {}


def get_or_start_verifier(spec: VerifierSpec, min_replicas: int = 1, max_replicas: int = 1,
                          num_cpus: float = 1.0) -> serve.handle.DeploymentHandle:
    """A handle to the running verifier service for ``spec``, starting it if absent.

    A running application with the same identity hash is reused as it is (the model is not loaded
    again). Requires ``ray.init`` to have been called.

    Raises:
        RuntimeError: the application failed to deploy (the replica's error is in the message).
    """
    name = app_name(spec)
    apps = _running_apps()
    if name in apps and str(apps[name].status).endswith("RUNNING"):
        handle = serve.get_app_handle(name)
        _announce("reusing running", name, handle)
        return handle
    serve.start(proxy_location="Disabled")
    autoscaling = {"min_replicas": min_replicas, "max_replicas": max_replicas, "initial_replicas": min_replicas,
                   "target_ongoing_requests": 1, "upscale_delay_s": 5, "downscale_delay_s": 60}
    dep = VerifierDeployment.options(autoscaling_config=autoscaling, **_replica_options(spec, num_cpus))
    t0 = time.time()
    log.info("starting verifier service %s (%s, layers %s)", name, spec.model_path, spec.layer_ids)
    try:
        handle = serve.run(dep.bind(spec.__dict__), name=name, route_prefix=None, blocking=False)
    except Exception as e:  # Serve raises RuntimeError with the replica's traceback
        raise RuntimeError(f"verifier service {name} failed to start: {e}") from e
    _announce(f"started ({time.time() - t0:.1f} s)", name, handle)
    return handle


def _announce(what: str, name: str, handle) -> None:
    """One line (stdout, so Ray Job logs carry it) naming the service and its replica's process."""
    info = handle.info.remote().result()
    print(f"[eagle3ray] verifier service {name} {what}: replica pid {info['pid']}, engine loads in that "
          f"process {info['loads_in_process']}, loaded {info['uptime_seconds']:.0f} s ago "
          f"(load took {info['load_seconds']:.1f} s), extract calls so far {info['extract_calls']}", flush=True)


def stop_verifier(spec: VerifierSpec) -> bool:
    """Delete the verifier application for ``spec``; True when one was running."""
    name = app_name(spec)
    if name in _running_apps():
        serve.delete(name)
        return True
    return False


def ensure_ray(cfg) -> bool:
    """Connect to (or start) Ray per ``cfg.ray``; returns True when this call started the connection.

    Token authentication stays as Ray configures it (on by default in Ray 2.60); a local cluster
    binds to 127.0.0.1 and starts no dashboard unless ``ray.include_dashboard`` is set.
    """
    if ray.is_initialized():
        return False
    import os

    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")  # set for drivers of `ray job submit`
    if address:
        ray.init(address=address, namespace=cfg.ray.namespace, log_to_driver=True)
    else:
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=cfg.ray.include_dashboard,
                 namespace=cfg.ray.namespace, _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}})
    return True
