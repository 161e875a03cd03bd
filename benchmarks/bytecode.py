"""Benchmark: fresh processes of a run with set-up's compiled bytecode against compiling every module at import.

Where ``PYTHONDONTWRITEBYTECODE=1`` is set (this project's machines set it) and nothing compiled the venv,
Python compiles every module of torch, vLLM, transformers and Ray from source in every new process, and throws the
result away. ``scripts/setup.sh`` now compiles the venv's site-packages once (``compileall``). This starts one fresh
process per variant, measurement and round, with the variants interleaved within each round:

- ``source``: ``PYTHONDONTWRITEBYTECODE=1`` and ``PYTHONPYCACHEPREFIX`` set to an empty folder, so Python finds
  no ``.pyc`` and compiles from source (what every process did before set-up compiled the venv);
- ``compiled``: the venv as set-up leaves it (its ``__pycache__`` folders), ``PYTHONDONTWRITEBYTECODE=1``.

Measurements, each the product's own code in a fresh process, wall seconds from the process's start:

1. ``engine``: :class:`eagle3ray.serving_engine.ServingEngine` of the config's verifier, built (what each engine
   process of a run pays before its first token: the plan's probe, regeneration, the verifier service's replica,
   validation's engines);
2. ``train worker``: the imports of the Ray Train worker's step (:class:`eagle3ray.train_worker.DraftStep` with
   speculators) and one draft built from the verifier;
3. ``ray``: a local Ray cluster started (``ray.init``) and 2 tasks that import torch run on its workers (Ray's
   workers inherit the variant's environment), then shut down.

Prints seconds per round, the medians and the ratio compiled / source. Needs the venv compiled (run
``scripts/setup.sh``); it says so when the venv holds no bytecode.

    .venv/bin/python benchmarks/bytecode.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MEASURES = ("engine", "train worker", "ray")


def child(measure: str, config: str | None) -> None:
    t0 = time.time()
    from eagle3ray import plan
    from eagle3ray.config import load_config
    from eagle3ray.verifier import VerifierSpec

    cfg = load_config(config, [])
    spec = VerifierSpec.from_config(cfg)
    if measure == "engine":
        from eagle3ray.serving_engine import ServingEngine

        v = cfg.verifier
        ServingEngine(spec.model_path, dtype=v.dtype, max_model_len=v.max_model_len, enforce_eager=v.enforce_eager,
                      max_num_seqs=v.max_num_seqs, seed=v.seed, cpu_kv_cache_gib=1.0,
                      gpu_memory_utilization=v.gpu_memory_utilization,
                      tensor_parallel_size=v.tensor_parallel_size, device=v.device, cpu_threads=v.cpu_threads)
    elif measure == "train worker":
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

        from eagle3ray.train_worker import DraftStep

        V = spec.model_identity["vocab_size"]
        d2t, t2d = build_vocab_mappings_from_distribution({i: 1 for i in range(V)}, cfg.vocab.draft_vocab_size, V)
        DraftStep.build(plan.timing_train_settings(cfg.train), spec.model_path, spec.layer_ids[:-1], d2t, t2d,
                        spec.model_identity["hidden_size"], autocast_bf16=False)
    else:
        import ray

        @ray.remote(num_cpus=1)
        def imports_torch() -> str:
            import torch

            return torch.__version__

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray.get([imports_torch.remote() for _ in range(2)])
        ray.shutdown()
    import psutil

    print("RESULT " + json.dumps({"s": time.time() - psutil.Process().create_time(), "in_code_s": time.time() - t0}))


def venv_compiled() -> bool:
    import torch

    root = os.path.dirname(torch.__file__)
    return os.path.isdir(os.path.join(root, "__pycache__"))


def run(measure: str, variant: str, config: str | None, empty: str) -> float:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("PYTHONPYCACHEPREFIX", None)
    if variant == "source":
        env["PYTHONPYCACHEPREFIX"] = empty
    argv = [sys.executable, __file__, "--child", measure] + (["-c", config] if config else [])
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{measure} / {variant} failed:\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][7:])["s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--measures", default=",".join(MEASURES), help="comma-separated: " + ", ".join(MEASURES))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.config)
    if not venv_compiled():
        sys.exit("the venv holds no compiled bytecode (torch/__pycache__): run scripts/setup.sh first")
    from eagle3ray.plan import _cpu_model
    from eagle3ray.machine import cpu_flags

    print(f"machine: {_cpu_model()}, amx_bf16 {'amx_bf16' in cpu_flags()}, {os.cpu_count()} CPUs", flush=True)
    measures = args.measures.split(",")
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as empty:
        for r in range(args.rounds):
            for m in measures:
                for variant in ("source", "compiled"):
                    s = run(m, variant, args.config, empty)
                    times.setdefault((m, variant), []).append(s)
                    print(f"round {r} {m:12s} {variant:8s}: {s:6.1f} s", flush=True)
    for m in measures:
        src, comp = (statistics.median(times[(m, v)]) for v in ("source", "compiled"))
        print(f"median {m:12s}: source {src:6.1f} s, compiled {comp:6.1f} s, ratio compiled/source {comp / src:.2f}")


if __name__ == "__main__":
    main()
