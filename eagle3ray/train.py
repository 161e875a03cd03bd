"""Stage ``train``: the driver that trains the EAGLE-3 draft head on Ray Train from the committed blocks.

The worker side (the training step, the checkpoint layout, the loop) is :mod:`eagle3ray.train_worker`. Here:

- the blocks' manifest is checked against the draft this config builds (layer ids, verifier identity);
- checkpoints made with other settings are moved aside (``checkpoints.superseded-<n>``), never resumed;
- ``TorchTrainer`` with ``num_workers`` x ``cpus_per_worker`` (gloo) or one GPU each (NCCL), the held-out
  slice of blocks as the ``val`` dataset, ``FailureConfig(max_failures)`` to restart a crashed worker group
  from its last checkpoint; re-running the same run continues from the latest checkpoint (same ``RunConfig``
  name/storage);
- afterwards the best checkpoint (held-out step-0 accuracy) is recorded.

Layout: ``<run>/checkpoints/train/checkpoint_*`` (Ray Train; :class:`eagle3ray.train_worker.WorkerCheckpoint`),
``metrics.jsonl`` (one line per report, for plots), ``best.json``, ``complete.json``, ``settings.json``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from . import blocks, code_fingerprint, storage
from .artifacts import load_vocab, read_metrics, read_vocab_meta
from .machine import cpu_engine_env, resolve_autocast
from .train_worker import NonFiniteLoss, NonFiniteMarker, WorkerCheckpoint, WorkerHooks, train_loop_per_worker

log = logging.getLogger(__name__)

@dataclass
class TrainSummary:
    steps: int = 0
    resumed_from: int | None = None
    best_step: int | None = None
    best_metrics: dict = field(default_factory=dict)
    untrained_metrics: dict = field(default_factory=dict)
    final_metrics: dict = field(default_factory=dict)
    seconds: float = 0.0
    skipped: bool = False
    checkpoint: str = ""
    ttt_steps: int = 0
    hybrid: dict | None = None  # train.data_source hybrid: what the stream committed (eagle3ray.online.finish_hybrid)

    @property
    def title(self) -> str:
        return "train" + (" (already complete: skipped)" if self.skipped else "")

    def _acc(self, prefix: str, m: dict) -> list[tuple[str, object]]:
        return [(f"{prefix} acc pos {i}", m.get(f"val_full_acc_{i}", float("nan"))) for i in range(self.ttt_steps)]

    def rows(self) -> list[tuple[str, object]]:
        """(label, value) rows for the CLI's table."""
        rows = [("steps", self.steps), ("resumed from step", "-" if self.resumed_from is None else self.resumed_from),
                ("best step", self.best_step), ("seconds", f"{self.seconds:.1f}")]
        rows += self._acc("untrained held-out", self.untrained_metrics) if self.untrained_metrics else []
        rows += self._acc("best held-out", self.best_metrics)
        rows += [("tokens/s (last interval)", self.final_metrics.get("tokens_per_s", float("nan"))),
                 ("best checkpoint", self.checkpoint)]
        if self.hybrid:
            h = self.hybrid
            rows += [("hybrid: samples committed (this run / in all / of)",
                      f"{h.get('samples_committed', 0)} / {h['committed']} / {h['expected']}"),
                     ("hybrid: samples read back from committed blocks", h.get("samples_from_storage", 0)),
                     ("hybrid: hidden_states/ complete", h["complete"])]
        return rows

    def headline(self) -> str:
        nan = float("nan")
        return (f"train: {self.steps} steps" + (" (already complete)" if self.skipped else "")
                + (f"; held-out acc pos0 untrained {self.untrained_metrics.get('val_full_acc_0', nan):.3f}"
                   if self.untrained_metrics else "")
                + f"; best {self.best_metrics.get('val_full_acc_0', nan):.3f} at step {self.best_step}")


def _check_manifest(man: dict, spec, where: str) -> None:
    """Refuse blocks that disagree with the draft this config builds (names the field)."""
    if man.get("layer_ids") != spec.layer_ids:
        raise blocks.ManifestMismatch(f"{where}: field 'layer_ids' is {man.get('layer_ids')} in the blocks but "
                                      f"{spec.layer_ids} for this config's verifier.aux_layer_ids")
    for key in ("hidden_size", "num_hidden_layers", "config_hash", "tokenizer_hash", "chat_template_hash",
                "vocab_size"):
        a, b = man.get("verifier", {}).get(key), spec.model_identity.get(key)
        if a != b:
            raise blocks.ManifestMismatch(f"{where}: field 'verifier.{key}' is {a!r} in the blocks but {b!r} for "
                                          "this config's verifier")


# Train fields that do not change what a step computes: extending max_steps continues a finished run.
#: Train settings a run may change and still resume its checkpoints. The worker count among them: the data
#: position is kept per sample, not per rank (:class:`eagle3ray.train_worker.WorkerCheckpoint`), so a run may
#: resume with more or fewer workers (each step then trains ``num_workers`` x ``max_tokens_per_batch`` tokens).
_RESUMABLE_FIELDS = ("max_steps", "checkpoint_every", "max_failures", "verify_blocks", "num_workers",
                     "cpus_per_worker", "ray_resources", "ordered_ingest")

#: Train fields that only matter with ``train.optimizer: muon`` (left out of an AdamW run's settings, so that they
#: never set its checkpoints aside).
_MUON_FIELDS = ("muon_lr", "muon_weight_decay", "muon_momentum")


def train_settings(cfg, paths: storage.RunPaths) -> dict:
    """What the checkpoints of a run depend on, flat (``train.lr``, ``vocab.token_freq_sha256``, ...): the train
    section less ``_RESUMABLE_FIELDS``, and the draft vocabulary.

    Raises:
        FileNotFoundError: the run has no ``vocab/vocab.json`` (review row 8: read as {} before, it set a finished
            training aside).
    """
    vocab = read_vocab_meta(paths)
    if not vocab:  # without it the settings would differ from any recorded ones and set a training aside
        raise FileNotFoundError(f"{paths.uri}/vocab/vocab.json: no draft vocabulary; run `eagle3ray vocab`")
    out = {f"train.{k}": v for k, v in cfg.train.model_dump(mode="json").items() if k not in _RESUMABLE_FIELDS}
    if out["train.optimizer"] == "adamw":  # the Muon fields do not apply
        for k in _MUON_FIELDS:
            out.pop(f"train.{k}")
    out.update({f"vocab.{k}": vocab.get(k) for k in ("draft_vocab_size", "token_freq_sha256")})
    return out


def _supersede_if_settings_changed(paths: storage.RunPaths, ck: str, settings: dict) -> None:
    """Checkpoints made with other settings are moved aside (never resumed, never deleted); then record ours.

    A run's ``checkpoints/settings.json`` holds :func:`train_settings` of the config that made them. When the
    config now differs (say ``train.lr``), resuming would mix two trainings and skipping would keep a draft the
    config does not describe, so the old folder becomes ``checkpoints.superseded-<n>`` and training starts over.
    """
    path = f"{ck}/settings.json"
    moved = storage.finish_move(paths.fs, ck)
    if moved:
        log.warning("%s: finished moving superseded checkpoints to %s (the move was cut short)", paths.uri, moved)
    old = storage.read_json(paths.fs, path)
    if old is not None:
        # a setting that a newer eagle3ray added, at its default, trains what the old checkpoints trained
        from .config import TrainSection

        defaults = {f"train.{k}": v for k, v in TrainSection().model_dump(mode="json").items()}
        added = {k: defaults[k] for k in settings if k not in old and k in defaults and settings[k] == defaults[k]}
        old = {**added, **old}
        if added and old == settings:
            storage.write_json_atomic(paths.fs, path, settings)
    if old is not None and old != settings:
        changed = [f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in sorted(set(old) | set(settings))
                   if old.get(k) != settings.get(k)]
        n = 1
        while paths.fs.exists(f"{ck}.superseded-{n}"):
            n += 1
        storage.move_aside(paths.fs, ck, f"{ck}.superseded-{n}")
        log.warning("train settings changed (%s): the previous checkpoints moved to %s.superseded-%d; training "
                    "starts from step 0", "; ".join(changed), ck, n)
        old = None
    if old is None:
        storage.write_json_atomic(paths.fs, path, settings)


@contextlib.contextmanager
def _progress_bar(paths: storage.RunPaths, max_steps: int, enabled: bool):
    """A tqdm bar in the driver, polling rank 0's progress file every 2 s while training runs."""
    if not enabled:
        yield
        return
    from tqdm.auto import tqdm

    from .artifacts import progress_path

    stop = threading.Event()
    bar = tqdm(total=max_steps, desc="train", unit="step")

    def poll() -> None:
        while not stop.wait(2.0):
            p = storage.read_json(paths.fs, progress_path(paths))
            if p and p.get("max_steps") == max_steps and p["step"] >= bar.n:
                bar.update(p["step"] - bar.n)
                if p.get("loss") is not None:
                    bar.set_postfix(loss=f"{p['loss']:.3f}", acc0=f"{p.get('acc0') or 0:.3f}", refresh=False)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=5)
        bar.close()


def surviving_history(history: list[dict]) -> list[dict]:
    """The lines of ``checkpoints/metrics.jsonl`` on the lineage that made the final weights.

    An attempt that died after logging steps past its last registered checkpoint leaves lines the resumed
    attempt logs again: a ``{"event": "resumed", "step": r}`` line drops every earlier line with a step > r, and an
    ``untrained`` line (an attempt that started from no checkpoint) every earlier line.
    """
    kept: list[dict] = []
    for m in history:
        if m.get("event") in ("resumed", "untrained"):
            kept = [k for k in kept if int(k.get("step", 0)) <= int(m["step"])]
        kept.append(m)
    return kept


def best_of_history(history: list[dict]) -> dict:
    """The held-out evaluation with the highest ``val_full_acc_0`` (acceptance at TTT position 0 on the held-out
    blocks, in [0, 1]) among :func:`surviving_history`; {} when there is none."""
    return max((m for m in surviving_history(history) if "val_full_acc_0" in m and m.get("event") is None),
               key=lambda m: m["val_full_acc_0"], default={})


def held_out_split(files: list[str], tokens: list[int], fraction: float) -> tuple[list[str], list[str]]:
    """Split committed blocks (manifest order) into training and held-out blocks: the held-out ones are the last
    blocks, as few as hold at least ``fraction`` of the committed tokens (at least one block, and at least one left
    to train on). Counting blocks instead (``round(len(files) * fraction)``, before 2026-12-07) held out only the
    last block when a run had few of them: in a 170-conversation run of 8 blocks that was the extraction's 73-token
    tail, one sample, and its "held-out accuracy" read 0.78 (docs/results.md, session 29).

    Args:
        files: block paths, in the manifest's order.
        tokens: each block's token count (the manifest entry's ``tokens``), same order.
        fraction: ``train.val_fraction``, in [0, 1).

    Returns:
        (training files, held-out files).

    Raises:
        ValueError: fewer than 2 blocks, or ``tokens`` not one count per file.
    """
    if len(files) < 2 or len(tokens) != len(files):
        raise ValueError(f"held_out_split needs >= 2 blocks with one token count each (got {len(files)} blocks, "
                         f"{len(tokens)} counts)")
    target, held, n = fraction * sum(tokens), 0, 0
    while n < len(files) - 1 and (n == 0 or held < target):
        n += 1
        held += tokens[-n]
    return files[:-n], files[-n:]


def _checked_blocks(cfg, paths: storage.RunPaths, spec) -> tuple[list[str], list[int]]:
    """The committed blocks' paths of a complete extraction and their token counts, each block checked against its
    manifest entry (``train.verify_blocks``) and the manifest against the draft this config builds. Errors: see
    :func:`train`."""
    man, files = blocks.read_committed(paths.fs, paths.hidden_states)
    if not man.get("complete"):
        raise FileNotFoundError(f"{paths.uri}/hidden_states: extraction is not complete; run `eagle3ray extract`")
    problems = blocks.Manifest(paths.fs, paths.hidden_states, man).verify(sha256=cfg.train.verify_blocks == "sha256")
    if problems:  # before Ray Train starts: a bad block would otherwise fail (or train) only after its retries
        raise blocks.CorruptBlocks(f"{paths.uri}/hidden_states", problems)
    _check_manifest(man, spec, f"{paths.uri}/hidden_states/manifest.json")
    if len(files) < 2:
        raise ValueError(f"{paths.uri}/hidden_states has {len(files)} block(s); training needs >= 2 "
                         "(one is held out). Extract more samples or lower extract.max_tokens_per_batch.")
    return files, [int(b["tokens"]) for b in man["blocks"]]


def read_blocks(files: list[str], filesystem):
    """A Ray Data dataset of committed block files (Parquet), read by Ray Data's v1 Parquet reader.

    Ray 2.60's default (v2, ``DataContext.use_datasource_v2``) lists the files on a pool of up to 32
    ``FooterReader`` actors, a Python process each, started anew at every execution of the dataset: each epoch
    that streams, each held-out evaluation. On a 2-core machine those starts competed with the train step; a
    12-step train on Ray's multi-node test cluster took 172 s with v2 and 79 s with v1 (AMD EPYC, no
    ``amx_bf16``; docs/plan.md, "Ray Data's Parquet reader"). The manifest lists the block files; v1 reads their
    metadata from the driver (and samples a few with Ray tasks) once, when the dataset is built; with 100k blocks
    on object storage that cost is not measured yet. ``RAY_DATA_USE_DATASOURCE_V2=1`` in the environment keeps
    Ray's default (to compare, or where v1 is gone).

    Args:
        files: block paths on ``filesystem`` (the manifest's, in order).
        filesystem: a pyarrow filesystem (:func:`eagle3ray.storage.arrow_filesystem`), or None for local paths.
    """
    import os

    import ray

    ctx = ray.data.DataContext.get_current()
    before = ctx.use_datasource_v2
    ctx.use_datasource_v2 = os.environ.get("RAY_DATA_USE_DATASOURCE_V2", "0") not in ("0", "", "false", "False")
    try:  # the flag is read by read_parquet when it builds the datasource only
        return ray.data.read_parquet(files, filesystem=filesystem)
    finally:
        ctx.use_datasource_v2 = before


def train(cfg, hooks: WorkerHooks | None = None, progress: bool = False, stream=None) -> TrainSummary:
    """Run (or resume, or skip when finished) the train stage of ``cfg``: from the stored blocks
    (``train.data_source: offline``) or from the verifier service's stream (``online``).

    Args:
        hooks: test hooks handed to every worker (:class:`eagle3ray.train_worker.WorkerHooks`).
        progress: show a progress bar (steps, loss, ETA) read from rank 0's ``checkpoints/progress.json``.
        stream: with ``train.data_source: online``, ``stream(cfg, spec, paths) -> (train, val)`` Ray Datasets of
            block rows, called only when there is training to do (:func:`eagle3ray.online.datasets`; the
            pipeline passes it, as stages meet only in storage). ``hybrid`` without it reads the stored blocks.

    Raises:
        FileNotFoundError: extract (offline; prepare, online) or vocab has not completed.
        blocks.ManifestMismatch: the blocks were made for another verifier/layers/tokenizer.
        blocks.CorruptBlocks: a committed block is missing or differs from its manifest entry.
        ValueError: too few committed blocks (online: samples) to hold out a validation slice.
        ValueError: ``train.data_source: online`` without ``stream``.
        RuntimeError: (online) the verifier service failed to start, or a unit failed after its retries.
        NonFiniteLoss: a step's loss or gradient norm was NaN/Inf (names the step, its samples and the last good
            checkpoint, which is kept; see :class:`eagle3ray.train_worker.NonFiniteMarker`).
    """
    import ray
    import ray.data
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from .machine import ensure_ray
    from .verifier import VerifierSpec

    t0 = time.time()
    paths = storage.run_paths(cfg)
    storage.write_resolved_config(cfg, paths)
    spec = VerifierSpec.from_config(cfg)
    offline = cfg.train.data_source == "offline" or (cfg.train.data_source == "hybrid" and stream is None)
    files, tokens = _checked_blocks(cfg, paths, spec) if offline else ([], [])
    ck = paths.sub("checkpoints")
    tc = cfg.train.model_dump()
    _supersede_if_settings_changed(paths, ck, train_settings(cfg, paths))
    done = storage.read_json(paths.fs, f"{ck}/complete.json")
    if done and done.get("max_steps") == cfg.train.max_steps:
        return TrainSummary(steps=done["steps"], skipped=True, best_step=done.get("best_step"),
                            best_metrics=done.get("best_metrics", {}), checkpoint=done.get("best_checkpoint", ""),
                            ttt_steps=cfg.train.ttt_steps)
    d2t, t2d = load_vocab(paths)
    ensure_ray(cfg)
    afs = storage.arrow_filesystem(paths.fs)
    if offline:
        train_files, val_files = held_out_split(files, tokens, cfg.train.val_fraction)
        ds_train = read_blocks(train_files, afs)
        ds_val = read_blocks(val_files, afs)
    elif stream is None:
        raise ValueError("train.data_source online: train() needs the stream of states (run the stage through "
                         "eagle3ray.pipeline.run_stage, or pass stream=eagle3ray.online.datasets)")
    else:
        ds_train, ds_val = stream(cfg, spec, paths)
    autocast_bf16 = resolve_autocast(cfg.train.autocast, "cuda" if cfg.train.use_gpu else "cpu")
    log.info("train: draft forward %s (train.autocast %s)", "in bf16 autocast" if autocast_bf16 else "in fp32",
             cfg.train.autocast)
    loop_cfg = {
        "train": tc, "autocast_bf16": autocast_bf16, "verifier_path": spec.model_path, "aux_layer_ids": spec.layer_ids[:-1],
        "hidden_size": spec.model_identity["hidden_size"], "d2t": d2t.numpy(), "t2d": t2d.numpy(),
        "storage_uri": cfg.run.storage, "endpoint_url": cfg.run.endpoint_url, "run_name": cfg.run.name,
        "hooks": hooks, "code_fingerprint": code_fingerprint(),
        "arrow_fs": afs, "fit_token": uuid.uuid4().hex,
    }
    resources = {"CPU": cfg.train.cpus_per_worker, **cfg.train.ray_resources}
    # CPU workers start with tcmalloc preloaded where it is installed, as the CPU engines and the plan's probe do:
    # the worker's loop runs in a thread of its actor, where glibc's allocator cost its steps more than the
    # probe's (benchmarks/train.py --variants 1w,1w-glibc, docs/results.md). Empty on GPU workers.
    worker_env = cpu_engine_env("cuda" if cfg.train.use_gpu else "cpu")
    if cfg.train.use_gpu:
        resources["GPU"] = 1
    # train.ordered_ingest: blocks reach the workers in the same order on every run (Ray Data's preserve_order; its
    # OutputSplitter then also ignores locality hints, "to ensure determinism"), so the seed fixes each epoch's
    # samples and order. Without it the read tasks' finishing order decided, and two runs on the same blocks
    # differed from their first step (benchmarks/train_determinism.py, docs/results.md). Online and hybrid runs
    # stream states as the verifier produces them: their order stays the producer's.
    dataset_config = None
    if offline and cfg.train.ordered_ingest:
        ingest = copy.deepcopy(ray.data.DataContext.get_current().execution_options)  # what Ray Train would use
        ingest.preserve_order = True  # (DataConfig.default_ingest_options() warns: exclude_resources is deprecated)
        dataset_config = DataConfig(execution_options=ingest)
    trainer = TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_cfg,
        scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                     resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if cfg.train.use_gpu else "gloo"),
        run_config=RunConfig(
            name="train", storage_path=ck, storage_filesystem=afs,
            checkpoint_config=CheckpointConfig(checkpoint_score_attribute="val_full_acc_0",
                                               checkpoint_score_order="max"),
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            worker_runtime_env={"env_vars": worker_env} if worker_env else None,
        ),
        datasets={"train": ds_train, "val": ds_val},
        dataset_config=dataset_config,
    )
    marker = NonFiniteMarker.path(loop_cfg)
    if paths.fs.exists(marker):
        paths.fs.rm_file(marker)  # an earlier fit's: this one tries again
    error = None
    with _progress_bar(paths, cfg.train.max_steps, progress):
        try:
            result = trainer.fit()
            error = result.error
        except Exception as e:  # noqa: BLE001 - Ray Train V2 raises TrainingFailedError from fit(); re-raised
            error = e
    if error is not None:
        nonfinite = storage.read_json(paths.fs, marker)
        if nonfinite and nonfinite.get("fit") == loop_cfg["fit_token"]:
            last = WorkerCheckpoint.latest_on_storage(paths.fs, f"{ck}/train")
            raise NonFiniteLoss(
                f"{paths.uri}: training stopped, {nonfinite['error']} (rank {nonfinite['rank']}). The last good "
                f"checkpoint is {'step %d, %s' % last if last else 'none (no checkpoint was written yet)'}; it is "
                "kept and a re-run resumes from it. Look for bad hidden states in these samples (`eagle3ray verify "
                "-c CONFIG`), or lower train.lr.") from error
        raise error
    history = read_metrics(paths)
    best = best_of_history(history)
    best_ckpt = WorkerCheckpoint.complete_on_storage(paths.fs, f"{ck}/train").get(best.get("step"), "")
    for c, m in getattr(result, "best_checkpoints", None) or []:
        if not best_ckpt and m.get("step") == best.get("step"):
            best_ckpt = c.path
    if not best_ckpt and result.checkpoint is not None:
        best_ckpt = result.checkpoint.path
    untrained = next((m for m in history if m.get("event") == "untrained"), {})
    resumed = [m["step"] for m in history if m.get("event") == "resumed"]
    final = result.metrics or {}
    summary = TrainSummary(steps=int(final.get("step", 0)), resumed_from=resumed[-1] if resumed else None,
                           best_step=best.get("step"), best_metrics=best, untrained_metrics=untrained,
                           final_metrics=final, seconds=time.time() - t0, checkpoint=best_ckpt,
                           ttt_steps=cfg.train.ttt_steps)
    storage.write_json_atomic(paths.fs, f"{ck}/best.json", {"step": best.get("step"), "checkpoint": best_ckpt,
                                                            "metrics": best})
    storage.write_json_atomic(paths.fs, f"{ck}/complete.json", {
        "steps": summary.steps, "max_steps": cfg.train.max_steps, "best_step": summary.best_step,
        "best_metrics": best, "best_checkpoint": best_ckpt, "untrained_metrics": untrained})
    return summary

