"""Benchmark: hidden-state extraction throughput, pipeline vs bare vLLM engine vs transformers.

Same samples (prepared once from the config), same token-budget batches, same engine settings:

1. pipeline: ``eagle3ray.extract.extract`` (Ray Serve verifier + Ray Data + Parquet blocks on storage
   + manifest commits), timed from the first unit sent to the last block committed, with the verifier
   already loaded (a fresh run directory each round);
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
    get_or_start_verifier(spec, 1, 1, cfg.verifier.num_cpus)
    print(f"verifier service start: {time.time() - t:.1f} s", flush=True)
    for r in range(args.rounds):
        rcfg = load_config(args.config, base[:-1] + [f"run.name=bench-pipeline-{r}"])
        # reuse the prepared conversations: copy them into the round's run directory
        src, dst = storage.run_paths(cfg), storage.run_paths(rcfg)
        src.fs.copy(src.conversations, dst.conversations, recursive=True)
        s = extract(rcfg, progress=False)
        assert s.tokens == tokens, (s.tokens, tokens)
        results["pipeline"].append(s.tokens / s.seconds)
        print(f"pipeline round {r}: {s.tokens / s.seconds:.0f} tok/s ({s.seconds:.1f} s, {s.blocks} blocks, "
              f"{s.bytes_written / 1e6:.0f} MB)", flush=True)
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

    med = {k: statistics.median(v) for k, v in results.items() if v}
    print("\nmedian tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in med.items()))
    print(f"ratio pipeline/bare_engine: {med['pipeline'] / med['bare_engine']:.2f} (target >= 0.95)")
    if "transformers" in med:
        print(f"ratio pipeline/transformers: {med['pipeline'] / med['transformers']:.2f}")


if __name__ == "__main__":
    main()
