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

``--vary-lengths``: does one long run recompile as the packing changes? speculators ``torch.compile``s the draft's
forward on CUDA, and Dynamo's recompile limit (8) counts per code object across a process: once hit, Dynamo runs
that code uncompiled and FlexAttention materializes its scores (this benchmark once ran out of memory that way, with
several shapes in one process, docs/results.md). A Ray Train worker holds one draft for a whole run, and each of its
steps packs other samples: ``pack_rows`` groups samples of varied lengths up to ``train.max_tokens_per_batch``, so
the number of samples, their lengths and the packed length change every step (speculators' ``CollateFn`` pads the
tensors to ``max_tokens_per_batch``; what changes is ``document_ids`` and so the attention's block mask). With the
flag, per shape and in one process, one variant (on CUDA the GPU config's: FlexAttention, fused loss, AdamW; sdpa and
eager loss on the CPU, where nothing is compiled) trains ``--steps`` steps on samples of ``--min-len``..``--max-len``
tokens drawn uniformly (seeded by ``--seed``; capped at ``--tokens`` + 1 so none is cut), cut from a few long random
samples (SmolLM2: its random verifier's states; Llama-8B: random states), each packed by ``row_to_sample`` +
``pack_rows`` + the step's collate as above. Prints a line per ``--print-every`` steps (step time min/median/max,
samples and packed tokens per step, graphs Dynamo compiled, recompiles logged, loss), then: the distinct tensor shapes
and packings seen, Dynamo's compiles in step 0 and after it (``counters["stats"]["unique_graphs"]``), the
recompiles logged (``torch._logging.set_logs(recompiles=True)``; their reasons also go to stderr), the compiled
versions held for the forward, whether a ``recompile_limit`` / ``cache_size_limit`` warning was logged, the median
step of steps 1..10 against that of the last half, and peak GPU memory. Exits non-zero if the limit was hit (or the
forward holds as many versions as the limit) or a loss was not finite (or a step failed, an OOM say)::

    python benchmarks/gpu_draft_step.py --shapes llama8b --steps 200 --vary-lengths               # on a GPU
    python benchmarks/gpu_draft_step.py --device cpu --steps 4 --shapes smollm2 --tokens 1024 --vary-lengths

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

    from eagle3ray.blocks import to_storage_bytes

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rows = []
    if shape == "smollm2":
        verifier = _smollm2_verifier(dev, tmp)
        vd, n = 8192, 48
        with torch.no_grad():
            for i in range(n):
                T = int(torch.randint(200, 900, (1,), generator=g))
                ids = torch.randint(0, vd, (1, T), generator=g).to(dev)
                st = _smollm2_states(verifier, ids)  # shape: [T, 4, 576]
                rows.append(_row(i, ids[0].tolist(), st, to_storage_bytes))
        del verifier
        return tmp, rows, 576, vd
    H, vd = _llama8b_verifier(tmp), 32000
    for i in range(16):
        T = int(torch.randint(300, 1500, (1,), generator=g))
        ids = torch.randint(0, vd, (T,), generator=g).tolist()
        st = torch.randn(T, 4, H, generator=g)  # shape: [T, 4, 4096]; random states, timing only
        rows.append(_row(i, ids, st, to_storage_bytes))
    return tmp, rows, H, vd


def _smollm2_verifier(dev, tmp: str):
    """A random verifier of SmolLM2-135M's shapes on ``dev``, saved to ``tmp``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vcfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                       tie_word_embeddings=True, rms_norm_eps=1e-5)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    verifier = LlamaForCausalLM(vcfg).to(dev, dtype).eval()
    verifier.save_pretrained(tmp)
    return verifier


def _smollm2_states(verifier, ids):
    """float32 [T, 4, 576] on the CPU: aux layers 2/15/27 and the last layer's pre-norm output for ids [1, T]."""
    import torch

    cap = {}
    h = verifier.model.layers[-1].register_forward_hook(
        lambda m, i_, o: cap.__setitem__("pre", o[0] if isinstance(o, tuple) else o))
    out = verifier(ids, output_hidden_states=True)
    h.remove()
    return torch.stack([out.hidden_states[2][0], out.hidden_states[15][0], out.hidden_states[27][0],
                        cap["pre"][0]], dim=1).float().cpu()


def _llama8b_verifier(tmp: str) -> int:
    """A one-layer random verifier of Llama-3.1-8B-Instruct's shapes saved to ``tmp``; returns its hidden size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((ROOT / "configs/verifiers/Llama-3.1-8B-Instruct/config.json").read_text())
    cfg["num_hidden_layers"] = 1  # the draft takes only embeddings, lm_head and norm from the verifier
    vcfg = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    verifier = LlamaForCausalLM(vcfg).to(torch.bfloat16)
    verifier.save_pretrained(tmp)
    del verifier
    # speculators checks the aux ids against the verifier's depth: the saved config keeps the real 32 layers
    pathlib.Path(tmp, "config.json").write_text(json.dumps(dict(
        json.loads(pathlib.Path(tmp, "config.json").read_text()), num_hidden_layers=32)))
    return cfg["hidden_size"]


def _row(i, ids, st, to_storage_bytes):
    T, L, H = st.shape
    return {"sample_id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 20 + [1] * (T - 20),
            "hidden_states": to_storage_bytes(st, "bfloat16"), "seq_len": T, "num_layers": L, "hidden_size": H,
            "hs_dtype": "bfloat16"}


def build_step(tc: dict, verifier_dir, hidden: int, vd: int, vocab: int, dev):
    """The product's ``DraftStep`` for one variant, seeded (0), on ``dev``, in training mode; d2t/t2d map the first
    ``vd`` of the verifier's ``vocab`` tokens to the draft vocabulary (a benchmark does not need a real mapping)."""
    import torch

    from eagle3ray.train_worker import DraftStep

    d2t = torch.zeros(vd, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:vd] = True
    torch.manual_seed(0)
    step_obj = DraftStep.build(tc, verifier_dir, [2, 15, 27], d2t, t2d, hidden, autocast_bf16=dev.type == "cuda")
    step_obj.to_device(dev)
    step_obj.model.train()
    return step_obj


def run_variant(name, tc, verifier_dir, rows, hidden, vd, vocab, dev, steps, tokens):
    """Train ``steps`` steps of one variant; returns (first loss, last loss, ok, printed line)."""
    import numpy as np
    import torch

    from eagle3ray.train_worker import pack_rows, row_to_sample, summarize

    step_obj = build_step(tc, verifier_dir, hidden, vd, vocab, dev)

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


# ------------------------------------------------------------------------------------------- --vary-lengths
def make_bases(shape: str, dev, tmp: str, length: int, n: int = 4):
    """(verifier folder, ``n`` base samples of ``length`` tokens as (input ids, bf16 states bytes [T, 4, H]),
    hidden size, draft vocabulary size): :func:`varied_rows` cuts samples of any length out of them."""
    import torch

    from eagle3ray.blocks import to_storage_bytes

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    bases = []
    if shape == "smollm2":
        verifier, vd = _smollm2_verifier(dev, tmp), 8192
        with torch.no_grad():
            for _ in range(n):
                ids = torch.randint(0, vd, (1, length), generator=g).to(dev)
                bases.append((ids[0].tolist(), to_storage_bytes(_smollm2_states(verifier, ids), "bfloat16")))
        del verifier
        return tmp, bases, 576, vd
    H, vd = _llama8b_verifier(tmp), 32000
    for _ in range(n):
        ids = torch.randint(0, vd, (length,), generator=g).tolist()
        bases.append((ids, to_storage_bytes(torch.randn(length, 4, H, generator=g), "bfloat16")))  # timing only
    return tmp, bases, H, vd


def varied_rows(bases, hidden: int, lo: int, hi: int, seed: int):
    """Endless rows as extract writes them (bf16 states, 4 layers), of ``lo``..``hi`` tokens drawn uniformly (seeded),
    each a random window of a random base sample, with unique sample ids."""
    import random

    rng = random.Random(seed)
    per_token = 4 * hidden * 2  # bytes of one token's states: [4, H] bf16
    i = 0
    while True:
        ids, buf = rng.choice(bases)
        T = rng.randint(lo, hi)
        off = rng.randint(0, len(ids) - T)
        prompt = min(20, T // 2)
        yield {"sample_id": f"v{i}", "input_ids": ids[off:off + T], "loss_mask": [0] * prompt + [1] * (T - prompt),
               "hidden_states": buf[off * per_token:(off + T) * per_token], "seq_len": T, "num_layers": 4,
               "hidden_size": hidden, "hs_dtype": "bfloat16"}
        i += 1


class DynamoWatch:
    """Dynamo's compiles in this process, each probe best-effort (None where this torch lacks it).

    - ``graphs()``: ``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` (graphs Dynamo compiled so far);
    - ``recompiles``: "Recompiling function ..." messages of the ``recompiles`` log (``torch._logging.set_logs``),
      with their reasons (also printed by torch on stderr);
    - ``limit_hits``: log records (``torch._dynamo`` and ``torch`` loggers) and Python warnings that name
      ``recompile_limit`` / ``cache_size_limit``;
    - ``cache_entries(fn)``: the compiled versions Dynamo holds for a ``torch.compile``d function's code.
    """

    def __init__(self):
        import logging
        import warnings

        self.recompiles: list[str] = []
        self.limit_hits: list[str] = []
        self.logging_ok = False
        try:
            import torch._logging

            torch._logging.set_logs(recompiles=True)
            self.logging_ok = True
        except Exception as e:  # noqa: BLE001 -- the recompile count is then 'unknown'
            print(f"(torch._logging.set_logs(recompiles=True) failed: {type(e).__name__}: {e})", flush=True)
        watch = self

        class _Capture(logging.Handler):
            def emit(self, record):
                if getattr(record, "_draft_step_seen", False):  # reached both loggers: count it once
                    return
                record._draft_step_seen = True
                try:
                    watch._note(record.getMessage())
                except Exception:  # noqa: BLE001 -- never break the run for a log record
                    pass

        self._handler = _Capture(level=logging.DEBUG)
        for name in ("torch._dynamo", "torch"):  # torch's registered loggers do not propagate to their parent
            logging.getLogger(name).addHandler(self._handler)
        self._showwarning = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            watch._note(str(message))
            watch._showwarning(message, category, filename, lineno, file, line)

        warnings.showwarning = show

    def _note(self, msg: str) -> None:
        if msg.startswith("Recompiling function"):
            self.recompiles.append(msg)
        if "recompile_limit" in msg or "cache_size_limit" in msg:
            self.limit_hits.append(msg)

    def close(self) -> None:
        import logging
        import warnings

        for name in ("torch._dynamo", "torch"):
            logging.getLogger(name).removeHandler(self._handler)
        warnings.showwarning = self._showwarning

    @staticmethod
    def graphs():
        try:
            from torch._dynamo.utils import counters

            return int(counters["stats"]["unique_graphs"])
        except Exception:  # noqa: BLE001
            return None

    @staticmethod
    def limit():
        try:
            import torch._dynamo.config as c

            return getattr(c, "recompile_limit", None) or getattr(c, "cache_size_limit", None)
        except Exception:  # noqa: BLE001
            return None

    @staticmethod
    def cache_entries(fn):
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            orig = getattr(fn, "_torchdynamo_orig_callable", None)
            return None if orig is None else len(_debug_get_cache_entry_list(orig.__code__))
        except Exception:  # noqa: BLE001
            return None


def _fmt(x, spec="") -> str:
    return "unknown" if x is None else format(x, spec)


def run_vary(shape: str, tc: dict, verifier_dir, bases, hidden, vd, vocab, dev, args) -> bool:
    """``args.steps`` steps of one draft in this process on batches packed from samples of varied lengths, as a
    Ray Train worker's epoch; prints per-step times, packings, Dynamo's compiles; returns whether it passed (no
    recompile limit hit, every loss finite)."""
    import numpy as np
    import torch

    from eagle3ray.train_worker import pack_rows, row_to_sample, summarize

    tokens, name = args.tokens, f"[{shape} vary]"
    hi = min(args.max_len, tokens + 1)  # a sample of T tokens packs T - 1 shifted tokens: none is cut
    lo = max(2, min(args.min_len, hi))
    step_obj = build_step(tc, verifier_dir, hidden, vd, vocab, dev)
    forward = type(step_obj.core).forward
    watch = DynamoWatch()
    compiled = getattr(forward, "_torchdynamo_orig_callable", None) is not None
    print(f"{name} {tc['attn_impl']} {tc['loss_impl']} {tc['optimizer']}: {args.steps} steps of <= {tokens} "
          f"tokens, sample lengths uniform {lo}..{hi} (seed {args.seed}); Dynamo recompile_limit "
          f"{_fmt(watch.limit())}, draft forward compiled: {compiled}", flush=True)

    def stream():
        for r in varied_rows(bases, hidden, lo, hi, args.seed):
            yield r["sample_id"], row_to_sample(r)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    recs, error = [], None  # recs: per step {t, docs, real, lens, shape, graphs, recompiles, loss}
    g_prev, r_prev = watch.graphs(), 0
    every = max(1, args.print_every)

    def table(a: int, b: int) -> None:
        block = recs[a:b]
        ms = [r["t"] * 1e3 for r in block]
        ng = [r["graphs"] for r in block if r["graphs"] is not None]
        comp = [str(a + i) for i, r in enumerate(block) if (r["graphs"] or 0) > 0 or r["recompiles"] > 0]
        print(f"{name} steps {a:4d}-{b - 1:<4d} ms min {min(ms):8.1f} med {float(np.median(ms)):8.1f} max "
              f"{max(ms):8.1f} | docs/step {min(r['docs'] for r in block)}-{max(r['docs'] for r in block)} | "
              f"tokens {min(r['real'] for r in block)}-{max(r['real'] for r in block)} | new graphs "
              f"{sum(ng) if ng else 'unknown'} | recompiles {sum(r['recompiles'] for r in block)}"
              f"{' (steps ' + ','.join(comp[:8]) + (',...' if len(comp) > 8 else '') + ')' if comp else ''} | "
              f"loss {block[0]['loss']:.4f} -> {block[-1]['loss']:.4f}", flush=True)

    try:
        for step, group in enumerate(pack_rows(stream(), tokens)):
            if step >= args.steps:
                break
            batch = step_obj.collate([s for _, s in group])
            sync()
            t = time.perf_counter()
            try:
                metrics = step_obj.step(batch, f"step {step}")
                sync()
            finally:
                dt = time.perf_counter() - t
                g_now = watch.graphs()
                recs.append({"t": dt, "docs": len(group), "real": int((batch["document_ids"] >= 0).sum()),
                             "lens": tuple(int(s["lengths"][0]) for _, s in group),
                             "shape": tuple(batch["hidden_states"].shape),
                             "graphs": None if g_now is None or g_prev is None else g_now - g_prev,
                             "recompiles": len(watch.recompiles) - r_prev, "loss": float("nan")})
                g_prev, r_prev = g_now, len(watch.recompiles)
            recs[-1]["loss"] = summarize({k: float(v) for k, v in metrics.items()}, tc["ttt_steps"], "")["loss"]
            if (step + 1) % every == 0:
                table(step + 1 - every, step + 1)
    except Exception as e:  # noqa: BLE001 -- report what was seen up to the failure (an OOM, a non-finite loss)
        msg = str(e).strip().splitlines()
        error = f"{type(e).__name__}: {msg[0] if msg else ''}"
        print(f"{name} FAILED at step {len(recs) - 1}: {error}", flush=True)
    finally:
        watch.close()
    if len(recs) % every and recs:
        table(len(recs) - len(recs) % every, len(recs))
    if not recs:
        print(f"{name} no step ran", flush=True)
        return False

    n = len(recs)
    losses = [r["loss"] for r in recs]
    finite = error is None and bool(np.all(np.isfinite(losses)))
    shapes = sorted({r["shape"] for r in recs})
    packings = len({r["lens"] for r in recs})
    docs = [r["docs"] for r in recs]
    real = [r["real"] for r in recs]
    print(f"{name} {n} steps: {len(shapes)} distinct tensor shape(s) {shapes} (CollateFn pads to {tokens}); "
          f"{packings} distinct packings (per-sample lengths) and {len({r['real'] for r in recs})} distinct packed "
          f"lengths; samples/step {min(docs)}..{max(docs)} (median {float(np.median(docs)):.0f}); packed tokens/step "
          f"{min(real)}..{max(real)}", flush=True)
    g_first = recs[0]["graphs"]
    g_after = [r["graphs"] for r in recs[1:]]
    g_after = None if any(x is None for x in g_after) else sum(g_after)
    steps_recompiling = sum(1 for r in recs[1:] if (r["graphs"] or 0) > 0 or r["recompiles"] > 0)
    entries = watch.cache_entries(forward)
    limit = watch.limit()
    hit = bool(watch.limit_hits) or (entries is not None and limit is not None and entries >= limit)
    print(f"{name} Dynamo: graphs compiled {_fmt(g_first)} in step 0, {_fmt(g_after)} after; recompiles logged "
          f"{len(watch.recompiles) if watch.logging_ok else 'unknown'}; steps after step 0 that compiled "
          f"{steps_recompiling} of {n - 1}; forward's cache entries {_fmt(entries)} (limit {_fmt(limit)}); "
          f"recompile limit hit: {'YES' if hit else 'no'}", flush=True)
    for msg in watch.recompiles[:3]:
        print(f"{name}   recompile: " + " | ".join(x.strip() for x in msg.splitlines()[:4]), flush=True)
    for msg in watch.limit_hits[:2]:
        print(f"{name}   LIMIT: " + " | ".join(x.strip() for x in msg.splitlines()[:4]), flush=True)
    ms = [r["t"] * 1e3 for r in recs]
    early = ms[1:max(2, min(11, n // 2))]
    late = ms[n // 2:] if n > 1 else ms
    med_e, med_l = (float(np.median(early)) if early else float("nan")), float(np.median(late))
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    tps = float(np.median(real[n // 2:])) / med_l * 1e3 if med_l > 0 else float("nan")
    ratio = med_l / med_e if early else float("nan")
    print(f"{name} step ms: step 0 {ms[0]:.1f}{' (compiles)' if compiled else ''}; median steps 1..{len(early)} "
          f"{med_e:.1f}; median steps {n // 2}..{n - 1} {med_l:.1f} (x{ratio:.2f} steps 1..{len(early)}); max after "
          f"step 0 {max(ms[1:]) if n > 1 else float('nan'):.1f}; {tps:,.0f} tok/s (last half); peak mem {mem:.1f} GiB",
          flush=True)
    print(f"{name} loss {losses[0]:.4f} -> {losses[-1]:.4f} finite={finite}"
          f"{'' if error is None else ' error ' + error}", flush=True)
    del step_obj
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return finite and not hit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=8192, help="packed tokens per step")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--vary-lengths", action="store_true",
                    help="one variant (flex+fused AdamW on CUDA), batches packed from samples of varied lengths: "
                    "does Dynamo recompile as the packing changes? (module docstring)")
    ap.add_argument("--min-len", type=int, default=60, help="--vary-lengths: shortest sample (tokens)")
    ap.add_argument("--max-len", type=int, default=2000,
                    help="--vary-lengths: longest sample (tokens; capped at --tokens + 1)")
    ap.add_argument("--seed", type=int, default=0, help="--vary-lengths: seed of the sample lengths")
    ap.add_argument("--print-every", type=int, default=20, help="--vary-lengths: a table line every N steps")
    args = ap.parse_args()

    shapes = args.shapes.split(",")
    if len(shapes) > 1:
        # one process per shape, as a Ray Train worker holds one draft: Dynamo's recompile limit (8) counts per code
        # object across a process, and three SmolLM2 variants followed by the Llama-8B one in one process hit it; the
        # draft's flex attention then ran uncompiled, materialized the scores and ran out of memory (H200, 24 GiB asked)
        import subprocess

        vary = (["--vary-lengths", "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--seed",
                 str(args.seed), "--print-every", str(args.print_every)] if args.vary_lengths else [])
        rcs = [subprocess.call([sys.executable, __file__, "--steps", str(args.steps), "--tokens", str(args.tokens),
                                "--device", args.device, "--shapes", shape, *vary]) for shape in shapes]
        return max(rcs)

    import torch

    dev = torch.device(args.device)
    if dev.type == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
        print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
    ok = True
    # the train section as the driver hands it to workers (no config module needed on the device machine)
    base = {"num_draft_layers": 1, "draft_head_dim": None, "norm_before_residual": True, "norm_before_fc": True,
            "norm_output": True, "ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss": "kl_div",
            "lr": 1e-3, "weight_decay": 0.0, "warmup_steps": 0, "max_steps": args.steps, "min_lr_ratio": 1.0,
            "grad_clip": 1.0, "hidden_noise": 0.0, "max_tokens_per_batch": args.tokens,
            "muon_lr": 2e-3, "muon_momentum": 0.95, "muon_weight_decay": 0.0}
    if args.vary_lengths:
        for shape in shapes:
            tmp = tempfile.mkdtemp()
            t0 = time.perf_counter()
            length = min(args.max_len, args.tokens + 1)
            verifier_dir, bases, hidden, vd = make_bases(shape, dev, tmp, length)
            vocab = json.loads(pathlib.Path(verifier_dir, "config.json").read_text())["vocab_size"]
            print(f"[{shape} vary] hidden {hidden}, vocabulary {vocab}, draft vocabulary {vd}, {len(bases)} base "
                  f"samples of {length} tokens (made in {time.perf_counter() - t0:.1f} s)", flush=True)
            # the GPU config's variant (configs/llama-3.1-8b-instruct.yaml); the CPU has neither Triton nor compile
            attn, loss_impl = ("simple_flex_attention", "fused") if dev.type == "cuda" else ("sdpa", "eager")
            tc = dict(base, attn_impl=attn, loss_impl=loss_impl, optimizer="adamw")
            ok &= run_vary(shape, tc, verifier_dir, bases, hidden, vd, vocab, dev, args)
        print("GPU draft step, varied lengths:" if dev.type == "cuda" else "draft step, varied lengths:",
              "PASS" if ok else "FAIL")
        return 0 if ok else 1
    for shape in shapes:
        tmp = tempfile.mkdtemp()
        t0 = time.perf_counter()
        verifier_dir, rows, hidden, vd = make_rows(shape, dev, tmp)
        vocab = json.loads(pathlib.Path(verifier_dir, "config.json").read_text())["vocab_size"]
        print(f"[{shape}] hidden {hidden}, vocabulary {vocab}, draft vocabulary {vd}, {len(rows)} samples, "
              f"{sum(r['seq_len'] for r in rows)} tokens (made in {time.perf_counter() - t0:.1f} s)", flush=True)
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
