"""GPU check of the draft-training step (the code path that CPU CI cannot run), with its throughput.

Runs eagle3ray's worker-side pieces exactly as a GPU Ray Train worker does: the worker's step object
(:class:`eagle3ray.train_worker.DraftStep`: speculators' Eagle3DraftModel, the configured optimizers (AdamW, or
speculators' Muon + AdamW split), clipping, LR schedule) with ``attn_impl=simple_flex_attention``, the fused (Triton)
loss, bf16 autocast, blocks encoded with eagle3ray's bf16 storage format, ``row_to_sample`` + ``pack_rows`` +
speculators' ``CollateFn``. Two verifier shapes:

- ``smollm2``: a random model with SmolLM2-135M's shapes (hidden 576, vocab 49152, draft vocabulary 8192); its
  states come from the random verifier's own forward (aux layers 2/15/27 + the last layer's pre-norm output).
  Checks: the loss is finite and falls with flex+fused and with sdpa+eager, and both give the same first loss on
  the same initial weights and batch (within 2%).
- ``llama8b``: Llama-3.1-8B-Instruct's shapes (``configs/verifiers/Llama-3.1-8B-Instruct``: hidden 4096, vocab
  128256, draft vocabulary 32000 as ``configs/llama-3.1-8b-instruct.yaml``), a one-layer random verifier for the
  draft's embeddings/lm_head/norm and random states (timing only; the loss must be finite and fall).

Prints per variant: first/last loss, acceptance-proxy accuracy at TTT position 0, packed tokens/s (median step
over steps 4..N, the first steps compile), peak GPU memory. No weights are downloaded. Exits non-zero if a check
fails.

    python benchmarks/gpu_draft_step.py --steps 30                 # on a GPU
    python benchmarks/gpu_draft_step.py --device cpu --steps 4 --shapes smollm2 --tokens 1024   # smoke test here

On a lent device machine (PyTorch/transformers/pyarrow/fsspec present, no speculators), carry py3.12
wheels of: speculators==0.9.0 and what importing it needs there: pydantic==2.14.4 pydantic_core==2.50.5
annotated-types typing-inspection typing_extensions pydantic-settings python-dotenv datasets==5.1.0
dill multiprocess openai jiter distro sniffio hs-connectors==0.9.0 loguru (about 7 MB); install them
with ``pip install --no-deps --target /tmp/site`` and put /tmp/site and the repo on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def make_rows(shape: str, dev, tmp: str):
    """(verifier folder, rows as extract writes them, hidden size, draft vocabulary size) for one shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3ray.blocks import to_storage_bytes

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rows = []
    if shape == "smollm2":
        vcfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                           tie_word_embeddings=True, rms_norm_eps=1e-5)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        verifier = LlamaForCausalLM(vcfg).to(dev, dtype).eval()
        verifier.save_pretrained(tmp)
        vd, n = 8192, 48
        with torch.no_grad():
            for i in range(n):
                T = int(torch.randint(200, 900, (1,), generator=g))
                ids = torch.randint(0, vd, (1, T), generator=g).to(dev)
                cap = {}
                h = verifier.model.layers[-1].register_forward_hook(
                    lambda m, i_, o: cap.__setitem__("pre", o[0] if isinstance(o, tuple) else o))
                out = verifier(ids, output_hidden_states=True)
                h.remove()
                st = torch.stack([out.hidden_states[2][0], out.hidden_states[15][0], out.hidden_states[27][0],
                                  cap["pre"][0]], dim=1).float().cpu()  # shape: [T, 4, 576]
                rows.append(_row(i, ids[0].tolist(), st, to_storage_bytes))
        del verifier
        return tmp, rows, 576, vd
    cfg = json.loads((ROOT / "configs/verifiers/Llama-3.1-8B-Instruct/config.json").read_text())
    cfg["num_hidden_layers"] = 1  # the draft takes only embeddings, lm_head and norm from the verifier
    vcfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    verifier = LlamaForCausalLM(vcfg).to(torch.bfloat16)
    verifier.save_pretrained(tmp)
    del verifier
    # speculators checks the aux ids against the verifier's depth: the saved config keeps the real 32 layers
    pathlib.Path(tmp, "config.json").write_text(json.dumps(dict(
        json.loads(pathlib.Path(tmp, "config.json").read_text()), num_hidden_layers=32)))
    H, vd = cfg["hidden_size"], 32000
    for i in range(16):
        T = int(torch.randint(300, 1500, (1,), generator=g))
        ids = torch.randint(0, vd, (T,), generator=g).tolist()
        st = torch.randn(T, 4, H, generator=g)  # shape: [T, 4, 4096]; random states, timing only
        rows.append(_row(i, ids, st, to_storage_bytes))
    return tmp, rows, H, vd


def _row(i, ids, st, to_storage_bytes):
    T, L, H = st.shape
    return {"sample_id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 20 + [1] * (T - 20),
            "hidden_states": to_storage_bytes(st, "bfloat16"), "seq_len": T, "num_layers": L, "hidden_size": H,
            "hs_dtype": "bfloat16"}


def run_variant(name, tc, verifier_dir, rows, hidden, vd, vocab, dev, steps, tokens):
    """Train ``steps`` steps of one variant; returns (first loss, last loss, ok, printed line)."""
    import numpy as np
    import torch

    from eagle3ray.train_worker import DraftStep, pack_rows, row_to_sample, summarize

    d2t = torch.zeros(vd, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:vd] = True
    torch.manual_seed(0)
    step_obj = DraftStep.build(tc, verifier_dir, [2, 15, 27], d2t, t2d, hidden, autocast_bf16=dev.type == "cuda")
    step_obj.to_device(dev)
    step_obj.model.train()

    def stream():
        while True:
            for r in rows:
                yield r["sample_id"], row_to_sample(r)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    losses, times, toks = [], [], []
    for step, group in enumerate(pack_rows(stream(), tokens)):
        if step >= steps:
            break
        batch = step_obj.collate([s for _, s in group])
        sync()
        t = time.perf_counter()
        metrics = step_obj.step(batch)
        sync()
        if step >= min(3, steps - 1):
            times.append(time.perf_counter() - t)
            toks.append(int((batch["document_ids"] >= 0).sum()))
        losses.append(summarize({k: float(v) for k, v in metrics.items()}, tc["ttt_steps"], "")["loss"])
    finite = bool(all(np.isfinite(losses)))
    dropped = losses[-1] < losses[0]
    acc0 = float(metrics["full_acc_0_sum"] / metrics["full_acc_0_total"])
    med = float(np.median(times))
    tps = float(np.median(toks)) / med
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    line = (f"{name:34s}: loss {losses[0]:.4f} -> {losses[-1]:.4f} finite={finite} acc0 {acc0:.3f} "
            f"{tps:,.0f} tok/s (median step {med * 1e3:.1f} ms, {tokens} tokens/step) peak mem {mem:.1f} GiB")
    print(line, flush=True)
    del step_obj
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return losses[0], losses[-1], finite and dropped


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=8192, help="packed tokens per step")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    args = ap.parse_args()

    shapes = args.shapes.split(",")
    if len(shapes) > 1:
        # one process per shape, as a Ray Train worker holds one draft: Dynamo's recompile limit (8) counts per code
        # object across a process, and three SmolLM2 variants followed by the Llama-8B one in one process hit it; the
        # draft's flex attention then ran uncompiled, materialized the scores and ran out of memory (H200, 24 GiB asked)
        import subprocess

        rcs = [subprocess.call([sys.executable, __file__, "--steps", str(args.steps), "--tokens", str(args.tokens),
                                "--device", args.device, "--shapes", shape]) for shape in shapes]
        return max(rcs)

    import torch

    dev = torch.device(args.device)
    if dev.type == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
        print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
    ok = True
    for shape in shapes:
        tmp = tempfile.mkdtemp()
        t0 = time.perf_counter()
        verifier_dir, rows, hidden, vd = make_rows(shape, dev, tmp)
        vocab = json.loads(pathlib.Path(verifier_dir, "config.json").read_text())["vocab_size"]
        print(f"[{shape}] hidden {hidden}, vocabulary {vocab}, draft vocabulary {vd}, {len(rows)} samples, "
              f"{sum(r['seq_len'] for r in rows)} tokens (made in {time.perf_counter() - t0:.1f} s)", flush=True)
        # the train section as the driver hands it to workers (no config module needed on the device machine)
        base = {"num_draft_layers": 1, "draft_head_dim": None, "norm_before_residual": True, "norm_before_fc": True,
                "norm_output": True, "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss": "kl_div",
                "lr": 1e-3, "weight_decay": 0.0, "warmup_steps": 0, "max_steps": args.steps, "min_lr_ratio": 1.0,
                "grad_clip": 1.0, "hidden_noise": 0.0, "max_tokens_per_batch": args.tokens,
                "muon_lr": 2e-3, "muon_momentum": 0.95, "muon_weight_decay": 0.0}
        variants = [("simple_flex_attention", "fused", "adamw"), ("simple_flex_attention", "fused", "muon"),
                    ("sdpa", "eager", "adamw")]
        if dev.type != "cuda":  # the fused loss is a Triton kernel; FlexAttention needs compile on CPU
            variants = [("sdpa", "eager", "adamw"), ("sdpa", "eager", "muon")]
        if shape != "smollm2":
            variants = [v for v in variants if v[0] != "sdpa"] or variants
        first = {}
        for attn, loss_impl, opt in variants:
            tc = dict(base, attn_impl=attn, loss_impl=loss_impl, optimizer=opt)
            name = f"[{shape}] {attn} {loss_impl} {opt}"
            try:
                l0, _, good = run_variant(name, tc, verifier_dir, rows, hidden, vd, vocab, dev, args.steps,
                                          args.tokens)
            except Exception as e:  # noqa: BLE001 -- report every variant; one failure must not hide the rest
                msg = str(e).strip().splitlines()
                print(f"{name:34s}: FAILED {type(e).__name__}: {msg[0] if msg else ''}", flush=True)
                l0, good = float("nan"), False
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            ok &= good
            first[(attn, loss_impl, opt)] = l0
        if shape == "smollm2" and dev.type == "cuda":
            a, b = first[("simple_flex_attention", "fused", "adamw")], first[("sdpa", "eager", "adamw")]
            print(f"[{shape}] initial loss flex+fused vs sdpa+eager (same init, same batch): {a:.5f} vs {b:.5f}")
            ok &= abs(a - b) <= 0.02 * max(abs(b), 1e-6) + 1e-3
    print("GPU draft step:" if dev.type == "cuda" else "draft step:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
