"""``eagle3ray`` command line: one sub-command per stage.

Every command takes ``-c CONFIG`` (default: the embedded ``configs/smollm2-135m-cpu.yaml``) and
dotted overrides after it, e.g.::

    eagle3ray prepare -c configs/smollm2-135m-cpu.yaml data.max_samples=32
    eagle3ray extract -c configs/smollm2-135m-cpu.yaml data.max_samples=32 extract.max_tokens_per_batch=2048
    eagle3ray extract run.storage=s3://bucket/runs run.endpoint_url=http://127.0.0.1:9000

Precedence: override > YAML > default. Unknown keys are an error.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from . import storage
from .config import ConfigError, load_config

app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False, no_args_is_help=True, rich_markup_mode="rich",
                  help="Train EAGLE-3 draft heads on Ray: prepare -> extract -> (train, export, validate).")
console = Console(stderr=True)



@app.callback()
def _options(verbose: bool = typer.Option(False, "--verbose", "-v", help="Show everything on the terminal: "
                                          "eagle3ray's INFO log, the actors' output (vLLM's stats, Serve, the Ray "
                                          "Train workers) and Ray Data's progress. Without it they go to "
                                          "<run>/logs/ (driver.log, ray/).")) -> None:
    """Train EAGLE-3 draft heads on Ray: prepare -> extract -> (train, export, validate)."""
    from .logs import set_verbose
    from .logs import verbose as verbose_env

    set_verbose(verbose or verbose_env())


ConfigOpt = typer.Option(None, "-c", "--config", help="Run config YAML (default: configs/smollm2-135m-cpu.yaml).")
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. data.max_samples=32 extract.max_replicas=2")


def _load(config: Optional[Path], overrides: Optional[list[str]], log_file: bool = False):
    """The resolved config; logging set up (:func:`eagle3ray.logs.setup`: a quiet terminal; with ``log_file``,
    for commands that run stages, the run's driver.log)."""
    from .logs import setup

    setup()
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        console.print(f"[red]config error:[/red] {e}")
        raise typer.Exit(2) from None
    if log_file:
        setup(cfg)
    return cfg


def _collect_logs(cfg) -> None:
    from .logs import collect_ray_logs, log_dir

    if collect_ray_logs(cfg):
        console.print(f"logs: {log_dir(cfg)}/ (driver.log; ray/: every actor's and worker's output)", soft_wrap=True)


def _rejected_table(title: str, rejected: dict) -> Table:
    t = Table(title=title, show_header=True)
    t.add_column("stage")
    t.add_column("reason")
    t.add_column("count", justify="right")
    t.add_column("first example")
    for stage, rj in rejected.items():
        for reason, n in (rj or {}).get("counts", {}).items():
            ex = (rj.get("examples", {}).get(reason) or [""])[0]
            t.add_row(stage, reason, str(n), ex[:100])
    return t


def _kv_table(title: str, rows, compact: bool = False) -> Table:
    t = Table(title=title, box=None, show_header=False, title_justify="left") if compact else Table(title=title)
    t.add_column("field")
    t.add_column("value", justify="right")
    for k, v in rows:
        t.add_row(k, v if isinstance(v, str) else (f"{v:.4f}" if isinstance(v, float) else str(v)))
    return t


def _render(summary) -> None:
    """Print a stage summary: its own ``render()`` text, or its ``title`` and ``rows()`` as a table (plus the
    rejected records when it has any)."""
    if hasattr(summary, "render"):
        console.print(summary.render())
        return
    console.print(_kv_table(summary.title, summary.rows()))
    rejected = getattr(summary, "rejected_by_stage", None)
    if rejected:
        console.print(_rejected_table("rejected records", rejected))


def _show_plan(plan: dict, fresh: bool) -> None:
    from .plan import render

    console.print(render(plan, fresh), soft_wrap=True, highlight=False)


def _print_plan(plan: dict, fresh: bool) -> None:
    from .plan import render

    print(render(plan, fresh))


def _gate_failed(e) -> None:
    """Say why a validate stage failed (the acceptance gate) and where its report is; other stages' failures
    were rendered in full already."""
    if e.stage != "validate":
        return
    r = e.summary
    console.print(f"[red]acceptance gate failed:[/red] mean acceptance length {r['mean_acceptance_length']:.3f} "
                  f"< validation.min_acceptance_length {r['gate']['min_acceptance_length']}; report: "
                  f"{r.get('report_path', 'reports/validate.json')}", soft_wrap=True)


def _stage_command(config, overrides, name: str, progress: bool = True) -> None:
    """Run one stage with the stages it needs first (each skipped when done), printing every summary."""
    from .pipeline import StageFailed, run_stage

    from .plan import PlanChanged

    cfg = _load(config, overrides, log_file=True)
    try:
        run_stage(cfg, name, with_needs=True, progress=progress, on_plan=_show_plan,
                  on_stage=lambda ev, _n, summary, _s: _render(summary) if ev == "end" else None)
    except StageFailed as e:
        _gate_failed(e)
        raise typer.Exit(1) from None
    except PlanChanged as e:
        console.print(f"[red]error:[/red] {e}", soft_wrap=True)
        raise typer.Exit(2) from None
    finally:
        _collect_logs(cfg)


@app.command()
def prepare(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Read prompts, drop held-out and duplicate ones, apply the verifier's chat template, write loss masks.

    With data.regenerate=true the assistant answers are replaced by the verifier's own (vLLM generate).
    Output: <storage>/<run>/conversations/.
    """
    _stage_command(config, overrides, "prepare")


@app.command()
def extract(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
            no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar.")):
    """Stream the verifier's hidden states (aux layers + final pre-norm) into Parquet blocks + manifest.

    Runs prepare first when its output is missing. Resumes an interrupted run: committed samples are
    skipped, none is written twice. Output: <storage>/<run>/hidden_states/.
    """
    _stage_command(config, overrides, "extract", progress=not no_progress)


@app.command()
def vocab(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Build the draft vocabulary (d2t offsets, t2d mask) from extract's loss-masked token frequencies."""
    _stage_command(config, overrides, "vocab")


@app.command()
def train(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Train the EAGLE-3 draft on Ray Train (TorchTrainer) from the committed hidden-state blocks.

    Builds the draft vocabulary first when it is missing. Resumes from the latest checkpoint when re-run; a
    finished run does nothing. Checkpoints, metrics and the best checkpoint go to <storage>/<run>/checkpoints/.
    """
    _stage_command(config, overrides, "train")


@app.command()
def export(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Write the best checkpoint as a speculators-format draft that stock vLLM loads, then check it."""
    from .pipeline import StageFailed, run_stage

    cfg = _load(config, overrides)
    _render(run_stage(cfg, "export"))
    try:
        run_stage(cfg, "check", on_stage=lambda ev, _n, summary, _s: _render(summary) if ev == "end" else None)
    except StageFailed:
        raise typer.Exit(1) from None


@app.command()
def check(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
          draft: Optional[str] = typer.Option(None, "--draft", help="Check an exported draft folder instead "
                                              "(config.json + safetensors headers) against --verifier."),
          verifier: Optional[str] = typer.Option(None, "--verifier", help="With --draft: the verifier's folder or "
                                                 "config.json (no weights read)."),
          cluster: bool = typer.Option(False, "--cluster", help="Also check the Ray resources the plan needs "
                                       "against the cluster at ray.address / RAY_ADDRESS."),
          as_json: bool = typer.Option(False, "--json", help="Print the report as JSON.")):
    """Preflight, offline and in seconds: will this config run, and will vLLM load its draft?

    Reads configs only (no weights): the draft it will build (hidden size, heads, head_dim, vocab sizes,
    aux layer ids, the tensor shapes vLLM allocates), vLLM's own eagle3 config hook on it, tensor
    parallelism against the heads, the verifier's memory per GPU for extract.max_tokens_per_batch (and the
    largest budget that fits), hidden-state storage against extract.max_storage_gib, and with --cluster
    the Ray resources. Exit 1 names each problem and the config field to change.

    With --draft/--verifier it checks an exported draft's weights against a verifier instead.
    """
    if draft is not None:
        from .draft_check import check_draft

        if verifier is None:
            raise typer.BadParameter("--draft needs --verifier (folder or config.json)")
        rep = check_draft(draft, verifier)
        print(rep.render())
        if not rep.ok:
            raise typer.Exit(1)
        return
    from .config import DEFAULT_CONFIG
    from .preflight import PreflightError, preflight, render

    cfg = _load(config, overrides)
    from .plan import planned_config

    try:
        cfg = planned_config(cfg, on_plan=_print_plan)
    except RuntimeError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    nodes = None
    if cluster:
        import ray

        from .machine import ensure_ray

        ensure_ray(cfg)
        nodes = ray.nodes()
    try:
        rep = preflight(cfg, str(config or DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parent.parent)), nodes)
    except PreflightError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    print(json.dumps(rep.to_json(), indent=1) if as_json else render(rep))
    if not rep.ok:
        raise typer.Exit(1)


@app.command()
def plan(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
         replan: bool = typer.Option(False, "--replan", help="Probe this machine again and replace <run>/plan.json "
                                     "(before the run's first stage: a finished stage keeps its sizes only if "
                                     "the new plan gives the same)."),
         as_json: bool = typer.Option(False, "--json", help="Print plan.json.")):
    """The run's plan for run.time_budget: sizes set to `plan` (data.max_samples, train.max_steps) chosen for
    this machine, and the estimated minutes per stage.

    The first command of a run that needs the plan probes this machine (a vLLM engine load, prefill and
    decode rates, a few draft training steps: about a minute on 2 cores) and writes <run>/plan.json; every
    later command of the run reads it. Explicit numbers in the config or on the command line are kept.
    """
    from .plan import needs_plan, planned_config, read_plan, render

    cfg = _load(config, overrides)
    if not needs_plan(cfg):
        console.print("nothing to plan: no size of this config says `plan` (set run.time_budget and "
                      "data.max_samples=plan and/or train.max_steps=plan)")
        old = read_plan(cfg)
        if old:
            print(json.dumps(old, indent=1) if as_json else render(old, False))
        return
    try:
        planned_config(cfg, replan=replan,
                       on_plan=lambda p, fresh: print(json.dumps(p, indent=1) if as_json else render(p, fresh)))
    except RuntimeError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None


@app.command()
def validate(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
             draft: Optional[list[str]] = typer.Option(
                 None, "--draft", help="Another exported draft folder (same verifier) to validate beside the run's, "
                 "on the same prompts and settings; repeatable (= validation.reference_drafts).")):
    """Serve the exported draft in vLLM (eagle3) and without it on held-out prompts; write reports/validate.json.

    Reports mean acceptance length, acceptance per position and by category (MT-Bench's 8), at each of
    validation.temperatures, tokens/s with and without the draft, the speedup, and whether greedy outputs are
    identical at temperature 0 (at validation.greedy_check_dtype when it is set: bf16 on CPU is not
    batch-invariant). A PNG plot sits beside the JSON. With validation.min_acceptance_length set, exits 1
    when the draft scores below it (after writing the report). Example:

        eagle3ray validate "validation.temperatures=[0.0,0.7]" --draft runs/older/export
    """
    if draft:
        overrides = [*(overrides or []), f"validation.reference_drafts={json.dumps(list(draft))}"]
    _stage_command(config, overrides, "validate")


@app.command()
def run(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
        no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars.")):
    """The whole pipeline: prepare -> extract -> vocab -> train -> export -> check -> validate.

    Each stage is skipped when its committed output already matches the config, so an interrupted
    run resumes where it stopped. With no arguments it runs configs/smollm2-135m-cpu.yaml.
    The same pipeline from Python: ``eagle3ray.pipeline.run(cfg)``.
    """
    from .pipeline import StageFailed
    from .pipeline import run as run_pipeline

    cfg = _load(config, overrides, log_file=True)

    from .logs import verbose

    def show(event: str, name: str, summary, seconds: float) -> None:
        if event == "start":
            console.print(f"[bold]{name}[/bold] ..." + (f" {summary}" if summary else ""), soft_wrap=True)
        elif verbose() and name in ("prepare", "check", "validate"):
            _render(summary)
        elif getattr(summary, "ok", True) is False:
            _render(summary)  # a failed check: every problem, in full
        else:
            line = summary.headline() if hasattr(summary, "headline") else summary.title
            console.print(f"[bold]{name}[/bold] done in {seconds:.0f} s: {line}", soft_wrap=True)

    from .plan import PlanChanged

    try:
        result = run_pipeline(cfg, progress=not no_progress, on_stage=show, on_plan=_show_plan)
    except StageFailed as e:
        _gate_failed(e)
        raise typer.Exit(1) from None
    except PlanChanged as e:
        console.print(f"[red]error:[/red] {e}", soft_wrap=True)
        raise typer.Exit(2) from None
    finally:
        _collect_logs(cfg)
    est = (result.plan or {}).get("estimates", {})
    refit = (result.plan or {}).get("refit") or {}

    def planned(n: str) -> str:
        if n not in est:
            return ""
        return f"  (plan {est[n]:.0f}" + (f"; re-fitted {refit['train_s']:.0f})" if n == "train" and refit else ")")

    console.print(_kv_table("stage wall times (s)" + (", planned" if est else ""),
                            [(n, f"{d:.1f}" + planned(n)) for n, d in result.seconds.items()]
                            + [("total", f"{result.total_seconds:.1f}"
                                + (f"  (plan {result.plan['total_s']:.0f}, budget {result.plan['budget_s']:.0f})"
                                   if est else ""))], compact=True))
    if not verbose():
        console.print(_kv_table(result.summaries["validate"].title, result.summaries["validate"].rows(compact=True),
                                compact=True))
    console.print(f"report: {storage.run_paths(cfg).uri}/reports/validate.json (+ validate.png)", soft_wrap=True)
    console.print(result.summaries["validate"].headline(), soft_wrap=True)


@app.command()
def verify(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
           repair: bool = typer.Option(False, "--repair", help="Drop missing or corrupt blocks from the manifest so "
                                       "that `eagle3ray extract` extracts their samples again."),
           size_only: bool = typer.Option(False, "--size-only", help="Check existence and size only (no sha256)."),
           audit: int = typer.Option(0, "--audit", help="Also recompute this many committed samples' states with a "
                                     "transformers forward of the verifier and compare them per layer id.")):
    """Check every committed hidden-state block against its manifest entry (exists, size, sha256).

    Exit 1 when a block is missing or corrupt (each is named), or with --audit N when the audited states are not
    the verifier's at their layer ids (each layer named: an off-by-one says which layer the states match); with
    --repair missing or corrupt blocks are dropped from the manifest instead (exit 0) and the next extract
    redoes exactly their samples. The audit only reads (the manifest keeps extraction's own audit record).
    """
    from .verify import verify as run_verify

    cfg = _load(config, overrides)
    try:
        s = run_verify(cfg, repair=repair, sha256=not size_only)
    except FileNotFoundError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    print(s.render())
    ok = s.ok
    if audit:
        from . import blocks, storage
        from .audit import audit_run
        from .verifier import VerifierSpec

        paths = storage.run_paths(cfg)
        data, _ = blocks.read_committed(paths.fs, paths.hidden_states)
        spec = VerifierSpec.from_config(cfg)
        rec = audit_run(paths.fs, paths.hidden_states, data, spec.model_path, audit,
                        data["verifier"].get("compute_dtype", spec.dtype), cfg.verifier.device, spec.engine)
        if rec.get("skipped"):
            print(f"audit skipped: {rec['skipped']}")
        else:
            print(f"audit of {len(rec['samples'])} samples ({rec['tokens']} tokens) against {rec['reference']}: "
                  f"{'passed' if rec['passed'] else 'FAILED'} (tolerance {rec['tolerance']:.3g})")
            for i, v in rec["layers"].items():
                print(f"  layer {i}: mean relative error {v['mean_rel_err']:.2e}, max {v['max_rel_err']:.2e}")
            for p in rec["problems"]:
                print(f"  PROBLEM {p}")
            ok = ok and rec["passed"]
    if not ok:
        raise typer.Exit(1)


config_app = typer.Typer(no_args_is_help=True, help="Inspect run configs: the resolved values and every key.")
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
                as_yaml: bool = typer.Option(False, "--yaml", help="Print the resolved config as YAML only "
                                             "(what the run records as config.resolved.yaml).")):
    """The resolved config, one key per line, with where each value came from: default (the schema), yaml
    (the file), override (the command line) or resolved (settled for this machine, e.g. verifier.dtype auto)."""
    from .config import explain

    try:
        if as_yaml:
            print(load_config(config, overrides or []).to_yaml(), end="")
            return
        rows = explain(config, overrides or [])
    except ConfigError as e:
        console.print(f"[red]config error:[/red] {e}")
        raise typer.Exit(2) from None
    width = max(len(r["key"]) for r in rows)
    for r in rows:
        print(f"{r['key']:<{width}}  {json.dumps(r['value'])}  [{r['source']}]")


@config_app.command("keys")
def config_keys(section: Optional[str] = typer.Argument(None, help="Only this section (e.g. train)."),
                as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Every config key with its type, default and description (the schema in eagle3ray/config.py)."""
    from .config import describe_keys

    rows = [r for r in describe_keys() if section is None or r["key"].split(".")[0] == section]
    if not rows:
        console.print(f"[red]error:[/red] no config section {section!r}")
        raise typer.Exit(2)
    if as_json:
        print(json.dumps(rows, indent=1, default=str))
        return
    for r in rows:
        if r["type"] == "section":
            print(f"\n[{r['key']}] {r['description']}")
        else:
            print(f"  {r['key']} ({r['type']}, default {json.dumps(r['default'], default=str)})"
                  + (f": {r['description']}" if r["description"] else ""))


verifier_app = typer.Typer(no_args_is_help=True, help="A long-lived verifier service kept up between jobs.")
app.add_typer(verifier_app, name="verifier")


def _cluster_cfg(config, overrides):
    import os

    cfg = _load(config, overrides)
    if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
        console.print("[red]error:[/red] a verifier service outlives this command only on a running cluster: set "
                      "ray.address (e.g. ray.address=auto) or RAY_ADDRESS; start one with `ray start --head`")
        raise typer.Exit(2)
    from .machine import ensure_ray

    ensure_ray(cfg)
    return cfg


@verifier_app.command("start")
def verifier_start(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Start (or find) the verifier service of CONFIG and pin it: it stays up between jobs, and stages whose
    verifier differs refuse to start another one (they name the differing fields) until it is stopped."""
    from .verifier_service import VerifierMismatch, app_name, start_for_config
    from .verifier import VerifierSpec

    cfg = _cluster_cfg(config, overrides)
    try:
        start_for_config(cfg, pinned=True)
    except VerifierMismatch as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
    console.print(f"verifier service {app_name(VerifierSpec.from_config(cfg))} is up (pinned)")


@verifier_app.command("status")
def verifier_status(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
                    as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Every eagle3ray verifier service on the cluster: identity, replicas, load time, uptime, requests
    served, tokens processed, and whether it matches CONFIG's verifier."""
    from .verifier_service import app_name, running_verifiers
    from .verifier import VerifierSpec

    cfg = _cluster_cfg(config, overrides)
    mine = app_name(VerifierSpec.from_config(cfg))
    apps = running_verifiers()
    if as_json:
        print(json.dumps({n: {**i, "matches_config": n == mine} for n, i in apps.items()}, indent=1, default=str))
        return
    if not apps:
        console.print("no verifier service is running")
        return
    t = Table(title="verifier services")
    for col in ("application", "status", "replicas", "pinned", "model", "TP", "layer ids", "load s", "uptime s",
                "requests", "tokens", "matches config"):
        t.add_column(col)
    for n, i in apps.items():
        ident = i.get("identity", {})
        t.add_row(n, i["status"], str(i.get("replica_states", "")), str(i.get("pinned", "")),
                  str(ident.get("model_identity", {}).get("name", "")), str(ident.get("tensor_parallel_size", "")),
                  str(ident.get("layer_ids", "")), f"{i.get('load_seconds', 0):.1f}",
                  f"{i.get('uptime_seconds', 0):.0f}", str(i.get("extract_calls", 0) + i.get("generate_calls", 0)),
                  str(i.get("tokens", 0)), "yes" if n == mine else "no")
    console.print(t)


@verifier_app.command("stop")
def verifier_stop(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
                  all_: bool = typer.Option(False, "--all", help="Stop every eagle3ray verifier service.")):
    """Stop CONFIG's verifier service (or --all of them); the GPUs are released."""
    from .verifier_service import stop_all_verifiers, stop_verifier
    from .verifier import VerifierSpec

    cfg = _cluster_cfg(config, overrides)
    if all_:
        console.print(f"stopped {len(stop_all_verifiers())} verifier service(s)")
        return
    stopped = stop_verifier(VerifierSpec.from_config(cfg))
    console.print("stopped" if stopped else "no verifier service of this config was running")


def main() -> None:
    from .audit import AuditFailed
    from .lease import LeaseHeld, exit_on_sigterm
    from .machine import UnguardedClusterError
    from .verifier_service import VerifierMismatch

    exit_on_sigterm()
    try:
        app()
    except (VerifierMismatch, LeaseHeld, AuditFailed, UnguardedClusterError) as e:
        console.print(f"[red]error:[/red] {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: committed work is kept; re-run the same command to resume[/yellow]")
        sys.exit(130)


if __name__ == "__main__":
    main()
