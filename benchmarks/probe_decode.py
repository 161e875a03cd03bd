"""Benchmark: the plan probe's decode measurement with 32-token prompts (before) and 8-token prompts (now).

:func:`eagle3ray.plan.decode_rate` decodes ``batch`` prompts for 18 and for 2 tokens and divides 16 x batch tokens by
the difference. Both calls prefill every prompt (the verifier's engines run without prefix caching), so at
regeneration's batch of 256 the prompts' length is most of the measurement's cost. This runs the product's
functions (:func:`eagle3ray.plan.probe_prompts`, :func:`~eagle3ray.plan.probe_engine`,
:func:`~eagle3ray.plan.generation_timer`, :func:`~eagle3ray.plan.decode_rate`) on one engine, the two prompt
lengths alternating over ``--rounds``, at regeneration's batch (``verifier.max_num_seqs``) and validation's, and
prints per variant the median rate (tokens/s), the median wall seconds the measurement took, and the ratios.

    .venv/bin/python benchmarks/probe_decode.py                   # the embedded default config, 3 rounds
    .venv/bin/python benchmarks/probe_decode.py --rounds 5 --prompt-tokens 32,8
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None, help="run config (default: the embedded default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", default="32,8", help="prompt lengths to compare (the first is the reference)")
    ap.add_argument("overrides", nargs="*", help="config overrides (dotted key=value)")
    args = ap.parse_args()

    from eagle3ray import plan
    from eagle3ray.config import load_config
    from eagle3ray.machine import cpu_flags
    from eagle3ray.verifier import VerifierSpec

    cfg = load_config(args.config, args.overrides)
    spec = VerifierSpec.from_config(cfg)
    flags = cpu_flags()
    print(f"machine: {plan._cpu_model()}, amx_bf16 {'amx_bf16' in flags}, avx512_bf16 {'avx512_bf16' in flags}, "
          f"verifier dtype {cfg.verifier.dtype}", flush=True)
    prompts, _ = plan.probe_prompts(cfg, spec)
    eng = plan.probe_engine(cfg, spec)
    gen = plan.generation_timer(eng)
    gen(prompts[:4], 2)  # warm-up, as the probe does
    batches = {"regeneration": max(1, cfg.verifier.max_num_seqs),
               "validation": max(1, min(cfg.validation.max_num_seqs, cfg.validation.max_prompts))}
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    rates: dict = {}
    walls: dict = {}
    for r in range(args.rounds):
        for name, batch in batches.items():
            for n in (lengths if r % 2 == 0 else lengths[::-1]):  # alternate the order between rounds
                t = time.perf_counter()
                rate = plan.decode_rate(gen, prompts, batch, prompt_tokens=n)
                wall = time.perf_counter() - t
                rates.setdefault((name, n), []).append(rate)
                walls.setdefault((name, n), []).append(wall)
                print(f"round {r} {name:12s} batch {batch:3d} prompts of {n:2d} tokens: {rate:7.1f} tok/s, "
                      f"measured in {wall:5.1f} s", flush=True)
    ref = lengths[0]
    for name, batch in batches.items():
        for n in lengths:
            rate, wall = statistics.median(rates[(name, n)]), statistics.median(walls[(name, n)])
            r_rate = rate / statistics.median(rates[(name, ref)])
            r_wall = wall / statistics.median(walls[(name, ref)])
            print(f"median {name:12s} batch {batch:3d} prompts of {n:2d} tokens: {rate:7.1f} tok/s "
                  f"(x{r_rate:.2f} of {ref}), measured in {wall:5.1f} s (x{r_wall:.2f})")


if __name__ == "__main__":
    main()
