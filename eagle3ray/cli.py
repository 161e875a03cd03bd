"""``eagle3ray`` command line: one sub-command per stage.

Every command takes ``-c CONFIG`` (default: the embedded ``configs/smollm2-135m-cpu.yaml``) and
dotted overrides after it, e.g.::

    eagle3ray prepare -c configs/smollm2-135m-cpu.yaml data.max_samples=32
    eagle3ray extract -c configs/smollm2-135m-cpu.yaml data.max_samples=32 extract.max_tokens_per_batch=2048
    eagle3ray extract run.storage=s3://bucket/runs run.endpoint_url=http://127.0.0.1:9000

Precedence: override > YAML > default. Unknown keys are an error.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .config import ConfigError, load_config

app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False, no_args_is_help=True, rich_markup_mode="rich",
                  help="Train EAGLE-3 draft heads on Ray: prepare -> extract -> (train, export, validate).")
console = Console(stderr=True)

ConfigOpt = typer.Option(None, "-c", "--config", help="Run config YAML (default: configs/smollm2-135m-cpu.yaml).")
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. data.max_samples=32 extract.max_actors=2")


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
            ("samples already committed (resumed)", s.resumed_from), ("orphan blocks removed", s.orphans_removed),
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
def check(draft: str = typer.Option(..., "--draft", help="Exported draft folder (config.json + safetensors)."),
          verifier: str = typer.Option(..., "--verifier", help="Verifier folder or its config.json (no weights read).")):
    """Offline: will stock vLLM load this EAGLE-3 draft for this verifier? Exit 1 names each problem."""
    from .check import check_draft

    rep = check_draft(draft, verifier)
    print(rep.render())
    if not rep.ok:
        raise typer.Exit(1)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: committed work is kept; re-run the same command to resume[/yellow]")
        sys.exit(130)


if __name__ == "__main__":
    main()
