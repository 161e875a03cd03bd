"""Extraction audit: committed hidden states recomputed with a transformers forward of the same verifier.

The field's silent failures are wrong states that still have the right shape: a layer off by one (TorchSpec #87;
shifted aux layers took acceptance from 59% to 1.2%, vLLM PR #50170), the final state after the norm instead of
before it, prefix caching truncating dumps (vLLM #44485), samples mixed within a batch (speculators #279). The
audit takes ``extract.audit_samples`` committed samples (spread over the blocks), recomputes their states with
``transformers.AutoModelForCausalLM`` in float32 (layer id ``i < L`` is ``hidden_states[i]``, the input of
decoder layer i; id ``L`` is the last decoder layer's output before the final norm, caught by a forward hook:
eagle3ray's layer convention, :mod:`eagle3ray.verifier`), and compares them per layer id.

The error of a layer is the relative L2 error per token, ``||stored_t - ref_t|| / ||ref_t||``, whose mean and
maximum over the audited tokens are recorded (``manifest["audit"]``, the extract summary). A layer fails when

- its mean error exceeds the tolerance of the storage dtype plus that of the engine's compute dtype
  (:data:`STORAGE_TOLERANCE`, :data:`COMPUTE_TOLERANCE`), or
- the stored states are closer to another layer's reference states than to their own (an off-by-one is named
  as such: "the states stored as layer 15 match layer 16").

Raises :class:`AuditFailed` naming each failing layer; the extract stage then leaves its manifest incomplete, so
the run cannot go on to train on the states.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from . import blocks

log = logging.getLogger(__name__)

#: Mean relative L2 error per token allowed by the rounding of the stored dtype alone (bf16 keeps 8 mantissa
#: bits: ~0.2% per value, about 0.23% in L2; fp8 e4m3 with a scale per token and layer: 2.2% mean, 3.2% max on
#: SmolLM2's states, benchmarks/block_codec.py).
STORAGE_TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2, "float8_e4m3": 5e-2}
#: Mean relative error allowed for the engine's compute dtype against transformers' float32 (vLLM's kernels
#: differ from transformers' in summation order; bf16 compute adds its rounding at every layer).
COMPUTE_TOLERANCE = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 6e-2}


class AuditFailed(RuntimeError):
    """The stored states of some layer ids do not match the verifier's (each named, with its error)."""


@dataclass
class LayerError:
    layer_id: int
    mean_rel_err: float
    max_rel_err: float
    nearest_layer: int  # the reference layer the stored states are closest to (mean error)
    nearest_rel_err: float


def _reference_states(model, input_ids: list[int], ids: list[int]) -> dict[int, np.ndarray]:
    """{layer id: [T, H] float32} from one transformers forward (ids <= L; L = pre-norm output of the last layer)."""
    import torch

    captured = {}

    def hook(_m, _inp, out):
        captured["prenorm"] = out[0] if isinstance(out, tuple) else out

    h = model.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(torch.tensor([input_ids]), output_hidden_states=True)
    finally:
        h.remove()
    L = model.config.num_hidden_layers
    return {i: (captured["prenorm"][0] if i == L else out.hidden_states[i][0]).float().numpy() for i in ids}


def _rel_err(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Relative L2 error per token: [T]."""
    return np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-12)


def pick_samples(fs, hs_root: str, manifest: dict, n: int) -> list[dict]:
    """``n`` committed rows (block rows: sample_id, input_ids, hidden_states, ...), one from each of ``n`` blocks
    spread evenly over the manifest (the first row of each)."""
    import pyarrow.parquet as pq

    entries = manifest["blocks"]
    if not entries or n <= 0:
        return []
    idx = sorted({round(i * (len(entries) - 1) / max(n - 1, 1)) for i in range(min(n, len(entries)))})
    rows = []
    for i in idx:
        with fs.open(f"{hs_root}/{entries[i]['path']}", "rb") as f:
            rows.append(pq.read_table(f).slice(0, 1).to_pylist()[0])
    return rows


def audit_rows(rows: list[dict], model_path: str, layer_ids: list[int], storage_dtype: str, compute_dtype: str,
               max_tokens: int = 512) -> dict:
    """Compare the stored states of ``rows`` with a transformers forward; returns the audit record.

    Args:
        rows: committed block rows (``blocks.BLOCK_SCHEMA``); states decoded with :func:`eagle3ray.blocks.decode_states`.
        layer_ids: the layer ids the states claim to be (``manifest["layer_ids"]``), in the stored order.
        max_tokens: the first tokens of each sample that are compared (the forward is causal: a prefix's states
            do not depend on what follows).

    Returns:
        {"passed", "samples", "tokens", "tolerance", "layers": {id: {mean_rel_err, max_rel_err, nearest_layer,
        nearest_rel_err}}, "problems": [...], "reference", "seconds"}.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar in the stage's terminal
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    L = model.config.num_hidden_layers
    # every stored id and its neighbours: an off-by-one is found by which reference layer fits best
    candidates = sorted({j for i in layer_ids for j in (i - 1, i, i + 1) if 0 <= j <= L})
    errs: dict[int, dict[int, list[np.ndarray]]] = {i: {j: [] for j in candidates} for i in layer_ids}
    tokens = 0
    for r in rows:
        got = blocks.decode_states(r)[:max_tokens]  # shape: [T, L_stored, H]
        ids = list(r["input_ids"])[:max_tokens]
        ref = _reference_states(model, ids, candidates)
        tokens += len(ids)
        for k, i in enumerate(layer_ids):
            for j in candidates:
                errs[i][j].append(_rel_err(got[:, k], ref[j]))
    tol = STORAGE_TOLERANCE[storage_dtype] + COMPUTE_TOLERANCE.get(compute_dtype, COMPUTE_TOLERANCE["bfloat16"])
    layers, problems = {}, []
    for i in layer_ids:
        own = np.concatenate(errs[i][i])
        means = {j: float(np.concatenate(e).mean()) for j, e in errs[i].items()}
        nearest = min(means, key=means.get)
        le = LayerError(i, float(own.mean()), float(own.max()), nearest, means[nearest])
        layers[str(i)] = {"mean_rel_err": le.mean_rel_err, "max_rel_err": le.max_rel_err,
                          "nearest_layer": le.nearest_layer, "nearest_rel_err": le.nearest_rel_err}
        what = "the final pre-norm state" if i == L else f"layer {i}"
        if nearest != i and means[nearest] < le.mean_rel_err:
            near = "the final pre-norm state" if nearest == L else f"layer {nearest}"
            problems.append(f"the states stored as {what} match {near} (mean relative error {means[nearest]:.4f} "
                            f"there, {le.mean_rel_err:.4f} against {what})")
        elif le.mean_rel_err > tol:
            problems.append(f"{what}: mean relative error {le.mean_rel_err:.4f} > tolerance {tol:.4f} "
                            f"({storage_dtype} storage, {compute_dtype} compute)")
    return {"passed": not problems, "samples": [r["sample_id"] for r in rows], "tokens": tokens, "tolerance": tol,
            "layers": layers, "problems": problems, "storage_dtype": storage_dtype, "compute_dtype": compute_dtype,
            "reference": f"transformers {transformers.__version__} float32 on cpu",
            "seconds": time.time() - t0}


def verifier_fits(model_path: str) -> tuple[bool, str]:
    """Whether a float32 copy of the verifier fits in this process's free memory (with 2x headroom), and why not."""
    import psutil

    size = sum(os.path.getsize(os.path.join(model_path, f)) for f in os.listdir(model_path)
               if f.endswith(".safetensors"))
    need = 2 * size * 2  # the weights as float32 (stored as 16-bit at most twice as small), twice over
    free = psutil.virtual_memory().available
    if need > free:
        return False, (f"the verifier needs about {need / 2**30:.1f} GiB as float32 and this process has "
                       f"{free / 2**30:.1f} GiB free")
    return True, ""


def audit_run(fs, hs_root: str, manifest: dict, model_path: str, samples: int, compute_dtype: str,
              device: str = "cpu", engine: str = "vllm") -> dict:
    """Audit ``samples`` committed samples of a run's hidden states (module docstring); returns the record.

    On a GPU verifier (``device`` other than cpu), one that does not fit this process's memory, or the stand-in
    engine (``verifier.engine: stand_in``, whose states are synthetic by design) the audit is skipped, and the
    record says why (``{"skipped": reason}``).
    """
    if samples <= 0:
        return {"skipped": "extract.audit_samples is 0"}
    if engine != "vllm":
        return {"skipped": f"verifier.engine {engine}: its states are synthetic, not the verifier's"}
    if device != "cpu":
        return {"skipped": f"verifier.device {device}: the transformers reference runs on CPU only in this version"}
    ok, why = verifier_fits(model_path)
    if not ok:
        return {"skipped": why}
    rows = pick_samples(fs, hs_root, manifest, samples)
    rec = audit_rows(rows, model_path, manifest["layer_ids"], manifest["dtype"], compute_dtype)
    log.info("audit: %d samples, %d tokens, %s", len(rows), rec["tokens"],
             ", ".join(f"layer {i}: {v['mean_rel_err']:.2e}" for i, v in rec["layers"].items()))
    return rec


def check(rec: dict, where: str) -> None:
    """Raise :class:`AuditFailed` when an audit record did not pass (a skipped audit passes)."""
    if rec.get("skipped") or rec.get("passed", True):
        return
    raise AuditFailed(f"{where}: extraction audit failed on {len(rec['samples'])} samples "
                      f"({', '.join(rec['samples'])}):\n  " + "\n  ".join(rec["problems"])
                      + "\nThe stored hidden states are not the verifier's at the manifest's layer ids; check "
                      "verifier.aux_layer_ids and the engine (the manifest stays incomplete: nothing trains on them).")
