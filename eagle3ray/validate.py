"""Stage ``validate``: vLLM with the exported EAGLE-3 draft vs without it, on held-out prompts.

Two serving actors (:class:`eagle3ray.serving_engine.ServingEngine` in Ray actors), one after the other
so that they never compete for the same cores or GPUs: the verifier with
``speculative_config={"method": "eagle3", "model": <export>, "num_speculative_tokens": k}``, then
the verifier alone, both on the same prompts with the same sampling settings (temperature 0 by
default) and the same number of sequences in flight.

From vLLM's spec-decode counters: mean acceptance length (1 + accepted / drafts) and acceptance
rate per position; from wall time: output tokens/s with and without the draft, and their ratio
(``speedup``). Greedy outputs must be identical; differences are reported by prompt. That check is
only meaningful where the verifier's numerics do not depend on batching: bf16 on CPU is not (with no
draft at all, answers change with the number of sequences in flight,
``benchmarks/greedy_numerics.py``), so ``validation.greedy_check_dtype`` (float32 in the CPU config)
runs a second pair of engines at that dtype for the check, after the pair that measures acceptance and
speed at the run's dtype.

Writes ``<run>/reports/validate.json`` (the fields DESIGN.md lists and more) and
``<run>/reports/validate.png`` (acceptance per position; training curves when present).
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
import time

from . import storage
from .artifacts import read_export_provenance, read_metrics
from .sources import first_turn_prompts

log = logging.getLogger(__name__)


class ValidateReport(dict):
    """``reports/validate.json`` as a dict (the fields DESIGN.md lists and more), plus how the CLI shows it."""

    @property
    def title(self) -> str:
        return "validate" + (" (already validated: skipped)" if self.get("skipped") else "")

    def rows(self) -> list[tuple[str, object]]:
        """(label, value) rows for the CLI's table."""
        r = self
        rows = [
            ("eval set / prompts", f"{r['eval_set']} / {r['num_prompts']}"),
            ("num_speculative_tokens (k)", r["num_speculative_tokens"]),
            ("compute dtype", r.get("dtype")),
            ("temperature", r.get("temperature", 0.0)),
            ("mean acceptance length", r["mean_acceptance_length"]),
            ("acceptance per position", ", ".join(f"{a:.3f}" for a in r["acceptance_per_position"])),
            ("output tokens/s with draft", r["tokens_per_s_spec"]),
            ("output tokens/s without", r["tokens_per_s_baseline"]), ("speedup", r["speedup"])]
        greedy = r.get("greedy_check")
        if greedy:
            rows += [(f"greedy outputs identical ({greedy['dtype']})", r["greedy_identical"]),
                     (f"  acceptance length ({greedy['dtype']})", greedy["mean_acceptance_length"]),
                     (f"  greedy identical ({r.get('dtype')}, batch numerics)", r["greedy_identical_at_dtype"])]
        else:
            rows.append(("greedy outputs identical", r["greedy_identical"]))
        if r.get("temperature"):
            rows.append(("CPU sampler fix (vLLM #55005)", r.get("vllm_cpu_expand_fix", "none: figures not trusted")))
        return rows + [("checkpoint step", r["checkpoint"]["step"])]

    def headline(self) -> str:
        return (f"mean acceptance length {self['mean_acceptance_length']:.3f} at k={self['num_speculative_tokens']} "
                f"on {self['num_prompts']} {self['eval_set']} prompts; speedup {self['speedup']:.2f}; greedy "
                f"identical {self['greedy_identical']}")


def eval_prompt_ids(model_path: str, specs, max_prompts: int) -> tuple[list[list[int]], str]:
    """The evaluation prompts as token ids (the verifier's chat template with the generation prompt),
    and the set's name: what both validation engines decode."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    convs, name = first_turn_prompts(specs, max_prompts)
    prompts = []
    for c in convs:
        ids = tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts, name


def _local_export(paths: storage.RunPaths) -> str:
    """The export folder as a local path (downloaded from object storage when needed)."""
    src = paths.sub("export")
    if storage.is_local(paths.fs):
        return src
    dst = tempfile.mkdtemp(prefix="eagle3ray-export-")
    paths.fs.get(src + "/", dst + "/", recursive=True)
    return dst


def plot_report(report: dict, history: list[dict]) -> bytes:
    """PNG bytes: acceptance rate per position (bars) and, when present, held-out accuracy per TTT step
    over training steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [m for m in history if "val_full_acc_0" in m]
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(11 if curves else 6, 4))
    axes = axes if curves else [axes]
    acc = report["acceptance_per_position"]
    ax = axes[0]
    ax.bar([str(i + 1) for i in range(len(acc))], acc, color="#3b7dd8")
    for i, a in enumerate(acc):
        ax.text(i, a, f"{a:.2f}", ha="center", va="bottom")
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_title(f"{report['eval_set']} ({report['num_prompts']} prompts, k={report['num_speculative_tokens']})\n"
                 f"mean acceptance length {report['mean_acceptance_length']:.2f}")
    if curves:
        ax = axes[1]
        steps = [m["step"] for m in curves]
        k = 0
        while any(f"val_full_acc_{k}" in m for m in curves):
            ax.plot(steps, [m.get(f"val_full_acc_{k}", float("nan")) for m in curves], marker="o",
                    label=f"TTT step {k}")
            k += 1
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out accuracy")
        ax.set_title("draft training (held-out blocks)")
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def validate(cfg, force: bool = False) -> ValidateReport:
    """Run the validate stage; returns the report dict (also written to storage).

    Raises:
        FileNotFoundError: no export (run `eagle3ray export`).
        VerifierMismatch: a pinned verifier service runs another verifier.
    """
    import ray
    from transformers import AutoTokenizer

    from .machine import resolve_dtype
    from .serving_engine import ServingEngine, acceptance
    from .machine import ensure_ray
    from .verifier_service import refuse_if_pinned_differs
    from .verifier import VerifierSpec

    paths = storage.run_paths(cfg)
    prov = read_export_provenance(paths)
    if not prov:
        raise FileNotFoundError(f"{paths.uri}/export: no finished export; run `eagle3ray export`")
    rep_path = f"{paths.sub('reports')}/validate.json"
    vc = cfg.validation
    settings = json.loads(vc.model_dump_json())
    v = cfg.verifier
    dtype = resolve_dtype(vc.dtype or v.dtype, v.device)
    check_dtype = resolve_dtype(vc.greedy_check_dtype or dtype, v.device)
    old = storage.read_json(paths.fs, rep_path)
    if old and not force and old.get("checkpoint", {}).get("path") == prov["checkpoint"] \
            and old.get("settings") == settings and old.get("dtype") == dtype \
            and old.get("greedy_check_dtype", dtype) == (check_dtype if vc.temperature == 0 else None) \
            and (vc.temperature == 0 or "vllm_cpu_expand_fix" in old):  # T > 0 before the fix: wrong figures
        old["skipped"] = True
        return ValidateReport(old)
    spec = VerifierSpec.from_config(cfg)
    tok = AutoTokenizer.from_pretrained(spec.model_path)  # decodes greedy differences for the report
    prompts, eval_name = eval_prompt_ids(spec.model_path, vc.eval, vc.max_prompts)
    draft_dir = _local_export(paths)
    ensure_ray(cfg)
    # validation serves the draft with its own engines, but never against a verifier other than the one
    # pinned on this cluster for these jobs
    refuse_if_pinned_differs(spec)
    opts = {"num_cpus": v.num_cpus}
    if v.num_gpus:
        opts["num_gpus"] = v.num_gpus
    Engine = ray.remote(**opts)(ServingEngine)
    common = dict(max_model_len=v.max_model_len, enforce_eager=v.enforce_eager,
                  max_num_seqs=vc.max_num_seqs, cpu_kv_cache_gib=v.cpu_kv_cache_gib, seed=v.seed,
                  gpu_memory_utilization=v.gpu_memory_utilization, tensor_parallel_size=v.tensor_parallel_size,
                  device=v.device, cpu_threads=v.cpu_threads)

    sampler_fix: list[str] = []  # what vllm_cpu_fixes.apply() did in each speculative engine

    def serve_pair(dt: str) -> tuple[dict, dict, dict, list[int]]:
        """(with draft, acceptance, without draft, indices of differing greedy outputs) at compute dtype dt."""
        eng = Engine.options(name=None).remote(spec.model_path, draft_dir=draft_dir, dtype=dt,
                                               num_speculative_tokens=vc.num_speculative_tokens, **common)
        fix = ray.get(eng.cpu_fix_status.remote())
        if vc.temperature > 0 and fix.startswith("failed"):
            ray.kill(eng)
            raise RuntimeError(
                f"validation.temperature={vc.temperature}: vLLM's CPU rejection sampler expands the per-token "
                f"temperature into memory it then drops (vLLM #55005), and eagle3ray's fix could not be applied "
                f"({fix}); the acceptance figures would be wrong. Validate at validation.temperature=0, or "
                f"with a vLLM that has the fix (PR #55006).")
        sampler_fix.append(fix)
        with_draft = ray.get(eng.generate.remote(prompts, vc.max_new_tokens, vc.temperature))
        acc = acceptance(ray.get(eng.spec_counters.remote()))
        ray.kill(eng)
        base = Engine.remote(spec.model_path, draft_dir=None, dtype=dt, **common)
        without = ray.get(base.generate.remote(prompts, vc.max_new_tokens, vc.temperature))
        ray.kill(base)
        return with_draft, acc, without, [i for i, (a, b) in enumerate(zip(with_draft["outputs"],
                                                                          without["outputs"])) if a != b]

    t0 = time.time()
    with_draft, acc, without, diffs = serve_pair(dtype)
    greedy_at_dtype = f"{len(prompts) - len(diffs)}/{len(prompts)}"
    check = None
    if check_dtype != dtype and vc.temperature == 0:
        c_with, c_acc, c_without, diffs = serve_pair(check_dtype)
        check = {"dtype": check_dtype, "mean_acceptance_length": c_acc["mean_acceptance_length"],
                 "acceptance_per_position": c_acc["acceptance_per_position"],
                 "tokens_per_s_spec": c_with["output_tokens"] / c_with["seconds"],
                 "tokens_per_s_baseline": c_without["output_tokens"] / c_without["seconds"]}
        shown_with, shown_without = c_with, c_without
    else:
        shown_with, shown_without = with_draft, without
    tps_spec = with_draft["output_tokens"] / with_draft["seconds"]
    tps_base = without["output_tokens"] / without["seconds"]
    report = {
        "mean_acceptance_length": acc["mean_acceptance_length"],
        "acceptance_per_position": acc["acceptance_per_position"],
        "num_speculative_tokens": vc.num_speculative_tokens,
        "num_prompts": len(prompts),
        "eval_set": eval_name,
        "tokens_per_s_spec": tps_spec,
        "tokens_per_s_baseline": tps_base,
        "speedup": tps_spec / tps_base if tps_base else None,
        "greedy_identical": f"{len(prompts) - len(diffs)}/{len(prompts)}" if vc.temperature == 0 else "n/a",
        "greedy_check_dtype": check_dtype if vc.temperature == 0 else None,
        "greedy_differences": [{"prompt": i, "with_draft": tok.decode(shown_with["outputs"][i][:40]),
                                "without": tok.decode(shown_without["outputs"][i][:40])} for i in diffs[:10]],
        "greedy_identical_at_dtype": greedy_at_dtype if vc.temperature == 0 else "n/a",
        "greedy_check": check,
        "output_tokens_spec": with_draft["output_tokens"], "output_tokens_baseline": without["output_tokens"],
        "seconds_spec": with_draft["seconds"], "seconds_baseline": without["seconds"],
        "num_drafts": acc["num_drafts"], "num_draft_tokens": acc["num_draft_tokens"],
        "num_accepted_tokens": acc["num_accepted_tokens"],
        "checkpoint": {"path": prov["checkpoint"], "step": prov.get("step"), "metrics": prov.get("metrics", {})},
        "verifier": {**spec.model_identity, "path": spec.model_path, "layer_ids": spec.layer_ids},
        "device": v.device, "dtype": dtype, "verifier_dtype": v.dtype, "temperature": vc.temperature,
        "vllm_cpu_expand_fix": sampler_fix[0],
        "max_new_tokens": vc.max_new_tokens,
        "max_num_seqs": vc.max_num_seqs, "settings": settings, "wall_seconds": time.time() - t0,
        "created_at": time.time(),
    }
    png = plot_report(report, read_metrics(paths))
    storage.write_bytes_atomic(paths.fs, f"{paths.sub('reports')}/validate.png", png)
    storage.write_json_atomic(paths.fs, rep_path, report)
    report["report_path"] = f"{paths.uri}/reports/validate.json"
    return ValidateReport(report)
