"""Benchmark: one draft-training step with AdamW, with Muon as eagle3ray runs it, and with torch's own bf16 Muon.

The plan's probe step (:func:`eagle3ray.plan._probe_train_step`: :class:`eagle3ray.train_worker.DraftStep` on
packed synthetic states of the config's verifier shapes, median of 4 steps after 2 warm-up steps), in one process,
side by side:

- ``adamw``: ``train.optimizer=adamw``;
- ``muon``: ``train.optimizer=muon`` as the product runs it (on a CPU without AMX-BF16 its Newton-Schulz iteration
  runs in float32: :func:`eagle3ray.train_worker.use_fp32_newton_schulz_on_slow_bf16_cpus`);
- ``muon-torch-bf16``: the same with torch's own ``_zeropower_via_newtonschulz`` (bf16) put back.

Prints each median step and its ratio to ``adamw``, with the machine (``lscpu`` model name, ``amx_bf16``).

    .venv/bin/python benchmarks/muon_step.py                       # the embedded default config
    .venv/bin/python benchmarks/muon_step.py -c configs/smollm2-135m-cpu.yaml --variants adamw,muon
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--config", default=None, help="run config (default: the embedded default)")
    ap.add_argument("--variants", default="adamw,muon,muon-torch-bf16")
    ap.add_argument("overrides", nargs="*", help="config overrides (dotted key=value)")
    args = ap.parse_args()

    from torch.optim import _muon

    from eagle3ray import plan, train_worker
    from eagle3ray.config import load_config
    from eagle3ray.machine import cpu_bf16_is_fast
    from eagle3ray.verifier import VerifierSpec

    print(f"machine: {plan._cpu_model()}, amx_bf16 {'yes' if cpu_bf16_is_fast() else 'no'}", flush=True)
    out = {}
    for variant in args.variants.split(","):
        cfg = load_config(args.config, [*args.overrides, f"train.optimizer={variant.split('-')[0]}"])
        spec = VerifierSpec.from_config(cfg)
        if variant == "muon-torch-bf16":
            train_worker.use_fp32_newton_schulz_on_slow_bf16_cpus()  # wrap (if not yet), then put torch's back
            wrapped = _muon._zeropower_via_newtonschulz
            train_worker.use_fp32_newton_schulz_on_slow_bf16_cpus = lambda: None  # build_optimizers must not rewrap
            _muon._zeropower_via_newtonschulz = wrapped.torch_newton_schulz
        t = time.perf_counter()
        out[variant] = plan._probe_train_step(cfg, spec, 60.0)
        print(f"{variant:16s} median step {out[variant]:.2f} s (the variant took {time.perf_counter() - t:.0f} s)",
              flush=True)
    if "adamw" in out:
        print("ratio to adamw: " + ", ".join(f"{k} {v / out['adamw']:.2f}x" for k, v in out.items()))


if __name__ == "__main__":
    main()
