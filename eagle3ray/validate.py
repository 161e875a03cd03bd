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
    """``reports/validate.json`` as a dict (the fields DESIGN.md lists and more), plus how the CLI shows it.

    Top-level figures are those of the first of ``validation.temperatures``; ``temperatures`` holds every
    temperature's, ``by_category`` the first temperature's per eval-set category, ``reference_drafts`` the drafts
    validated beside the run's (``validate --draft DIR``), ``gate`` the acceptance gate's verdict.
    """

    @property
    def title(self) -> str:
        return "validate" + (" (already validated: skipped)" if self.get("skipped") else "")

    @property
    def ok(self) -> bool:
        """False when ``validation.min_acceptance_length`` is set and the draft scored below it (the pipeline
        then raises :class:`eagle3ray.pipeline.StageFailed`, after the report is written)."""
        gate = self.get("gate")
        return not gate or gate["passed"]

    def rows(self, compact: bool = False) -> list[tuple[str, object]]:
        """(label, value) rows for the CLI's table (``compact``: without the per-category row, which wraps to
        several lines; `run`'s closing table, kept short)."""
        r = self
        t0 = r.get("temperature", 0.0)
        rows = [
            ("eval set / prompts", f"{r['eval_set']} / {r['num_prompts']}"
             + ("" if r.get("eval_held_out", True) else " (NOT held out: add it to data.eval)")),
            ("num_speculative_tokens (k)", r["num_speculative_tokens"]),
            ("compute dtype", r.get("dtype")),
            (f"mean acceptance length (T={t0:g})", r["mean_acceptance_length"]),
            ("acceptance per position", ", ".join(f"{a:.3f}" for a in r["acceptance_per_position"]))]
        cats = r.get("by_category") or {}
        if len(cats) > 1 and not compact:
            rows.append(("acceptance length by category",
                         ", ".join(f"{c} {v['mean_acceptance_length']:.2f}" for c, v in cats.items())))
        rows += [("output tokens/s with draft", r["tokens_per_s_spec"]),
                 ("output tokens/s without", r["tokens_per_s_baseline"]), ("speedup", r["speedup"])]
        for t in (r.get("temperatures") or [])[1:]:
            rows.append((f"at T={t['temperature']:g}: acceptance length / per position / speedup",
                         f"{t['mean_acceptance_length']:.3f} / "
                         f"{', '.join(f'{a:.3f}' for a in t['acceptance_per_position'])} / {t['speedup']:.2f}"))
        greedy = r.get("greedy_check")
        if greedy:
            rows += [(f"greedy outputs identical ({greedy['dtype']})", r["greedy_identical"]),
                     (f"  acceptance length ({greedy['dtype']})", greedy["mean_acceptance_length"]),
                     (f"  greedy identical ({r.get('dtype')}, batch numerics)", r["greedy_identical_at_dtype"])]
        else:
            rows.append(("greedy outputs identical (T=0)", r["greedy_identical"]))
        if any(t["temperature"] > 0 for t in r.get("temperatures") or [{"temperature": t0}]):
            rows.append(("CPU sampler fix (vLLM #55005)", r.get("vllm_cpu_expand_fix", "none: figures not trusted")))
        for ref in r.get("reference_drafts") or []:
            rows.append((f"reference draft {ref['label']}", "; ".join(
                f"T={t['temperature']:g}: {t['mean_acceptance_length']:.3f} "
                f"({', '.join(f'{a:.3f}' for a in t['acceptance_per_position'])})" for t in ref["temperatures"])))
        gate = r.get("gate")
        if gate:
            rows.append(("acceptance gate", f"{'passed' if gate['passed'] else 'FAILED'}: "
                         f"{r['mean_acceptance_length']:.3f} vs min_acceptance_length {gate['min_acceptance_length']}"))
        return rows + [("checkpoint step", r["checkpoint"]["step"])]

    def headline(self) -> str:
        t0 = self.get("temperature", 0.0)
        return (f"mean acceptance length {self['mean_acceptance_length']:.3f} at k={self['num_speculative_tokens']}"
                f"{f', T={t0:g}' if t0 else ''} on {self['num_prompts']} {self['eval_set']} prompts; speedup "
                f"{self['speedup']:.2f}; greedy identical {self['greedy_identical']}"
                + ("" if self.ok else f"; BELOW the gate min_acceptance_length={self['gate']['min_acceptance_length']}"))


def eval_prompt_ids(model_path: str, specs, max_prompts: int,
                    balance_categories: bool = True) -> tuple[list[list[int]], str, list[str]]:
    """The evaluation prompts as token ids (the verifier's chat template with the generation prompt), the set's
    name, and each prompt's category (:func:`eagle3ray.sources.first_turn_prompts`): what both validation
    engines decode."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    ev = first_turn_prompts(specs, max_prompts, balance_categories)
    prompts = []
    for c in ev.convs:
        ids = tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts, ev.name, ev.categories


def _local_export(paths: storage.RunPaths) -> str:
    """The export folder as a local path (downloaded from object storage when needed)."""
    src = paths.sub("export")
    if storage.is_local(paths.fs):
        return src
    dst = tempfile.mkdtemp(prefix="eagle3ray-export-")
    paths.fs.get(src + "/", dst + "/", recursive=True)
    return dst


def _series(report: dict) -> list[tuple[str, dict]]:
    """(label, figures) of every draft x temperature in the report: the run's draft first."""
    out = [(f"this draft, T={t['temperature']:g}", t) for t in report.get("temperatures") or [report]]
    for ref in report.get("reference_drafts") or []:
        out += [(f"{ref['label']}, T={t['temperature']:g}", t) for t in ref["temperatures"]]
    return out


def plot_report(report: dict, history: list[dict]) -> bytes:
    """PNG bytes: acceptance rate per position and mean acceptance length per category (bars, one series per
    draft and temperature) and, when present, held-out accuracy per TTT step over training steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    curves = [m for m in history if "val_full_acc_0" in m]
    series = _series(report)
    cats = list((report.get("temperatures") or [report])[0].get("by_category") or {})
    panels = 1 + (len(cats) > 1) + bool(curves)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels + 0.5, 4.2))
    axes = list(np.atleast_1d(axes))
    width = 0.8 / len(series)
    ax = axes.pop(0)
    for j, (label, fig_) in enumerate(series):
        acc = fig_["acceptance_per_position"]
        xs = np.arange(len(acc)) + (j - (len(series) - 1) / 2) * width
        bars = ax.bar(xs, acc, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(report["acceptance_per_position"])),
                  [str(i + 1) for i in range(len(report["acceptance_per_position"]))])
    ax.set_ylim(0, 1)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_title(f"{report['eval_set']} ({report['num_prompts']} prompts, k={report['num_speculative_tokens']})\n"
                 f"mean acceptance length {report['mean_acceptance_length']:.2f}")
    if len(series) > 1:
        ax.legend(fontsize=7)
    if len(cats) > 1:
        ax = axes.pop(0)
        for j, (label, fig_) in enumerate(series):
            by = fig_.get("by_category") or {}
            xs = np.arange(len(cats)) + (j - (len(series) - 1) / 2) * width
            ax.bar(xs, [by.get(c, {}).get("mean_acceptance_length", np.nan) for c in cats], width, label=label)
        ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(1, max(1.2, max(v.get("mean_acceptance_length", 1) for _, f in series
                                    for v in (f.get("by_category") or {}).values()) + 0.1))
        ax.set_ylabel("mean acceptance length")
        ax.set_title("by category")
        if len(series) > 1:
            ax.legend(fontsize=7)
    if curves:
        ax = axes.pop(0)
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


def by_category(categories: list[str], histograms: list[list[int]], k: int) -> dict:
    """Acceptance per category from per-request histograms (:func:`eagle3ray.serving_engine.histogram_counters`):
    ``{category: {"num_prompts", "mean_acceptance_length", "acceptance_per_position", "num_drafts"}}``, in the
    order categories first appear; requests without a category are grouped under ``"(none)"``."""
    from .serving_engine import acceptance, histogram_counters

    groups: dict[str, list[list[int]]] = {}
    for c, h in zip(categories, histograms):
        groups.setdefault(c or "(none)", []).append(h)
    out = {}
    for c, hs in groups.items():
        a = acceptance(histogram_counters(hs, k))
        out[c] = {"num_prompts": len(hs), "mean_acceptance_length": a["mean_acceptance_length"],
                  "acceptance_per_position": a["acceptance_per_position"], "num_drafts": a["num_drafts"]}
    return out


def _reference_dir(path: str) -> str:
    """A reference draft folder, checked to look like an exported draft.

    Raises:
        FileNotFoundError: no such folder, or no ``config.json`` in it.
    """
    d = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(d, "config.json")):
        raise FileNotFoundError(f"validation.reference_drafts: {path}: not a draft folder (no config.json); "
                                f"give an exported speculators-format draft (<run>/export)")
    return d


def _reference_label(d: str) -> str:
    """A short name for a reference draft: its run and checkpoint step when its provenance says."""
    try:
        with open(os.path.join(d, "provenance.json")) as f:
            prov = json.load(f)
        return f"{os.path.basename(os.path.dirname(d.rstrip('/')))} step {prov.get('step')}"
    except (OSError, ValueError):
        return os.path.basename(d.rstrip("/"))


def _settings(vc) -> dict:
    """The validation settings a stored report must match to be reused (the gate is applied to any report)."""
    d = json.loads(vc.model_dump_json())
    d.pop("min_acceptance_length", None)
    d.pop("engines_at_once", None)  # how engines start, not what they measure
    d.pop("cpu_kv_cache_gib", None)
    d["reference_drafts"] = [_reference_dir(p) for p in vc.reference_drafts]
    return d


def engines_at_once(vc, device: str) -> int:
    """How many validation engines start together (``validation.engines_at_once``; ``auto``: 2 on CPU, where an
    engine's start is mostly single-threaded imports and loading (``engine_seconds`` in validate.json), 1 on GPU,
    where each engine takes ``verifier.gpu_memory_utilization`` of the GPU)."""
    n = vc.engines_at_once
    return (2 if device == "cpu" else 1) if n == "auto" else int(n)


def _gate(report: dict, vc) -> dict | None:
    if vc.min_acceptance_length is None:
        return None
    return {"min_acceptance_length": vc.min_acceptance_length,
            "passed": report["mean_acceptance_length"] >= vc.min_acceptance_length,
            "temperature": report.get("temperature", 0.0)}


def validate(cfg, force: bool = False) -> ValidateReport:
    """Run the validate stage; returns the report dict (also written to storage).

    For each of ``validation.temperatures`` the same prompts are decoded by the verifier with the run's draft,
    with each of ``validation.reference_drafts``, and alone (one engine at a time). Acceptance comes from vLLM's
    counters (overall) and its per-request histograms (by category; their sums are checked against the
    counters). A stored report with the same draft and settings is reused; the gate
    (``validation.min_acceptance_length``) is applied either way (``ValidateReport.ok``).

    Raises:
        FileNotFoundError: no export (run `eagle3ray export`), or a reference draft that is not a draft folder.
        VerifierMismatch: a pinned verifier service runs another verifier.
        RuntimeError: a temperature > 0 where vLLM's CPU sampler could not be fixed (vLLM #55005), or
            per-request acceptance that does not add up to vLLM's counters.
    """
    import ray
    from transformers import AutoTokenizer

    from .machine import ensure_ray, resolve_dtype
    from .serving_engine import ServingEngine, acceptance, counters_delta, histogram_counters
    from .verifier import VerifierSpec
    from .verifier_service import refuse_if_pinned_differs

    paths = storage.run_paths(cfg)
    prov = read_export_provenance(paths)
    if not prov:
        raise FileNotFoundError(f"{paths.uri}/export: no finished export; run `eagle3ray export`")
    rep_path = f"{paths.sub('reports')}/validate.json"
    vc = cfg.validation
    settings = _settings(vc)
    temps = list(vc.temperatures)
    v = cfg.verifier
    dtype = resolve_dtype(vc.dtype or v.dtype, v.device)
    check_dtype = resolve_dtype(vc.greedy_check_dtype or dtype, v.device)
    wants_check = 0.0 in temps and check_dtype != dtype
    old = storage.read_json(paths.fs, rep_path)
    if old and not force and old.get("checkpoint", {}).get("path") == prov["checkpoint"] \
            and old.get("settings") == settings and old.get("dtype") == dtype and "temperatures" in old \
            and old.get("greedy_check_dtype") == (check_dtype if 0.0 in temps else None) \
            and (max(temps) == 0 or "vllm_cpu_expand_fix" in old):  # T > 0 before the fix: wrong figures
        old["skipped"] = True
        old["gate"] = _gate(old, vc)
        old["report_path"] = f"{paths.uri}/reports/validate.json"
        return ValidateReport(old)
    spec = VerifierSpec.from_config(cfg)
    tok = AutoTokenizer.from_pretrained(spec.model_path)  # decodes greedy differences for the report
    prompts, eval_name, categories = eval_prompt_ids(spec.model_path, vc.eval, vc.max_prompts,
                                                     vc.balance_categories)
    held_out = all(e in cfg.data.eval for e in vc.eval)
    if not held_out:
        log.warning("validation.eval has sets that are not in data.eval: their prompts may have been trained on")
    draft_dir = _local_export(paths)
    refs = settings["reference_drafts"]
    ensure_ray(cfg)
    # validation serves the draft with its own engines, but never against a verifier other than the one
    # pinned on this cluster for these jobs
    refuse_if_pinned_differs(spec)
    from .machine import engine_actor_options

    Engine = ray.remote(**engine_actor_options(v))(ServingEngine)
    common = dict(max_model_len=v.max_model_len, enforce_eager=v.enforce_eager,
                  max_num_seqs=vc.max_num_seqs, cpu_kv_cache_gib=vc.cpu_kv_cache_gib or v.cpu_kv_cache_gib, seed=v.seed,
                  gpu_memory_utilization=v.gpu_memory_utilization, tensor_parallel_size=v.tensor_parallel_size,
                  device=v.device, cpu_threads=v.cpu_threads)
    k = vc.num_speculative_tokens
    sampler_fix: list[str] = []  # what vllm_cpu_fixes.apply() did in each speculative engine
    engine_seconds: list[dict] = []  # per engine: start (actor + import + load), warm-up, decoding (s)

    def label(draft: str | None, dt: str) -> str:
        return f"{'draft ' + draft if draft else 'verifier alone'}, {dt}"

    def get(eng, ref, what: str, lab: str):
        """ray.get with validation.call_timeout_s; a call past it kills the engine and names the call."""
        try:
            return ray.get(ref, timeout=vc.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(eng)
            raise TimeoutError(f"validate: {what} ({lab}) gave no answer in {vc.call_timeout_s:.0f} s "
                               "(validation.call_timeout_s): the engine was killed") from None

    def decode_group(jobs: list[tuple[str | None, str, list[float]]]) -> list[list[dict]]:
        """Engines for ``jobs`` ((draft or None, compute dtype, temperatures) each) started together, so that
        their loads overlap; then each decodes alone, one after the other (no engine loads or decodes while
        another one's speed is timed). Returns, per job, its generate() result at each temperature, with the
        spec-decode counters of that call (``counters``) for a draft engine."""
        t0 = time.time()
        engs = [Engine.remote(spec.model_path, draft_dir=d, dtype=dt, num_speculative_tokens=k, **common)
                for d, dt, _ in jobs]
        try:
            started = [0.0] * len(jobs)
            pending = {e.__ray_ready__.remote(): i for i, e in enumerate(engs)}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=vc.call_timeout_s)
                if not done:
                    i = next(iter(pending.values()))
                    raise TimeoutError(f"validate: the engine's load ({label(*jobs[i][:2])}) gave no answer in "
                                       f"{vc.call_timeout_s:.0f} s (validation.call_timeout_s): the engine was killed")
                i = pending.pop(done[0])
                ray.get(done[0])  # an engine that failed to load raises here
                started[i] = round(time.time() - t0, 2)
            return [decode(eng, *job, started[i], len(jobs)) for i, (eng, job) in enumerate(zip(engs, jobs))]
        finally:
            for e in engs:
                ray.kill(e)

    def decode(eng, draft: str | None, dt: str, ts: list[float], start_s: float, together: int) -> list[dict]:
        lab = label(draft, dt)
        times = {"draft": draft is not None, "dtype": dt, "start_s": start_s, "started_together": together,
                 "warmup_s": 0.0, "decode_s": 0.0}
        if draft:
            fix = get(eng, eng.cpu_fix_status.remote(), "the sampler-fix status", lab)
            if max(ts) > 0 and fix.startswith("failed"):
                raise RuntimeError(
                    f"validation.temperatures={ts}: vLLM's CPU rejection sampler expands the per-token temperature "
                    f"into memory it then drops (vLLM #55005), and eagle3ray's fix could not be applied ({fix}); "
                    f"the acceptance figures would be wrong. Validate at validation.temperatures=[0.0], or with a "
                    f"vLLM that has the fix (PR #55006).")
            sampler_fix.append(fix)
        out = []
        for t in ts:
            # a short warm-up at this temperature first: the first sampling call of a process pays one-time costs
            # (a T > 0 draft engine's first call was 2.3x slower than the next engine's, docs/validation.md)
            tw = time.time()
            get(eng, eng.generate.remote(prompts[:2], 4, t), f"the warm-up at T={t}", lab)
            times["warmup_s"] += round(time.time() - tw, 2)
            tw = time.time()
            before = get(eng, eng.spec_counters.remote(), "the counters", lab) if draft else None
            g = get(eng, eng.generate.remote(prompts, vc.max_new_tokens, t),
                    f"decoding {len(prompts)} prompts at T={t}", lab)
            if draft:
                g["counters"] = counters_delta(get(eng, eng.spec_counters.remote(), "the counters", lab), before)
                summed = histogram_counters(g["accept_histograms"], k)
                if (summed["drafts"], summed["accepted"]) != (g["counters"]["drafts"], g["counters"]["accepted"]):
                    raise RuntimeError(
                        f"vLLM's per-request acceptance ({summed['drafts']} drafts, {summed['accepted']} accepted) "
                        f"does not add up to its counters ({g['counters']['drafts']}, {g['counters']['accepted']}) "
                        f"at T={t}: acceptance by category would be wrong")
            times["decode_s"] += round(time.time() - tw, 2)
            out.append(g)
        ray.kill(eng)  # frees its memory before the next engine decodes
        engine_seconds.append(times)
        log.info("validate: engine %s: started in %.1f s (%d together), warm-up %.1f s, decoding %.1f s", lab,
                 start_s, together, times["warmup_s"], times["decode_s"])
        return out

    def figures(spec_out: dict, base_out: dict, t: float) -> dict:
        acc = acceptance(spec_out["counters"])
        tps_spec = spec_out["output_tokens"] / spec_out["seconds"]
        tps_base = base_out["output_tokens"] / base_out["seconds"]
        diffs = [i for i, (a, b) in enumerate(zip(spec_out["outputs"], base_out["outputs"])) if a != b]
        return {"temperature": t, "mean_acceptance_length": acc["mean_acceptance_length"],
                "acceptance_per_position": acc["acceptance_per_position"],
                "by_category": by_category(categories, spec_out["accept_histograms"], k),
                "tokens_per_s_spec": tps_spec, "tokens_per_s_baseline": tps_base,
                "speedup": tps_spec / tps_base if tps_base else None,
                "greedy_identical": f"{len(prompts) - len(diffs)}/{len(prompts)}" if t == 0 else "n/a (sampling)",
                "num_drafts": acc["num_drafts"], "num_draft_tokens": acc["num_draft_tokens"],
                "num_accepted_tokens": acc["num_accepted_tokens"],
                "output_tokens_spec": spec_out["output_tokens"], "output_tokens_baseline": base_out["output_tokens"],
                "seconds_spec": spec_out["seconds"], "seconds_baseline": base_out["seconds"], "_diffs": diffs}

    t_start = time.time()
    jobs = [(draft_dir, dtype, temps), *[(r, dtype, temps) for r in refs], (None, dtype, temps)]
    if wants_check:
        jobs += [(draft_dir, check_dtype, [0.0]), (None, check_dtype, [0.0])]
    at_once = engines_at_once(vc, v.device)
    results = [r for g in range(0, len(jobs), at_once) for r in decode_group(jobs[g:g + at_once])]
    with_draft, with_refs, without = results[0], results[1:1 + len(refs)], results[1 + len(refs)]
    per_t = [figures(w, b, t) for w, b, t in zip(with_draft, without, temps)]
    ref_reports = [{"path": r, "label": _reference_label(r),
                    "temperatures": [{kk: vv for kk, vv in figures(w, b, t).items() if kk != "_diffs"}
                                     for w, b, t in zip(outs, without, temps)]} for r, outs in zip(refs, with_refs)]
    head = per_t[0]
    greedy = next((f for f in per_t if f["temperature"] == 0), None)
    check = None
    diffs, shown_with, shown_without = [], None, None
    if greedy is not None:
        i0 = temps.index(0.0)
        diffs, shown_with, shown_without = greedy["_diffs"], with_draft[i0], without[i0]
    if wants_check:
        (c_with,), (c_without,) = results[-2:]
        c = figures(c_with, c_without, 0.0)
        check = {"dtype": check_dtype, "mean_acceptance_length": c["mean_acceptance_length"],
                 "acceptance_per_position": c["acceptance_per_position"],
                 "tokens_per_s_spec": c["tokens_per_s_spec"], "tokens_per_s_baseline": c["tokens_per_s_baseline"]}
        diffs, shown_with, shown_without = c["_diffs"], c_with, c_without
    for f in per_t:
        f.pop("_diffs")
    report = {
        **{kk: head[kk] for kk in ("mean_acceptance_length", "acceptance_per_position", "tokens_per_s_spec",
                                   "tokens_per_s_baseline", "speedup", "by_category", "output_tokens_spec",
                                   "output_tokens_baseline", "seconds_spec", "seconds_baseline", "num_drafts",
                                   "num_draft_tokens", "num_accepted_tokens")},
        "num_speculative_tokens": k,
        "num_prompts": len(prompts),
        "eval_set": eval_name,
        "eval_held_out": held_out,
        "temperature": temps[0],
        "temperatures": per_t,
        "reference_drafts": ref_reports,
        "greedy_identical": f"{len(prompts) - len(diffs)}/{len(prompts)}" if greedy is not None else "n/a",
        "greedy_identical_note": "greedy identity is checked at temperature 0 only (sampling differs by design)",
        "greedy_check_dtype": check_dtype if greedy is not None else None,
        "greedy_differences": [{"prompt": i, "with_draft": tok.decode(shown_with["outputs"][i][:40]),
                                "without": tok.decode(shown_without["outputs"][i][:40])} for i in diffs[:10]],
        "greedy_identical_at_dtype": greedy["greedy_identical"] if greedy is not None else "n/a",
        "greedy_check": check,
        "checkpoint": {"path": prov["checkpoint"], "step": prov.get("step"), "metrics": prov.get("metrics", {})},
        "verifier": {**spec.model_identity, "path": spec.model_path, "layer_ids": spec.layer_ids},
        "device": v.device, "dtype": dtype, "verifier_dtype": v.dtype,
        "vllm_cpu_expand_fix": sampler_fix[0],
        "max_new_tokens": vc.max_new_tokens,
        "max_num_seqs": vc.max_num_seqs, "settings": settings, "wall_seconds": time.time() - t_start,
        "engine_seconds": engine_seconds,
        "created_at": time.time(),
    }
    report["gate"] = _gate(report, vc)
    png = plot_report(report, read_metrics(paths))
    storage.write_bytes_atomic(paths.fs, f"{paths.sub('reports')}/validate.png", png)
    storage.write_json_atomic(paths.fs, rep_path, report)
    report["report_path"] = f"{paths.uri}/reports/validate.json"
    return ValidateReport(report)
