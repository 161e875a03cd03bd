"""Benchmark: the extraction data plane at real state shapes (Llama-3.1-8B, Kimi-K2.5), to ``file://`` and S3.

The stand-in engine (``verifier.engine: stand_in``, no model) produces states of the shipped verifier configs'
shapes (``configs/verifiers/*/config.json``: 4 x 4096 and 4 x 7168 values per token) and the product's own
extract stage (:func:`eagle3ray.extract.extract`: the Serve verifier service -> units -> blocks -> manifest
commits) writes them, once with each ``extract.block_writer`` (``data_actor``: states through Ray's object store
to a Ray Data actor that writes the block; ``replica``: the replica writes it). For each shape and storage it
prints, side by side:

- ``pipeline``: sustained tokens/s and MB/s of committed block files, from the first commit to the last (the
  service is warm: a warm-up round runs first), and CPU seconds per GB of raw bf16 states over the whole machine
  (every process: driver, Ray, replica, writers, and the S3 server when there is one);
- ``bare write``: the same bytes (the run's own block file, as many times as it committed blocks) written by a
  plain loop with the product's atomic write to the same storage: what this machine's storage takes;
- ``steps alone`` on one unit, CPU seconds per GB of raw bf16 states: ``produce`` (the stand-in's states: its own
  rate, also in tokens/s), ``encode`` (float32 -> storage dtype bytes), ``transfer`` (the service call minus the
  same call in-process: Serve and the object-store hop), ``table`` and ``compress`` (the block table and its
  Parquet bytes, in the reused buffers of :class:`eagle3ray.blocks.BlockScratch` as the writer builds them),
  ``sha256``, ``write`` (the atomic write), ``commit`` (one manifest commit). The block writer hashes while it
  writes (two threads), so its wall time per block is less than the sum of the steps.

``--resume-blocks N`` then builds a run with N committed blocks (real commits, small block files) and times a
resume of it: from calling ``extract`` to its first new block committed.

Medians over ``--rounds``. Needs about 2 x ``--tokens`` x 32 KiB of free disk at 8B shapes (runs are removed).

    .venv/bin/python benchmarks/data_plane.py                         # both shapes, file:// and S3
    .venv/bin/python benchmarks/data_plane.py --shapes llama --storage file --rounds 1 --tokens 16384
    .venv/bin/python benchmarks/data_plane.py --shapes llama --storage file --rounds 0 --resume-blocks 10000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"llama": ("configs/llama-3.1-8b-instruct.yaml", "Llama-3.1-8B-Instruct"),
          "kimi": ("configs/kimi-k2.5.yaml", "Kimi-K2.5")}
GB = 1e9


def cpu_seconds() -> float:
    """CPU seconds used so far by the whole machine (user + system + nice, every process)."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.system + t.nice


def cpu_by_process() -> dict[str, float]:
    """CPU seconds so far of every process, keyed by a short role name (pid:name; Ray workers by their title)."""
    import psutil

    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        try:
            t = p.info["cpu_times"]
            cmd = " ".join(p.info["cmdline"] or [])[:80]
            role = cmd.split(" ")[0].rsplit("/", 1)[-1] if cmd else p.info["name"]
            if cmd.startswith("ray::"):
                role = cmd.split(" ")[0]
            elif "moto.server" in cmd:
                role = "s3-server(moto)"
            elif p.info["pid"] == os.getpid():
                role = "driver"
            out[f"{p.info['pid']}:{role}"] = t.user + t.system
        except (psutil.NoSuchProcess, TypeError):
            continue
    return out


def roles(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds between two :func:`cpu_by_process` snapshots, summed per role (pid dropped)."""
    out: dict[str, float] = {}
    for k, v in after.items():
        d = v - before.get(k, 0.0)
        if d > 0.005:
            role = k.split(":", 1)[1]
            out[role] = out.get(role, 0.0) + d
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def driver_uss_gb() -> float:
    """This process's private memory (USS, GB): the object store's shared pages it has touched are not counted."""
    import psutil

    return psutil.Process().memory_full_info().uss / GB


def machine_line() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                  .stdout.splitlines() if ln.startswith("Model name")), "?")
    amx = "amx_bf16" in Path("/proc/cpuinfo").read_text()
    return f"machine: lscpu model name {model!r}, amx_bf16 {'yes' if amx else 'no'}, {os.cpu_count()} CPUs"


def start_s3() -> tuple[subprocess.Popen, str]:
    """moto's S3 server as its own process on 127.0.0.1 (so its CPU is the storage's, not this driver's)."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except Exception:
            time.sleep(0.2)
    import boto3

    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="bench")
    return proc, url


def config(shape: str, storage_uri: str, endpoint: str | None, name: str, unit_tokens: int, writer: str,
           compression: str, writers: int = 1):
    from eagle3ray.config import load_config

    path, folder = SHAPES[shape]
    over = [f"verifier.model={ROOT}/configs/verifiers/{folder}", "verifier.engine=stand_in", "verifier.device=cpu",
            "verifier.tensor_parallel_size=1", "verifier.trust_remote_code=false", "verifier.num_cpus=0.5",
            f"extract.max_tokens_per_batch={unit_tokens}", "extract.min_replicas=1", "extract.max_replicas=1",
            f"extract.block_writer={writer}", f"extract.writers_per_replica={writers}",
            f"extract.compression={compression}", "extract.storage_dtype=bfloat16",
            "extract.audit_samples=0", f"run.storage={storage_uri}", f"run.name={name}", "ray.num_cpus=4",
            "ray.address=null"]
    if endpoint:
        over.append(f"run.endpoint_url={endpoint}")
    return load_config(str(ROOT / path), over)


def write_conversations(cfg, n: int, tokens: int, seed: int = 0) -> None:
    """A complete conversations artifact of ``n`` synthetic samples of ``tokens`` random ids each (what prepare
    would leave; extraction only reads ids and loss masks)."""
    import hashlib

    import numpy as np
    import pyarrow as pa

    from eagle3ray import storage
    from eagle3ray.artifacts import CONV_SCHEMA
    from eagle3ray.verifier import VerifierSpec

    vocab = VerifierSpec.from_config(cfg).model_identity["vocab_size"]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(n, tokens), dtype=np.int32)
    mask = np.zeros((n, tokens), dtype=np.int8)
    mask[:, tokens // 4:] = 1
    table = pa.table({"sample_id": [f"bench:{i}" for i in range(n)], "source": ["bench"] * n,
                      "input_ids": list(ids), "loss_mask": list(mask), "num_tokens": [tokens] * n},
                     schema=CONV_SCHEMA)
    paths = storage.run_paths(cfg)
    buf = storage.parquet_bytes(table, "zstd")
    storage.write_bytes_atomic(paths.fs, f"{paths.conversations}/conversations.parquet", buf)
    storage.write_json_atomic(paths.fs, f"{paths.conversations}/manifest.json", {
        "schema_version": 1, "kind": "eagle3ray.conversations", "complete": True, "file": "conversations.parquet",
        "sha256": hashlib.sha256(buf).hexdigest(), "bytes": len(buf),
        "counts": {"samples": n, "tokens": n * tokens, "loss_tokens": int(mask.sum())}, "rejected": {}})


def remove_run(cfg) -> None:
    from eagle3ray import storage

    paths = storage.run_paths(cfg)
    if paths.fs.exists(paths.root):
        paths.fs.rm(paths.root, recursive=True)


def pipeline_round(cfg, raw_bpt: int) -> dict:
    """One extraction of the run's conversations; figures between the first and the last commit."""
    from eagle3ray.extract import extract

    marks: list[tuple[float, float, int, int, int]] = []
    procs: list[dict[str, float]] = []

    def on_commit(data: dict) -> None:
        c = data["counts"]
        marks.append((time.perf_counter(), cpu_seconds(), c["tokens"], c["bytes"], len(data["blocks"])))
        procs.append(cpu_by_process())

    t0 = time.perf_counter()
    extract(cfg, on_commit=on_commit, progress=False)
    wall = time.perf_counter() - t0
    (ta, ca, ka, ba, _), (tb, cb, kb, bb, nb) = marks[0], marks[-1]
    dt, tokens, nbytes = tb - ta, kb - ka, bb - ba
    idle = idle_cpu_rate()
    gb = tokens * raw_bpt / GB
    return {"tok_s": tokens / dt, "mb_s": nbytes / dt / 1e6, "raw_gb_s": gb / dt,
            "cpu_s_per_gb": (cb - ca) / gb, "cpu_s_per_gb_over_idle": (cb - ca - idle * dt) / gb, "idle_cores": idle,
            "by_process_s_per_gb": {k: v / gb for k, v in roles(procs[0], procs[-1]).items()},
            "stored_ratio": nbytes / (tokens * raw_bpt), "blocks": nb, "window_blocks": len(marks) - 1,
            "wall": wall}


def idle_cpu_rate(seconds: float = 3.0) -> float:
    """Cores the machine keeps busy with nothing extracting (Ray's own processes, the S3 server): measured over
    ``seconds`` right after a round, and taken off the pipeline's CPU in ``cpu_s_per_gb_over_idle``."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds() - c0) / (time.perf_counter() - t0)


def bare_write_round(cfg, nblocks: int, raw_bpt: int) -> dict:
    """The run's largest committed block file (a full unit, not the smaller probe unit that comes first) written
    ``nblocks`` times by a plain loop (same storage, same write)."""
    from eagle3ray import blocks, storage

    paths = storage.run_paths(cfg)
    man, files = blocks.read_committed(paths.fs, paths.hidden_states)
    k = max(range(len(files)), key=lambda i: man["blocks"][i]["bytes"])
    with paths.fs.open(files[k], "rb") as f:
        buf = f.read()
    raw_gb = nblocks * man["blocks"][k]["tokens"] * raw_bpt / GB
    c0, t0 = cpu_seconds(), time.perf_counter()
    for i in range(nblocks):
        storage.write_bytes_atomic(paths.fs, f"{paths.root}/bare/part-{i:05d}.parquet", buf)
    dt = time.perf_counter() - t0
    return {"mb_s": nblocks * len(buf) / dt / 1e6, "cpu_s_per_gb": (cpu_seconds() - c0) / raw_gb,
            "block_mb": len(buf) / 1e6}


def steps_alone(cfg, unit_tokens: int, raw_bpt: int, rounds: int) -> dict:
    """CPU seconds per GB of raw bf16 states of each step on one unit, each measured alone (medians)."""
    import torch

    from eagle3ray import blocks, storage
    from eagle3ray.verifier import StandInEngine, VerifierSpec
    from eagle3ray.verifier_service import start_for_config

    spec = VerifierSpec.from_config(cfg)
    L, H = len(spec.layer_ids), spec.model_identity["hidden_size"]
    per = 1024
    samples = [{"sample_id": f"u{i}", "input_ids": list(range(i * per, (i + 1) * per)), "loss_mask": [1] * per}
               for i in range(max(1, unit_tokens // per))]
    gb = len(samples) * per * raw_bpt / GB
    paths = storage.run_paths(cfg)
    engine = StandInEngine(spec)
    handle = start_for_config(cfg)
    req = [{"sample_id": s["sample_id"], "input_ids": s["input_ids"]} for s in samples]
    out: dict[str, list[float]] = {k: [] for k in ("produce", "encode", "transfer", "table", "compress", "sha256",
                                                     "write", "commit")}
    StandInEngine.states_bf16(samples[0]["input_ids"], L, H)  # the table is built once per process
    scratch = blocks.BlockScratch()  # the writer's reused buffers (blocks.write_unit_block)
    for r in range(rounds):
        t = time.process_time()
        states = [StandInEngine.states_bf16(s["input_ids"], L, H) for s in samples]
        out["produce"].append(time.process_time() - t)
        t = time.process_time()
        [blocks.to_storage_array(x, "bfloat16") for x in states]
        out["encode"].append(time.process_time() - t)
        del states
        c = cpu_seconds()
        engine.extract(req, "bfloat16")
        inproc = cpu_seconds() - c
        c = cpu_seconds()
        results = handle.extract.remote(req, "bfloat16").result()
        out["transfer"].append(max(0.0, (cpu_seconds() - c) - inproc))
        t = time.process_time()  # table, compress: into the reused buffers, as the block writer does
        table = blocks.build_block(samples, results, "bfloat16", scratch)
        out["table"].append(time.process_time() - t)
        del results
        t = time.process_time()
        buf = storage.parquet_view(table, cfg.extract.compression,
                                   scratch.buffer("file", storage.parquet_size_bound(table)),
                                   **blocks.BLOCK_PARQUET_OPTIONS)
        out["compress"].append(time.process_time() - t)
        del table
        t = time.process_time()
        hashlib.sha256(buf).hexdigest()
        out["sha256"].append(time.process_time() - t)
        t = time.process_time()
        storage.write_bytes_atomic(paths.fs, f"{paths.root}/steps/part-{r}.parquet", buf)
        out["write"].append(time.process_time() - t)
        man = blocks.Manifest(paths.fs, f"{paths.root}/steps/hs-{r}", blocks.new_manifest(
            {"config_hash": "c"}, spec.layer_ids, "bfloat16", {"sha256": "s", "samples": 1}))
        man.data["rejected"] = {"prepare": {}, "extract": {}}
        t = time.process_time()
        man.commit({"path": f"blocks/p{r}", "rows": len(samples), "tokens": len(samples) * per,
                    "bytes": len(buf), "sha256": "0" * 64}, [f"{r}:{s['sample_id']}" for s in samples], {})
        out["commit"].append(time.process_time() - t)
    med = {k: statistics.median(v) / gb for k, v in out.items()}
    med["produce_tok_s"] = len(samples) * per / statistics.median(out["produce"])
    remove = f"{paths.root}/steps"
    if paths.fs.exists(remove):
        paths.fs.rm(remove, recursive=True)
    return med


def resume_bench(shape: str, storage_uri: str, endpoint: str | None, nblocks: int, unit_tokens: int) -> dict:
    """A run with ``nblocks`` committed blocks (8 samples each; real commits of 64-byte files, which a resume checks
    by size only), then ``extract`` resumed on it with 8 more samples to do: seconds from the call to its first
    new commit (the stage is stopped there, before anything would read the fake files)."""
    from eagle3ray import blocks, storage
    from eagle3ray.extract import extract
    from eagle3ray.verifier import VerifierSpec

    cfg = config(shape, storage_uri, endpoint, f"resume-{nblocks}", unit_tokens, "data_actor", "zstd")
    remove_run(cfg)
    per_block, tokens = 8, 16
    write_conversations(cfg, nblocks * per_block + per_block, tokens)
    spec = VerifierSpec.from_config(cfg)
    paths = storage.run_paths(cfg)
    conv = storage.read_json(paths.fs, f"{paths.conversations}/manifest.json")
    fresh = blocks.new_manifest({**spec.model_identity, "compute_dtype": spec.dtype}, spec.layer_ids, "bfloat16",
                                {"sha256": conv["sha256"], "samples": conv["counts"]["samples"]})
    man = blocks.Manifest(paths.fs, paths.hidden_states, fresh)
    man.set_rejected({}, {})
    t0 = time.perf_counter()
    for b in range(nblocks):
        rel = f"blocks/part-{b:08d}.parquet"
        storage.write_bytes_atomic(paths.fs, f"{paths.hidden_states}/{rel}", b"x" * 64)
        ids = [f"bench:{b * per_block + j}" for j in range(per_block)]
        man.commit({"path": rel, "rows": per_block, "tokens": per_block * tokens, "bytes": 64, "sha256": "0" * 64},
                   ids, {})
    built = time.perf_counter() - t0
    first: list[float] = []

    class _FirstCommit(Exception):
        pass

    def on_commit(data: dict) -> None:
        first.append(time.perf_counter())
        raise _FirstCommit  # measured: stop the stage here (the fake committed files are never read)

    import logging

    marks: list[str] = []

    class _Marks(logging.Handler):
        def emit(self, record):
            marks.append(f"{time.perf_counter() - t0:.2f} s: {record.getMessage()}")

    log = logging.getLogger("eagle3ray.extract")
    handler, level = _Marks(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        extract(cfg, on_commit=on_commit, progress=False)
    except _FirstCommit:
        pass
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    out = {"blocks": nblocks, "build_s": built, "first_new_commit_s": first[0] - t0, "stage_log": marks}
    remove_run(cfg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama,kimi")
    ap.add_argument("--storage", default="file,s3")
    ap.add_argument("--variants", default="data_actor:1,data_actor:2,replica:1",
                    help="extract.block_writer:extract.writers_per_replica pairs")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens extracted per round and shape")
    ap.add_argument("--unit-tokens", type=int, default=8192, help="extract.max_tokens_per_batch")
    ap.add_argument("--sample-tokens", type=int, default=1024)
    ap.add_argument("--compression", default="zstd")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--resume-blocks", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="folder for file:// runs (default: a temp folder)")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import pyarrow
    import ray

    from eagle3ray import blocks
    from eagle3ray.machine import ensure_ray
    from eagle3ray.verifier import VerifierSpec
    from eagle3ray.verifier_service import stop_verifier

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="e3r-dataplane-"))
    s3 = None
    stores = {}
    for st in args.storage.split(","):
        if st == "file":
            stores["file"] = (f"file://{workdir}", None)
        elif st == "s3":
            s3 = s3 or start_s3()
            stores["s3"] = ("s3://bench/runs", s3[1])
    print(machine_line() + f"; pyarrow {pyarrow.__version__}, ray {ray.__version__}", flush=True)
    print(f"{args.tokens:,} tokens per round ({args.sample_tokens}-token samples, {args.unit_tokens:,}-token units), "
          f"bf16 states, Parquet {args.compression}; medians of {args.rounds} rounds after a warm-up", flush=True)
    report = {"machine": machine_line(), "args": vars(args), "results": []}
    try:
        for shape in args.shapes.split(","):
            for st, (uri, endpoint) in stores.items():
                for variant in args.variants.split(","):
                    if args.rounds <= 0:
                        continue
                    writer, nw = variant.split(":")
                    cfg = config(shape, uri, endpoint, f"dp-{shape}-{writer}-{nw}", args.unit_tokens, writer,
                                 args.compression, int(nw))
                    ensure_ray(cfg)
                    spec = VerifierSpec.from_config(cfg)
                    L, H = len(spec.layer_ids), spec.model_identity["hidden_size"]
                    raw_bpt = blocks.bytes_per_token(L, H, "bfloat16")
                    remove_run(cfg)
                    write_conversations(cfg, max(1, args.unit_tokens // args.sample_tokens), args.sample_tokens)
                    pipeline_round(cfg, raw_bpt) if args.unit_tokens // args.sample_tokens > 1 else None
                    remove_run(cfg)
                    pipe, bare = [], []
                    for r in range(args.rounds):
                        write_conversations(cfg, args.tokens // args.sample_tokens, args.sample_tokens, seed=r + 1)
                        p = pipeline_round(cfg, raw_bpt)
                        b = bare_write_round(cfg, p["blocks"], raw_bpt)
                        remove_run(cfg)
                        pipe.append(p)
                        bare.append(b)
                        print(f"  {shape} {st} {variant} round {r}: pipeline {p['tok_s']:,.0f} tok/s "
                              f"{p['mb_s']:.0f} MB/s ({p['window_blocks']} blocks timed), bare write "
                              f"{b['mb_s']:.0f} MB/s; driver private memory {driver_uss_gb():.2f} GB; "
                              "CPU s/GB by process: "
                              + ", ".join(f"{k} {v:.2f}" for k, v in list(p["by_process_s_per_gb"].items())[:6]),
                              flush=True)
                    steps = steps_alone(cfg, args.unit_tokens, raw_bpt, max(args.rounds, 1))
                    remove_run(cfg)
                    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
                    row = {"shape": shape, "storage": st, "writer": writer, "writers_per_replica": int(nw), "layers_x_hidden": f"{L} x {H}",
                           "raw_bytes_per_token": raw_bpt, "pipeline_tok_s": med(pipe, "tok_s"),
                           "pipeline_mb_s": med(pipe, "mb_s"), "pipeline_raw_gb_s": med(pipe, "raw_gb_s"),
                           "pipeline_cpu_s_per_gb": med(pipe, "cpu_s_per_gb"),
                           "pipeline_cpu_s_per_gb_over_idle": med(pipe, "cpu_s_per_gb_over_idle"),
                           "idle_cores": med(pipe, "idle_cores"),
                           "stored_ratio": med(pipe, "stored_ratio"), "bare_mb_s": med(bare, "mb_s"),
                           "bare_cpu_s_per_gb": med(bare, "cpu_s_per_gb"), "steps_cpu_s_per_gb": steps}
                    row["ratio"] = row["pipeline_mb_s"] / row["bare_mb_s"]
                    report["results"].append(row)
                    s = steps
                    print(f"{shape} ({L} x {H}, {raw_bpt:,} B/token raw bf16) {st} block_writer={writer} x{nw}: pipeline "
                          f"{row['pipeline_tok_s']:,.0f} tok/s, {row['pipeline_mb_s']:.0f} MB/s committed "
                          f"({row['pipeline_raw_gb_s']:.2f} GB/s of raw states, stored {row['stored_ratio']:.2f}x "
                          f"raw), {row['pipeline_cpu_s_per_gb']:.2f} CPU s/GB (whole machine; "
                          f"{row['pipeline_cpu_s_per_gb_over_idle']:.2f} over its idle {row['idle_cores']:.2f} "
                          f"cores); bare write "
                          f"{row['bare_mb_s']:.0f} MB/s; pipeline / bare {row['ratio']:.2f}", flush=True)
                    print(f"    steps alone, CPU s per GB of raw states: produce {s['produce']:.2f} (stand-in: "
                          f"{s['produce_tok_s']:,.0f} tok/s), encode {s['encode']:.2f}, transfer "
                          f"{s['transfer']:.2f}, table {s['table']:.2f}, compress {s['compress']:.2f}, sha256 "
                          f"{s['sha256']:.2f}, write {s['write']:.2f}, commit {s['commit']:.4f}", flush=True)
                    stop_verifier(spec)
        if args.resume_blocks:
            for st, (uri, endpoint) in stores.items():
                shape = args.shapes.split(",")[0]
                cfg = config(shape, uri, endpoint, "resume", args.unit_tokens, "data_actor", args.compression)
                ensure_ray(cfg)
                r = resume_bench(shape, uri, endpoint, args.resume_blocks, args.unit_tokens)
                r["storage"] = st
                report["results"].append({"resume": r})
                print(f"resume {st}: a run with {r['blocks']:,} committed blocks (built in {r['build_s']:.1f} s): "
                      f"first new block committed {r['first_new_commit_s']:.2f} s after extract() was called; "
                      f"the stage's log: " + "; ".join(r["stage_log"]), flush=True)
    finally:
        if s3:
            s3[0].terminate()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
