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
import time
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

ConfigOpt = typer.Option(None, "-c", "--config", help="Run config YAML (default: configs/smollm2-135m-cpu.yaml).")
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. data.max_samples=32 extract.max_replicas=2")


def _load(config: Optional[Path], overrides: Optional[list[str]]):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return load_config(config, overrides or [])
    except ConfigError as e:
        console.print(f"[red]config error:[/red] {e}")
        raise typer.Exit(2) from None


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


def _run_prepare(cfg):
    from .prepare import prepare

    s = prepare(cfg)
    t = Table(title="prepare" + (" (already complete: skipped)" if s.skipped else ""))
    t.add_column("field")
    t.add_column("value", justify="right")
    for k, v in [("conversations", s.samples), ("tokens", s.tokens), ("assistant (loss) tokens", s.loss_tokens),
                 ("regenerated answers", s.regenerated), ("seconds", f"{s.seconds:.1f}"),
                 ("bytes written", s.bytes_written), ("rejected records", s.rejected.total), ("output", s.path)]:
        t.add_row(k, str(v))
    console.print(t)
    if s.rejected.total:
        console.print(_rejected_table("rejected records", {"prepare": s.rejected.to_json()}))
    return s


@app.command()
def prepare(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Read prompts, drop held-out and duplicate ones, apply the verifier's chat template, write loss masks.

    With data.regenerate=true the assistant answers are replaced by the verifier's own (vLLM generate).
    Output: <storage>/<run>/conversations/.
    """
    cfg = _load(config, overrides)
    _run_prepare(cfg)


@app.command()
def extract(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
            no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar.")):
    """Stream the verifier's hidden states (aux layers + final pre-norm) into Parquet blocks + manifest.

    Runs prepare first when its output is missing. Resumes an interrupted run: committed samples are
    skipped, none is written twice. Output: <storage>/<run>/hidden_states/.
    """
    from .extract import extract as run_extract

    cfg = _load(config, overrides)
    _run_prepare(cfg)
    s = run_extract(cfg, progress=not no_progress)
    t = Table(title="extract" + (" (already complete: skipped)" if s.skipped else ""))
    t.add_column("field")
    t.add_column("value", justify="right")
    rows = [("samples (this run)", s.samples), ("tokens (this run)", s.tokens),
            ("tokens/s (extraction loop)", f"{s.tokens_per_s:.0f}"), ("seconds (loop / stage)",
            f"{s.seconds:.1f} / {s.wall_seconds:.1f}"), ("blocks committed", s.blocks),
            ("bytes written", s.bytes_written), ("largest batch (tokens)", s.batch_tokens_max),
            ("samples already committed (resumed)", s.resumed_from), ("orphan blocks removed (start / end)",
            f"{s.orphans_removed} / {s.orphans_removed_end}"), ("unit retries (replica failures)", s.retries),
            ("samples in manifest", s.total_samples), ("tokens in manifest", s.total_tokens), ("output", s.path)]
    for k, v in rows:
        t.add_row(k, str(v))
    console.print(t)
    if any((r or {}).get("counts") for r in s.rejected.values()):
        console.print(_rejected_table("rejected records", s.rejected))


def _kv_table(title: str, rows) -> Table:
    t = Table(title=title)
    t.add_column("field")
    t.add_column("value", justify="right")
    for k, v in rows:
        t.add_row(k, v if isinstance(v, str) else (f"{v:.4f}" if isinstance(v, float) else str(v)))
    return t


@app.command()
def vocab(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Build the draft vocabulary (d2t offsets, t2d mask) from extract's loss-masked token frequencies."""
    from .vocab import build_vocab

    cfg = _load(config, overrides)
    s = build_vocab(cfg)
    console.print(_kv_table("vocab" + (" (already built: skipped)" if s.skipped else ""), [
        ("draft vocabulary", s.draft_vocab_size), ("target vocabulary", s.target_vocab_size),
        ("coverage of training answer tokens", s.coverage), ("output", s.path)]))


def _acc_rows(prefix: str, m: dict, k: int):
    return [(f"{prefix} acc pos {i}", m.get(f"val_full_acc_{i}", float("nan"))) for i in range(k)]


@app.command()
def train(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Train the EAGLE-3 draft on Ray Train (TorchTrainer) from the committed hidden-state blocks.

    Resumes from the latest checkpoint when re-run; a finished run does nothing. Checkpoints, metrics
    and the best checkpoint go to <storage>/<run>/checkpoints/.
    """
    from .train import train as run_train
    from .vocab import build_vocab

    cfg = _load(config, overrides)
    build_vocab(cfg)
    s = run_train(cfg)
    k = cfg.train.ttt_steps
    rows = [("steps", s.steps), ("resumed from step", "-" if s.resumed_from is None else s.resumed_from),
            ("best step", s.best_step), ("seconds", f"{s.seconds:.1f}")]
    rows += _acc_rows("untrained held-out", s.untrained_metrics, k) if s.untrained_metrics else []
    rows += _acc_rows("best held-out", s.best_metrics, k)
    rows += [("tokens/s (last interval)", s.final_metrics.get("tokens_per_s", float("nan"))),
             ("best checkpoint", s.checkpoint)]
    console.print(_kv_table("train" + (" (already complete: skipped)" if s.skipped else ""), rows))


@app.command()
def export(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Write the best checkpoint as a speculators-format draft that stock vLLM loads, then check it."""
    from .check import check_draft
    from .export import export as run_export
    from .verifier import VerifierSpec

    cfg = _load(config, overrides)
    s = run_export(cfg)
    console.print(_kv_table("export" + (" (already exported: skipped)" if s.skipped else ""), [
        ("checkpoint step", s.step), ("files", ", ".join(s.files)), ("output", s.path)]))
    rep = check_draft(s.path, VerifierSpec.from_config(cfg).model_path)
    console.print(rep.render())
    if not rep.ok:
        raise typer.Exit(1)


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
        from .check import check_draft

        if verifier is None:
            raise typer.BadParameter("--draft needs --verifier (folder or config.json)")
        rep = check_draft(draft, verifier)
        print(rep.render())
        if not rep.ok:
            raise typer.Exit(1)
        return
    from .preflight import PreflightError, preflight, render

    cfg = _load(config, overrides)
    nodes = None
    if cluster:
        import ray

        from .machine import ensure_ray

        ensure_ray(cfg)
        nodes = ray.nodes()
    try:
        rep = preflight(cfg, str(config or "configs/smollm2-135m-cpu.yaml"), nodes)
    except PreflightError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    print(json.dumps(rep.to_json(), indent=1) if as_json else render(rep))
    if not rep.ok:
        raise typer.Exit(1)


def _print_validation(r: dict) -> None:
    rows = [
        ("eval set / prompts", f"{r['eval_set']} / {r['num_prompts']}"),
        ("num_speculative_tokens (k)", r["num_speculative_tokens"]),
        ("compute dtype", r.get("dtype")),
        ("mean acceptance length", r["mean_acceptance_length"]),
        ("acceptance per position", ", ".join(f"{a:.3f}" for a in r["acceptance_per_position"])),
        ("output tokens/s with draft", r["tokens_per_s_spec"]), ("output tokens/s without", r["tokens_per_s_baseline"]),
        ("speedup", r["speedup"])]
    check = r.get("greedy_check")
    if check:
        rows += [(f"greedy outputs identical ({check['dtype']})", r["greedy_identical"]),
                 (f"  acceptance length ({check['dtype']})", check["mean_acceptance_length"]),
                 (f"  greedy identical ({r.get('dtype')}, batch numerics)", r["greedy_identical_at_dtype"])]
    else:
        rows.append(("greedy outputs identical", r["greedy_identical"]))
    rows.append(("checkpoint step", r["checkpoint"]["step"]))
    console.print(_kv_table("validate" + (" (already validated: skipped)" if r.get("skipped") else ""), rows))


@app.command()
def validate(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg):
    """Serve the exported draft in vLLM (eagle3) and without it on held-out prompts; write reports/validate.json.

    Reports mean acceptance length, acceptance per position, tokens/s with and without the draft,
    the speedup, and whether greedy outputs are identical (at validation.greedy_check_dtype when it is
    set: bf16 on CPU is not batch-invariant). A PNG plot sits beside the JSON.
    """
    from .validate import validate as run_validate

    cfg = _load(config, overrides)
    _print_validation(run_validate(cfg))


@app.command()
def run(config: Optional[Path] = ConfigOpt, overrides: Optional[list[str]] = OverridesArg,
        no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars.")):
    """The whole pipeline: prepare -> extract -> vocab -> train -> export -> check -> validate.

    Each stage is skipped when its committed output already matches the config, so an interrupted
    run resumes where it stopped. With no arguments it runs configs/smollm2-135m-cpu.yaml.
    """
    from .check import check_draft
    from .export import export as run_export
    from .extract import extract as run_extract
    from .train import train as run_train
    from .validate import validate as run_validate
    from .verifier import VerifierSpec
    from .vocab import build_vocab

    cfg = _load(config, overrides)
    t0 = time.time()
    stamps = []

    def stage(name, fn):
        t = time.time()
        console.rule(f"[bold]{name}")
        out = fn()
        stamps.append((name, time.time() - t))
        return out

    stage("prepare", lambda: _run_prepare(cfg))
    s = stage("extract", lambda: run_extract(cfg, progress=not no_progress))
    console.print(f"extract: {s.total_samples} samples, {s.total_tokens} tokens in the manifest"
                  + (" (already complete)" if s.skipped else f", {s.tokens_per_s:.0f} tok/s this run"))
    vs = stage("vocab", lambda: build_vocab(cfg))
    console.print(f"vocab: {vs.draft_vocab_size} tokens cover {vs.coverage:.3f} of training answer tokens")
    ts = stage("train", lambda: run_train(cfg))
    console.print(f"train: {ts.steps} steps" + (" (already complete)" if ts.skipped else "")
                  + (f"; held-out acc pos0 untrained {ts.untrained_metrics.get('val_full_acc_0', float('nan')):.3f}"
                     if ts.untrained_metrics else "")
                  + f"; best {ts.best_metrics.get('val_full_acc_0', float('nan')):.3f} at step {ts.best_step}")
    ex = stage("export", lambda: run_export(cfg))
    rep = stage("check", lambda: check_draft(ex.path if ex.local_dir is None else ex.local_dir,
                                             VerifierSpec.from_config(cfg).model_path))
    console.print(rep.render())
    if not rep.ok:
        raise typer.Exit(1)
    r = stage("validate", lambda: run_validate(cfg))
    _print_validation(r)
    console.print(_kv_table("stage wall times (s)", [(n, f"{d:.1f}") for n, d in stamps]
                            + [("total", f"{time.time() - t0:.1f}")]))
    console.print(f"report: {storage.run_paths(cfg).uri}/reports/validate.json (+ validate.png)")
    console.print(f"mean acceptance length {r['mean_acceptance_length']:.3f} at k={r['num_speculative_tokens']} on "
                  f"{r['num_prompts']} {r['eval_set']} prompts; speedup {r['speedup']:.2f}; greedy identical "
                  f"{r['greedy_identical']}")


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
    from ray import serve

    from .verifier_service import running_verifiers, stop_verifier
    from .verifier import VerifierSpec

    cfg = _cluster_cfg(config, overrides)
    if all_:
        names = list(running_verifiers())
        for n in names:
            serve.delete(n)
        console.print(f"stopped {len(names)} verifier service(s)")
        return
    stopped = stop_verifier(VerifierSpec.from_config(cfg))
    console.print("stopped" if stopped else "no verifier service of this config was running")


def main() -> None:
    from .verifier_service import VerifierMismatch

    try:
        app()
    except VerifierMismatch as e:
        console.print(f"[red]error:[/red] {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: committed work is kept; re-run the same command to resume[/yellow]")
        sys.exit(130)


if __name__ == "__main__":
    main()
