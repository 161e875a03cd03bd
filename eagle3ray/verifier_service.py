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
import threading
import time

import ray
from ray import serve

from .verifier import VerifierSpec, make_engine

log = logging.getLogger(__name__)

APP_PREFIX = "eagle3ray-verifier-"


def app_name(spec: VerifierSpec) -> str:
    return APP_PREFIX + spec.identity_hash()


def _replica_options(spec: VerifierSpec, num_cpus: float, resources: dict | None = None) -> dict:
    """Ray resources of one replica. TP>1 on GPUs: one STRICT_PACK placement group (one node), a
    bundle for the replica and one GPU bundle per tensor-parallel rank, which vLLM's Ray executor
    uses for its workers (vLLM docs, "Serving with Ray Serve"). ``resources``: extra custom resources
    of the replica (``verifier.ray_resources``), in its own bundle."""
    from .machine import cpu_engine_env

    env = {"VLLM_CPU_KVCACHE_SPACE": str(int(max(1, spec.cpu_kv_cache_gib))), **cpu_engine_env(spec.device)} \
        if spec.device == "cpu" else {}
    resources = dict(resources or {})
    opts: dict = {"ray_actor_options": {"num_cpus": num_cpus, "runtime_env": {"env_vars": env}}}
    if resources:
        opts["ray_actor_options"]["resources"] = resources
    if spec.device == "cuda":
        if spec.tensor_parallel_size == 1:
            opts["ray_actor_options"]["num_gpus"] = 1
        else:
            opts["placement_group_bundles"] = ([{"CPU": num_cpus, **resources}]
                                               + [{"GPU": 1}] * spec.tensor_parallel_size)
            opts["placement_group_strategy"] = "STRICT_PACK"
    return opts


@serve.deployment(max_ongoing_requests=1, health_check_period_s=10, health_check_timeout_s=120,
                  graceful_shutdown_timeout_s=30)
class VerifierDeployment:
    """Serve wrapper around :class:`VerifierEngine` (methods forwarded unchanged), with a health check.

    Serve calls :meth:`check_health` every 10 s; when the replica has been idle ``EAGLE3RAY_ENGINE_PROBE_S``
    (default 60 s) since its last probe, the check calls the engine itself (a one-token decode, never at the same
    time as a request). When it raises, Serve marks the replica unhealthy, stops it
    and starts a replacement (the extraction client retries the unit; ``eagle3ray.extract.BlockWriter``). It
    raises when the engine failed a call with anything but bad input (:class:`VerifierError`: a vLLM engine
    that died inside a live replica would otherwise fail every later unit, and later jobs would reuse the broken
    service), and when a call has run past its deadline: the ``timeout_s`` its caller passed
    (``extract.unit_timeout_s``, ``data.regenerate_timeout_s``), else ``EAGLE3RAY_ENGINE_HANG_S`` (default
    1800 s). Serve stops a replica after 3 failed checks 10 s apart, then waits up to 30 s for it to shut down, so a
    hung engine is replaced about ``timeout_s`` + 30-60 s after its call began.
    """

    def __init__(self, spec: dict, pinned: bool = False):
        import os

        self.engine = make_engine(spec)
        self.pinned = pinned
        self.broken: str | None = None
        self.busy: tuple[float, float] | None = None  # (started, deadline) of the call in progress
        self.hang_s = float(os.environ.get("EAGLE3RAY_ENGINE_HANG_S", "1800"))
        self.probe_every_s = float(os.environ.get("EAGLE3RAY_ENGINE_PROBE_S", "60"))
        self.probed_at = time.time()
        self._engine_lock = threading.Lock()  # one engine call at a time: a request or the idle probe

    def _guarded(self, fn, *args, timeout_s: float | None = None):
        from .verifier import VerifierError

        if self.broken:
            raise RuntimeError(f"verifier replica unhealthy, waiting for Serve to replace it: {self.broken}")
        with self._engine_lock:
            if self.broken:  # found by the probe while this request waited for the engine
                raise RuntimeError(f"verifier replica unhealthy, waiting for Serve to replace it: {self.broken}")
            now = time.time()
            self.busy = (now, now + (timeout_s or self.hang_s))
            try:
                return self._call_engine(fn, *args)
            finally:
                self.probed_at = time.time()  # a request is a probe too: idle time counts from here

    def _call_engine(self, fn, *args):
        from .verifier import VerifierError

        try:
            return fn(*args)
        except VerifierError:
            raise  # bad input or a check on the output: the engine itself is fine
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"[:500]
            raise
        finally:
            self.busy = None

    async def check_health(self) -> None:
        """Serve's health check (see the class docstring). Raises RuntimeError naming the cause.

        ``async`` on purpose: Serve runs sync methods in a thread pool of ``max_ongoing_requests`` (1) threads, so
        a sync health check would wait behind the very call it must judge; a coroutine runs on the replica's event
        loop while the engine call holds the thread."""
        if self.broken:
            raise RuntimeError(f"engine failed: {self.broken}")
        busy = self.busy
        if busy is not None and time.time() > busy[1]:
            raise RuntimeError(f"engine call running for {time.time() - busy[0]:.0f} s, past its deadline of "
                               f"{busy[1] - busy[0]:.0f} s: hung")
        if busy is None and time.time() - self.probed_at >= self.probe_every_s:
            import asyncio

            await asyncio.get_running_loop().run_in_executor(None, self._probe_if_idle)
            if self.broken:
                raise RuntimeError(f"engine failed its probe: {self.broken}")

    def _probe_if_idle(self) -> None:
        """Call the engine (:meth:`eagle3ray.verifier.VerifierEngine.probe`: a one-token decode) when no request
        holds it, so an engine that died or wedged while idle is found before a unit is sent to it. A probe that
        runs past ``EAGLE3RAY_ENGINE_PROBE_S`` x 2 (or 60 s) is a hang: the next check sees ``busy`` past its
        deadline."""
        if not self._engine_lock.acquire(blocking=False):
            return  # a request holds the engine: its own deadline judges it
        try:
            now = time.time()
            self.busy = (now, now + max(60.0, 2 * self.probe_every_s))
            self._call_engine(self.engine.probe)
        except Exception:  # noqa: BLE001 - recorded in self.broken by _call_engine
            pass
        finally:
            self.busy = None
            self.probed_at = time.time()
            self._engine_lock.release()

    def info(self) -> dict:
        """The engine's info plus where the replica runs (node id, placement group) and ``pinned``."""
        pg = ray.util.get_current_placement_group()
        return {**self.engine.info(), "node_id": ray.get_runtime_context().get_node_id(),
                "placement_group": pg.id.hex() if pg is not None else None, "pinned": self.pinned}

    def extract(self, samples: list[dict], storage_dtype: str = "bfloat16", timeout_s: float | None = None) -> list[dict]:
        """The engine's ``extract``; ``timeout_s``: this call's deadline (see the class docstring)."""
        return self._guarded(self.engine.extract, samples, storage_dtype, timeout_s=timeout_s)

    def extract_block(self, samples: list[dict], storage_dtype: str, storage_uri: str, endpoint_url: str | None,
                      hs_root: str, compression: str, timeout_s: float | None = None) -> dict:
        """``extract`` of one unit, then its block written by this replica (``extract.block_writer: replica``):
        only the manifest entry travels back (:func:`eagle3ray.blocks.write_unit_block`; ``samples`` carry
        ``loss_mask``). A storage error is raised as it is and does not mark the engine unhealthy."""
        from . import blocks, storage

        results = self._guarded(self.engine.extract,
                                [{"sample_id": s["sample_id"], "input_ids": s["input_ids"]} for s in samples],
                                storage_dtype, timeout_s=timeout_s)
        key = (storage_uri, endpoint_url)
        if getattr(self, "_fs_key", None) != key:
            self._fs, _ = storage.filesystem(storage_uri, endpoint_url)
            self._fs_key = key
        if getattr(self, "_scratch", None) is None:
            self._scratch = blocks.BlockScratch()  # this replica's block buffers, reused block after block
        return blocks.write_unit_block(self._fs, hs_root, samples, results, storage_dtype, compression, self._scratch)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, timeout_s: float | None = None) -> list[dict]:
        """The engine's ``generate``; ``timeout_s``: this call's deadline (see the class docstring)."""
        return self._guarded(self.engine.generate, prompts, max_new_tokens, temperature, seed, timeout_s=timeout_s)


def _running_apps() -> dict:
    try:
        return serve.status().applications
    except Exception:  # Serve not started on this cluster yet
        return {}


class VerifierMismatch(RuntimeError):
    """A pinned verifier service (``eagle3ray verifier start``) runs with another identity."""


def identity_diff(a: dict, b: dict) -> dict:
    """{field: (running, wanted)} for the identity fields that differ (model_identity flattened)."""
    flat = lambda d: {**{k: v for k, v in d.items() if k != "model_identity"},  # noqa: E731
                      **{f"model_identity.{k}": v for k, v in d.get("model_identity", {}).items()}}
    fa, fb = flat(a), flat(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def running_verifiers() -> dict[str, dict]:
    """{app name: info of one replica} for every eagle3ray verifier application on the cluster
    (``info`` is ``{"status": ...}`` alone when no replica answers)."""
    out = {}
    for name, st in _running_apps().items():
        if not name.startswith(APP_PREFIX):
            continue
        status = str(st.status).rsplit(".", 1)[-1]
        info: dict = {"status": status}
        if status == "RUNNING":
            try:
                info.update(serve.get_app_handle(name).info.remote().result(timeout_s=30))
            except Exception as e:  # a replica that does not answer is reported, not fatal
                info["error"] = f"{type(e).__name__}: {e}"
        try:
            dep = next(iter(st.deployments.values()))
            info["replica_states"] = {str(k).rsplit(".", 1)[-1]: v for k, v in dep.replica_states.items()}
        except (StopIteration, AttributeError):
            pass
        out[name] = info
    return out


def refuse_if_pinned_differs(spec: VerifierSpec) -> None:
    """Raise when a pinned service (``eagle3ray verifier start``) runs a verifier other than ``spec``.

    Raises:
        VerifierMismatch: names the service and every differing identity field (running vs this config).
    """
    name = app_name(spec)
    for other, info in running_verifiers().items():
        if other != name and info.get("pinned"):
            diff = identity_diff(info.get("identity", {}), spec.identity())
            fields = "; ".join(f"{k}: running {a!r}, this config {b!r}" for k, (a, b) in diff.items())
            raise VerifierMismatch(
                f"verifier service {other} (started with `eagle3ray verifier start`) runs another verifier: "
                f"{fields}. Use a config that matches it, or `eagle3ray verifier stop` it first.")


def get_or_start_verifier(spec: VerifierSpec, min_replicas: int = 1, max_replicas: int = 1,
                          num_cpus: float = 1.0, resources: dict | None = None,
                          pinned: bool = False) -> serve.handle.DeploymentHandle:
    """A handle to the running verifier service for ``spec``, starting it if absent.

    A running application with the same identity hash is reused as it is (the model is not loaded
    again). When a *pinned* service (started by ``eagle3ray verifier start``) runs with another
    identity, nothing is started: the user chose that verifier for the cluster. Requires ``ray.init``.

    Args:
        pinned: mark the service as kept between jobs (``eagle3ray verifier start``).

    Raises:
        VerifierMismatch: a pinned service runs with another identity (the message lists the fields).
        RuntimeError: the application failed to deploy (the replica's error is in the message).
    """
    name = app_name(spec)
    apps = _running_apps()
    if name in apps and str(apps[name].status).endswith("RUNNING"):
        handle = serve.get_app_handle(name)
        _announce("reusing running", name, handle)
        return handle
    refuse_if_pinned_differs(spec)
    serve.start(proxy_location="Disabled")
    autoscaling = {"min_replicas": min_replicas, "max_replicas": max_replicas, "initial_replicas": min_replicas,
                   "target_ongoing_requests": 1, "upscale_delay_s": 5, "downscale_delay_s": 60}
    dep = VerifierDeployment.options(autoscaling_config=autoscaling,
                                     **_replica_options(spec, num_cpus, resources))
    t0 = time.time()
    log.info("starting verifier service %s (%s, layers %s)", name, spec.model_path, spec.layer_ids)
    try:
        handle = serve.run(dep.bind(spec.__dict__, pinned), name=name, route_prefix=None, blocking=False)
    except Exception as e:  # Serve raises RuntimeError with the replica's traceback
        raise RuntimeError(f"verifier service {name} failed to start: {e}") from e
    _announce(f"started ({time.time() - t0:.1f} s)", name, handle)
    return handle


def start_for_config(cfg, pinned: bool = False) -> serve.handle.DeploymentHandle:
    """:func:`get_or_start_verifier` with the config's verifier, replica bounds and resources."""
    return get_or_start_verifier(VerifierSpec.from_config(cfg), cfg.extract.min_replicas, cfg.extract.max_replicas,
                                 cfg.verifier.num_cpus, cfg.verifier.ray_resources, pinned=pinned)


ANNOUNCE_TIMEOUT_S = 30.0


def _announce(what: str, name: str, handle) -> None:
    """One line (stdout, so Ray Job logs carry it) naming the service and its replica's process. The info call
    waits behind the replica's running request (one at a time): after :data:`ANNOUNCE_TIMEOUT_S` the line says the
    replica is busy instead of blocking the caller."""
    resp = handle.info.remote()
    try:
        info = resp.result(timeout_s=ANNOUNCE_TIMEOUT_S)
    except TimeoutError:
        resp.cancel()
        print(f"[eagle3ray] verifier service {name} {what}: its replica is busy with a request (no info within "
              f"{ANNOUNCE_TIMEOUT_S:.0f} s)", flush=True)
        return
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


def stop_all_verifiers() -> list[str]:
    """Delete every eagle3ray verifier application on the cluster; returns their names."""
    names = list(running_verifiers())
    for n in names:
        serve.delete(n)
    return names
