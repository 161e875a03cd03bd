"""GPU check of the draft-training step (the code path that CPU CI cannot run).

Runs eagle3ray's worker-side pieces on CUDA exactly as a GPU Ray Train worker does: the worker's step object
(:class:`eagle3ray.train_worker.DraftStep`: speculators' Eagle3DraftModel, AdamW, clipping, LR schedule) with
``attn_impl=simple_flex_attention``, the fused (Triton) loss, bf16 autocast, blocks encoded with eagle3ray's bf16
storage format, ``row_to_sample`` + ``pack_rows`` + speculators' ``CollateFn``. The verifier is a random model with SmolLM2-135M's shapes (no weights
are downloaded). Prints per-check results and throughput; exits non-zero if a check fails.

    python benchmarks/gpu_draft_step.py --steps 30

On a lent device machine (PyTorch/transformers/pyarrow/fsspec present, no speculators), carry py3.12
wheels of: speculators==0.9.0 and what importing it needs there: pydantic==2.14.4 pydantic_core==2.50.5
annotated-types typing-inspection typing_extensions pydantic-settings python-dotenv datasets==5.1.0
dill multiprocess openai jiter distro sniffio hs-connectors==0.9.0 loguru (about 7 MB); install them
with ``pip install --no-deps --target /tmp/site`` and put /tmp/site and the repo on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=8192, help="packed tokens per step")
    args = ap.parse_args()

    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3ray.blocks import to_storage_bytes
    from eagle3ray.train_worker import DraftStep, pack_rows, row_to_sample, summarize

    assert torch.cuda.is_available(), "no CUDA device"
    dev = torch.device("cuda")
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
    tmp = tempfile.mkdtemp()
    torch.manual_seed(0)
    vcfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                       tie_word_embeddings=True, rms_norm_eps=1e-5)
    verifier = LlamaForCausalLM(vcfg).to(dev, torch.bfloat16).eval()
    verifier.save_pretrained(tmp)
    layer_ids = [2, 15, 27, 30]
    # Blocks as extract writes them: states of the aux layers + final pre-norm, bf16 bytes.
    rows = []
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i in range(48):
            T = int(torch.randint(200, 900, (1,), generator=g))
            ids = torch.randint(0, 8192, (1, T), generator=g).to(dev)
            cap = {}
            h = verifier.model.layers[-1].register_forward_hook(lambda m, i_, o: cap.__setitem__("pre", o[0] if
                                                                                                 isinstance(o, tuple) else o))
            out = verifier(ids, output_hidden_states=True)
            h.remove()
            st = torch.stack([out.hidden_states[2][0], out.hidden_states[15][0], out.hidden_states[27][0],
                              cap["pre"][0]], dim=1).float().cpu()
            rows.append({"sample_id": f"s{i}", "input_ids": ids[0].tolist(), "loss_mask": [0] * 20 + [1] * (T - 20),
                         "hidden_states": to_storage_bytes(st, "bfloat16"), "seq_len": T, "num_layers": 4,
                         "hidden_size": 576, "hs_dtype": "bfloat16"})
    del verifier
    torch.cuda.empty_cache()
    d2t = torch.zeros(8192, dtype=torch.long)
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[:8192] = True
    ok = True
    results = {}
    for attn, loss_impl in (("simple_flex_attention", "fused"), ("sdpa", "eager")):
        # the train section as the driver hands it to workers (no config module needed on the device machine)
        tc = {"num_draft_layers": 1, "draft_head_dim": None, "norm_before_residual": True, "norm_before_fc": True,
              "norm_output": True, "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "attn_impl": attn,
              "loss": "kl_div", "loss_impl": loss_impl, "lr": 1e-3, "weight_decay": 0.0, "warmup_steps": 0,
              "max_steps": args.steps, "min_lr_ratio": 1.0, "grad_clip": 1.0, "hidden_noise": 0.0,
              "max_tokens_per_batch": args.tokens}
        torch.manual_seed(0)
        step_obj = DraftStep.build(tc, tmp, layer_ids[:-1], d2t, t2d, 576, autocast_bf16=True)
        step_obj.to_device(dev)
        step_obj.model.train()

        def stream():
            while True:
                for r in rows:
                    yield r["sample_id"], row_to_sample(r)

        losses, times, toks = [], [], 0
        for step, group in enumerate(pack_rows(stream(), args.tokens)):
            if step >= args.steps:
                break
            batch = step_obj.collate([s for _, s in group])
            torch.cuda.synchronize()
            t = time.time()
            metrics = step_obj.step(batch)
            torch.cuda.synchronize()
            if step >= 3:
                times.append(time.time() - t)
                toks += int((batch["document_ids"] >= 0).sum())
            losses.append(summarize({k: float(v) for k, v in metrics.items()}, 3, "")["loss"])
        finite = all(np.isfinite(losses))
        dropped = losses[-1] < losses[0]
        acc0 = float(metrics["full_acc_0_sum"] / metrics["full_acc_0_total"])
        tps = toks / sum(times)
        print(f"{attn:22s} loss={loss_impl:5s}: loss {losses[0]:.4f} -> {losses[-1]:.4f} finite={finite} "
              f"acc0 {acc0:.3f} {tps:,.0f} tok/s ({args.tokens} tokens/step, median step "
              f"{np.median(times) * 1e3:.1f} ms) peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB",
              flush=True)
        results[attn] = (losses[0], losses[-1])
        ok &= finite and dropped
        del step_obj
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    first = [v[0] for v in results.values()]
    print(f"initial loss flex+fused vs sdpa+eager (same init, same batch): {first[0]:.5f} vs {first[1]:.5f}")
    ok &= abs(first[0] - first[1]) <= 0.02 * max(abs(first[1]), 1e-6) + 1e-3
    print("GPU draft step:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
