"""Benchmark: extraction with a cold vs warm verifier service, and with 1 vs 2 replicas.

A Ray cluster (one node on 127.0.0.1, ``--num-cpus`` logical CPUs) is started; every measurement is a
separate *job* process (``python benchmarks/extract_scaling.py --job ...``, attached with RAY_ADDRESS), as
users run extract jobs one after another against a cluster:

1. cold: no verifier service is running; the job starts it (loads the model) and extracts.
2. warm: the service from (1) is running; the next job attaches to it (``--rounds`` jobs).
3. 2 replicas: the service is stopped and restarted with ``extract.min_replicas = max_replicas = 2``; warm jobs.

Reported per job: seconds from the job's ``extract()`` call to its first committed block (``first_block_s``),
the same from the process start (imports and ``ray.init`` included), and the extraction loop's tokens/s
(first unit sent -> last block committed). Prints medians and the ratios warm/cold (first block) and
2/1 replicas (tokens/s), with the machine's core count: replicas share the same cores here, so scaling
is bounded by them.

    .venv/bin/python benchmarks/extract_scaling.py                  # 32 ShareGPT samples, 3 warm rounds
"""

from __future__ import annotations

import time

T_PROCESS = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def job(args) -> None:
    """One extract job (run in its own process by the orchestrator); prints a JSON line."""
    from eagle3ray.config import load_config
    from eagle3ray.extract import extract

    cfg = load_config(args.config, args.overrides)
    first: dict = {}
    t0 = time.time()

    def on_commit(_man):
        first.setdefault("t", time.time())

    s = extract(cfg, on_commit=on_commit, progress=False)
    print("JOB " + json.dumps({"first_block_s": first["t"] - t0, "first_block_from_process_s": first["t"] - T_PROCESS,
                               "tokens": s.tokens, "tokens_per_s": s.tokens_per_s, "loop_s": s.seconds,
                               "blocks": s.blocks}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-cpus", type=int, default=4)
    ap.add_argument("--max-tokens-per-batch", type=int, default=1024)
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.job:
        return job(args)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback addresses stay loopback
    from ray.cluster_utils import Cluster

    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.prepare import prepare

    tmp = tempfile.mkdtemp(prefix="e3r-scaling-")
    base = [f"run.storage=file://{tmp}", f"data.max_samples={args.samples}", "data.regenerate=false",
            "data.max_turns=1", f"extract.max_tokens_per_batch={args.max_tokens_per_batch}", "ray.address=auto"]
    prep_cfg = load_config(args.config, base + ["run.name=prep"])
    p = prepare(prep_cfg)
    print(f"samples={p.samples} tokens={p.tokens} cores={os.cpu_count()} logical_cpus={args.num_cpus} "
          f"max_tokens_per_batch={args.max_tokens_per_batch}", flush=True)
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=args.num_cpus, node_ip_address="127.0.0.1",
                                                                include_dashboard=False))
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    n = 0

    def run_job(*extra: str) -> dict:
        nonlocal n
        n += 1
        name = f"job{n}"
        cfg = load_config(args.config, base + [f"run.name={name}"])
        src, dst = storage.run_paths(prep_cfg), storage.run_paths(cfg)
        src.fs.copy(src.conversations, dst.conversations, recursive=True)
        cmd = [sys.executable, __file__, "--job", *(["-c", args.config] if args.config else []),
               *base, f"run.name={name}", *extra]
        out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
        lines = [x for x in out.stdout.splitlines() if x.startswith("JOB ")]
        if out.returncode or not lines:
            raise SystemExit(f"job {name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        r = json.loads(lines[-1][4:])
        print(f"  {name} {' '.join(extra) or ''}: first block {r['first_block_s']:.1f} s after extract() "
              f"({r['first_block_from_process_s']:.1f} s after process start), {r['tokens_per_s']:.0f} tok/s "
              f"({r['blocks']} blocks)", flush=True)
        return r

    def stop_all() -> None:
        subprocess.run([sys.executable, "-m", "eagle3ray.cli", "verifier", "stop", "--all", *base[:1], "ray.address=auto"],
                       env=env, cwd=ROOT, capture_output=True, timeout=300)

    try:
        print("cold (no verifier service running):", flush=True)
        cold = run_job()
        print("warm (service from the cold job still running), 1 replica:", flush=True)
        warm = [run_job() for _ in range(args.rounds)]
        stop_all()
        print("2 replicas (service restarted with min_replicas = max_replicas = 2):", flush=True)
        two_cold = run_job("extract.min_replicas=2", "extract.max_replicas=2")
        two = [run_job("extract.min_replicas=2", "extract.max_replicas=2") for _ in range(args.rounds)]
    finally:
        stop_all()
        cluster.shutdown()
    med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
    w_first, w_first_p = med(warm, "first_block_s"), med(warm, "first_block_from_process_s")
    one_tps, two_tps = med(warm, "tokens_per_s"), med(two, "tokens_per_s")
    print("\nsummary")
    print(f"  first committed block, cold: {cold['first_block_s']:.1f} s after extract() "
          f"({cold['first_block_from_process_s']:.1f} s after process start)")
    print(f"  first committed block, warm (median of {len(warm)}): {w_first:.2f} s after extract() "
          f"({w_first_p:.1f} s after process start)")
    print(f"  warm/cold first block: {w_first / cold['first_block_s']:.3f} "
          f"(from process start: {w_first_p / cold['first_block_from_process_s']:.3f})")
    print(f"  tokens/s 1 replica (median): {one_tps:.0f}; 2 replicas (median): {two_tps:.0f}; ratio "
          f"{two_tps / one_tps:.2f} on {os.cpu_count()} cores (2-replica cold start: "
          f"{two_cold['first_block_s']:.1f} s)")


if __name__ == "__main__":
    main()
