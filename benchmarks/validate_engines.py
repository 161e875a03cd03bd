"""Benchmark: the validate stage's engines with the verifier service resident beside them, and with it stopped.

In ``eagle3ray run`` on a local cluster, the extract stage starts the verifier service (a Serve replica holding a
vLLM engine and its ``verifier.cpu_kv_cache_gib`` KV cache) and, before session 19, left it up until the command
ended. This measures what that costs the validate stage, on the code the product runs
(:func:`eagle3ray.validate.validate` on an existing run's export), in one local Ray cluster:

- ``resident``: the verifier service started (:func:`eagle3ray.verifier_service.start_for_config`) and left up
  while validate runs (what a run did before);
- ``stopped``: the service started, then stopped (:func:`eagle3ray.pipeline.release_local_verifier`, what a run
  does now after its last stage that calls it).

Each validate call re-runs (its stored report is removed first) and reports, per engine, its start (actor, imports,
load: ``engine_seconds`` in ``reports/validate.json``) and its decoding time; validation's engines start
``validation.engines_at_once`` at a time (2 on CPU). The modes alternate within each round; the script prints each
round, the medians and the ratio stopped / resident. Needs a run with an export (``eagle3ray run``)::

    .venv/bin/python benchmarks/validate_engines.py --run s19a --rounds 1
    .venv/bin/python benchmarks/validate_engines.py --run s19a --rounds 1 validation.engines_at_once=1
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time


def _available_gib() -> float:
    with open("/proc/meminfo") as f:
        kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in f}
    return kb["MemAvailable"] / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-135m-cpu.yaml")
    ap.add_argument("--run", required=True, help="run.name of a run with an export")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    a = ap.parse_args()

    from eagle3ray import machine, storage
    from eagle3ray.config import load_config
    from eagle3ray.machine import ensure_ray
    from eagle3ray.pipeline import release_local_verifier
    from eagle3ray.validate import validate
    from eagle3ray.verifier_service import start_for_config

    cfg = load_config(a.config, [f"run.name={a.run}", *a.overrides])
    ensure_ray(cfg)
    assert machine.STARTED_LOCAL_CLUSTER, "the benchmark needs a local cluster of its own (no ray.address)"
    paths = storage.run_paths(cfg)
    rep_path = f"{paths.sub('reports')}/validate.json"
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    print(f"machine: {model}, amx_bf16={'amx_bf16' in cpu}; run {a.run}; overrides {a.overrides or 'none'}")
    rows: dict[str, list[dict]] = {"resident": [], "stopped": []}
    for r in range(a.rounds):
        for mode in ("resident", "stopped"):
            start_for_config(cfg)
            if mode == "stopped":
                assert release_local_verifier(cfg), "the service was not running"
                time.sleep(3)  # Serve frees the replica's memory once its process exits
            avail = _available_gib()
            if paths.fs.exists(rep_path):
                paths.fs.rm(rep_path)
            t = time.time()
            rep = validate(cfg)
            wall = time.time() - t
            eng = rep["engine_seconds"]
            row = {"wall": wall, "start": max(e["start_s"] for e in eng), "decode": sum(e["decode_s"] for e in eng),
                   "acc": rep["mean_acceptance_length"]}
            rows[mode].append(row)
            print(f"round {r} {mode:8s}: available RAM {avail:.1f} GiB before; engines started in "
                  + ", ".join(f"{e['start_s']:.1f} s ({'draft' if e['draft'] else 'alone'}, {e['started_together']} "
                              f"together)" for e in eng)
                  + f"; decoding {row['decode']:.1f} s; validate {wall:.1f} s; acceptance {row['acc']:.3f}",
                  flush=True)
    med = {m: {k: statistics.median(x[k] for x in v) for k in ("wall", "start", "decode")} for m, v in rows.items()}
    for m, v in med.items():
        print(f"median {m:8s}: engines started in {v['start']:.1f} s, decoding {v['decode']:.1f} s, "
              f"validate {v['wall']:.1f} s")
    print(f"ratio stopped/resident: validate {med['stopped']['wall'] / med['resident']['wall']:.2f}, engine start "
          f"{med['stopped']['start'] / med['resident']['start']:.2f}, decoding "
          f"{med['stopped']['decode'] / med['resident']['decode']:.2f}")


if __name__ == "__main__":
    main()
