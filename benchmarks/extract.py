"""Benchmark: hidden-state extraction throughput, pipeline vs bare vLLM engine vs transformers.

Same samples (prepared once from the config), same token-budget batches, same engine settings:

1. pipeline: ``eagle3ray.extract.extract`` (Ray Serve verifier + Ray Data + Parquet blocks on storage
   + manifest commits), timed from the first unit sent to the last block committed, with the verifier
   already loaded (a fresh run directory each round); with the seconds the replica's engine spent in its
   extract calls (``VerifierEngine.info()["extract_seconds"]``), which split the gap to the bare engine into the
   engine running slower in the replica and the engine waiting for work;
   then ``service_direct``: the same units sent to the same service from this process one after another (no
   Ray Data, no blocks, no manifest);
2. bare engine: ``VerifierEngine.extract`` on the same batches in this process (vLLM prefill with
   hidden-state capture, no Ray, no storage);
3. transformers: ``AutoModelForCausalLM`` fp32 forward with ``output_hidden_states=True``, one sample
   per forward (no padding waste).

Prints tokens/s per round, medians, and the ratio pipeline/bare (target >= 0.95). The process re-executes itself
with the CPU engines' preload (``eagle3ray.machine.cpu_engine_env``: tcmalloc) so that the bare engine runs with
the same allocator as the pipeline's replica.

    .venv/bin/python benchmarks/extract.py                      # 32 ShareGPT samples, 3 rounds
    .venv/bin/python benchmarks/extract.py --samples 64 --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None, help="run config (default: the embedded default)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--pipeline-variants", default="",
                    help="pipeline variants compared round by round in this one process, '|'-separated override sets "
                         "(e.g. 'extract.writers_per_replica=1|extract.writers_per_replica=2'); each round runs every variant")
    ap.add_argument("overrides", nargs="*", help="config overrides (dotted key=value), e.g. extract.writers_per_replica=2")
    args = ap.parse_args()

    import os
    import sys

    from eagle3ray.machine import cpu_engine_env

    # the pipeline's replica starts with tcmalloc preloaded (cpu_engine_env): so do this process's bare engine and
    # transformers forward, or the ratio would compare allocators (empty when already preloaded or not installed)
    env = cpu_engine_env("cpu")
    if env:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
    print(f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}", flush=True)

    import ray
    from ray import serve

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from data_plane import cpu_by_process, roles  # CPU seconds per process role (psutil)

    def top(cpu: dict[str, float], n: int = 6) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in list(cpu.items())[:n])

    from eagle3ray import storage
    from eagle3ray.config import load_config
    from eagle3ray.extract import extract, plan_units
    from eagle3ray.artifacts import read_conversations
    from eagle3ray.prepare import prepare
    from eagle3ray.machine import ensure_ray
    from eagle3ray.verifier_service import get_or_start_verifier
    from eagle3ray.verifier import VerifierEngine, VerifierSpec

    tmp = tempfile.mkdtemp(prefix="e3r-bench-")
    base = [*args.overrides, f"data.max_samples={args.samples}", f"run.storage=file://{tmp}", "run.name=bench-prep"]
    cfg = load_config(args.config, base)
    prepare(cfg)
    _, conv = read_conversations(storage.run_paths(cfg))
    samples = [{"sample_id": s, "input_ids": i, "loss_mask": m}
               for s, i, m in zip(conv["sample_id"].to_pylist(), conv["input_ids"].to_pylist(),
                                  conv["loss_mask"].to_pylist()) if len(i) <= cfg.verifier.max_model_len]
    units = plan_units(samples, cfg.extract.max_tokens_per_batch)
    tokens = sum(len(s["input_ids"]) for s in samples)
    print(f"samples={len(samples)} tokens={tokens} batches={len(units)} "
          f"max_tokens_per_batch={cfg.extract.max_tokens_per_batch} dtype={cfg.verifier.dtype} "
          f"storage_dtype={cfg.extract.storage_dtype}", flush=True)
    results: dict[str, list[float]] = {"pipeline": [], "bare_engine": [], "transformers": []}

    # 1. pipeline (verifier service loaded once, before timing)
    spec = VerifierSpec.from_config(cfg)
    ensure_ray(cfg)
    t = time.time()
    handle = get_or_start_verifier(spec, 1, 1, cfg.verifier.num_cpus)
    print(f"verifier service start: {time.time() - t:.1f} s", flush=True)
    busy: list[float] = []  # per round: seconds the replica's engine spent in extract calls
    variants = [v.split() for v in args.pipeline_variants.split("|")] if args.pipeline_variants else [[]]
    by_variant: dict[str, list[float]] = {" ".join(v) or "pipeline": [] for v in variants}
    for r, (vi, var) in ((r, v) for r in range(args.rounds) for v in enumerate(variants)):
        name = " ".join(var) or "pipeline"
        rcfg = load_config(args.config, base[:-1] + var + [f"run.name=bench-pipeline-{r}-{vi}"])
        # reuse the prepared conversations: copy them into the round's run directory
        src, dst = storage.run_paths(cfg), storage.run_paths(rcfg)
        src.fs.copy(src.conversations, dst.conversations, recursive=True)
        before, cpu0 = handle.info.remote().result()["extract_seconds"], cpu_by_process()
        s = extract(rcfg, progress=False)
        cpu = roles(cpu0, cpu_by_process())
        busy.append(handle.info.remote().result()["extract_seconds"] - before)
        assert s.tokens == tokens, (s.tokens, tokens)
        results["pipeline"].append(s.tokens / s.seconds)
        by_variant[name].append(s.tokens / s.seconds)
        print(f"{name} round {r}: {s.tokens / s.seconds:.0f} tok/s ({s.seconds:.1f} s, {s.blocks} blocks, "
              f"{s.bytes_written / 1e6:.0f} MB); the replica's engine in extract calls {busy[-1]:.1f} s "
              f"({tokens / busy[-1]:.0f} tok/s while busy, busy {busy[-1] / s.seconds:.0%} of the round)\n"
              f"  CPU s by process: {top(cpu)}", flush=True)
    # 1b. the same service called directly from this process, unit after unit (no Ray Data, no blocks, no
    # manifest): what the replica's engine does when nothing else of the pipeline runs beside it
    results["service_direct"] = []
    for r in range(args.rounds):
        before, cpu0 = handle.info.remote().result()["extract_seconds"], cpu_by_process()
        t = time.time()
        for u in units:
            handle.extract.remote([{"sample_id": s["sample_id"], "input_ids": s["input_ids"]} for s in u],
                                  cfg.extract.storage_dtype).result()
        dt = time.time() - t
        cpu = roles(cpu0, cpu_by_process())
        b = handle.info.remote().result()["extract_seconds"] - before
        results["service_direct"].append(tokens / dt)
        print(f"service direct round {r}: {tokens / dt:.0f} tok/s ({dt:.1f} s); the engine in extract calls {b:.1f} s "
              f"({tokens / b:.0f} tok/s while busy)\n  CPU s by process: {top(cpu)}", flush=True)
    serve.shutdown()
    ray.shutdown()
    gc.collect()

    # 2. bare engine, same settings and batches
    engine = VerifierEngine(spec)
    for r in range(args.rounds):
        t = time.time()
        for u in units:
            engine.extract([{"sample_id": s["sample_id"], "input_ids": s["input_ids"]} for s in u],
                           cfg.extract.storage_dtype)
        dt = time.time() - t
        results["bare_engine"].append(tokens / dt)
        print(f"bare engine round {r}: {tokens / dt:.0f} tok/s ({dt:.1f} s)", flush=True)
    del engine
    gc.collect()

    # 3. transformers forward
    if not args.skip_transformers:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=getattr(torch, cfg.verifier.dtype)).eval()
        for r in range(args.rounds):
            t = time.time()
            with torch.no_grad():
                for s in samples:
                    out = model(torch.tensor([s["input_ids"]]), output_hidden_states=True)
                    _ = torch.stack([out.hidden_states[i] for i in spec.layer_ids[:-1]], dim=2).to(torch.bfloat16)
            dt = time.time() - t
            results["transformers"].append(tokens / dt)
            print(f"transformers round {r}: {tokens / dt:.0f} tok/s ({dt:.1f} s)", flush=True)

    if len(variants) > 1:
        print("\nmedian tokens/s by pipeline variant: " + ", ".join(f"{k} {statistics.median(v):.0f}"
                                                                    for k, v in by_variant.items()))
    med = {k: statistics.median(v) for k, v in results.items() if v}
    print("\nmedian tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))
    print(f"ratio pipeline/bare_engine: {med['pipeline'] / med['bare_engine']:.2f} (target >= 0.95)")
    if busy:  # where the gap is: the engine slower inside the replica, or the engine waiting for work
        eng = tokens / statistics.median(busy)
        print(f"the replica's engine while busy: {eng:.0f} tok/s ({eng / med['bare_engine']:.2f} of the bare engine); "
              f"busy {statistics.median(busy) * med['pipeline'] / tokens:.0%} of the pipeline's round (median)")
    if "transformers" in med:
        print(f"ratio pipeline/transformers: {med['pipeline'] / med['transformers']:.2f}")


if __name__ == "__main__":
    main()
