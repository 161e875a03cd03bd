"""Stage ``train``: the EAGLE-3 draft head on Ray Train, reading hidden-state blocks through Ray Data.

Model, data alignment and loss are speculators' own: ``Eagle3DraftModel`` (built from the
verifier's config with ``num_draft_layers`` decoder layers, the manifest's aux layer ids and the
run's d2t/t2d), ``shift_batch`` (pairs the states of token t with token t+1, as speculators'
trainer does) and ``CollateFn`` (packs samples into one sequence of ``max_tokens_per_batch``
tokens with document ids). The loop around them is ours because speculators' ``Trainer`` is
CUDA-only (FIELD_NOTES):

- workers: ``TorchTrainer`` with ``num_workers`` x ``cpus_per_worker`` (gloo) or one GPU each
  (NCCL, bf16 autocast); each reads its ``get_dataset_shard("train")`` stream, decodes rows and packs
  them by token budget; all workers take the same number of steps per epoch (an all-reduce of
  "has a batch" ends the epoch for everyone; the leftovers are counted as ``epoch_tail_samples``);
- optimizer: AdamW, linear warm-up then cosine decay to ``min_lr_ratio``, gradient clipping;
- every ``checkpoint_every`` steps (and at the end): held-out evaluation on ``get_dataset_shard("val")``
  (loss and accuracy per TTT position), a checkpoint (trainable weights as safetensors; optimizer,
  scheduler, step, RNG; each worker's data position: epoch and the sample ids it consumed this epoch),
  and ``ray.train.report``;
- resume: re-running the same run continues from the latest checkpoint (same ``RunConfig``
  name/storage); ``FailureConfig(max_failures)`` restarts a crashed worker group from it. Samples
  consumed in the checkpoint's epoch (by any worker) are skipped, so no batch is skipped or repeated.

Layout: ``<run>/checkpoints/train/checkpoint_*`` (Ray Train), ``metrics.jsonl`` (one line per report,
for plots), ``best.json`` (best held-out step-0 accuracy), ``complete.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from . import blocks, check_code_fingerprint, code_fingerprint, storage
from .config import resolve_autocast

log = logging.getLogger(__name__)

TRAINABLE_FILE = "draft_trainable.safetensors"
STATE_FILE = "trainer_state.pt"


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


def build_draft(verifier_path: str, aux_layer_ids: list[int], d2t, t2d, tcfg: dict):
    """speculators ``Eagle3DraftModel`` for a verifier; embeddings/lm_head/norm loaded from the verifier's weights.

    The decoder-layer config is :func:`eagle3ray.preflight.draft_layer_config` of the verifier's
    ``config.json`` (``text_config`` resolved; Llama layer for architectures speculators has none for;
    ``train.draft_head_dim`` honoured), so the draft trained is the one ``eagle3ray check -c`` printed.

    Args:
        verifier_path: folder or hub id (``config.json`` is resolved with transformers' ``cached_file``).
        aux_layer_ids: the three auxiliary ids (without the final id L).
        d2t: [Vd] int64 offsets; t2d: [V] bool.
        tcfg: ``train`` section as a dict (num_draft_layers, draft_head_dim, norm_before_residual,
            norm_before_fc, norm_output, ttt_steps, attn_impl). The config defaults ``norm_before_fc`` and
            ``norm_output`` to True as speculators' training CLI does for eagle3 (``from_training_args`` itself
            defaults them to False).
    """
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig
    from transformers.utils import cached_file

    from .check import text_config
    from .preflight import draft_layer_config

    with open(cached_file(verifier_path, "config.json")) as f:
        vtext = text_config(json.load(f))
    layer = draft_layer_config(vtext, tcfg["num_draft_layers"], tcfg.get("draft_head_dim"))
    text = AutoConfig.for_model(**layer)
    return Eagle3DraftModel.from_training_args(
        text, t2d=torch.as_tensor(t2d, dtype=torch.bool), d2t=torch.as_tensor(d2t, dtype=torch.long),
        num_layers=tcfg["num_draft_layers"], norm_before_residual=tcfg["norm_before_residual"],
        norm_before_fc=tcfg["norm_before_fc"], norm_output=tcfg["norm_output"],
        ttt_steps=tcfg["ttt_steps"], verifier_name_or_path=verifier_path, draft_vocab_size=len(d2t),
        target_layer_ids=list(aux_layer_ids), draft_attn_impl=tcfg["attn_impl"],
    )


def row_to_sample(row: dict, all_positions: bool = False):
    """A block row -> speculators' per-sample dict, shifted (token t+1 with the states of token t).

    Args:
        row: one block row (``blocks.SCHEMA``).
        all_positions: loss on every position instead of the row's ``loss_mask`` (assistant tokens).

    Returns tensors: hidden_states [T-1, 3H], input_ids [T-1], verifier_last_hidden_states [T-1, H],
    loss_mask [T-1], lengths [1], position_ids [T-1].
    """
    import torch
    from speculators.models.eagle3.data import shift_batch

    st = torch.from_numpy(blocks.decode_states(row).copy())  # shape: [T, L, H], L = 3 aux + final
    T = st.shape[0]
    return shift_batch({
        "hidden_states": st[:, :-1].flatten(1),  # shape: [T, 3H]
        "input_ids": torch.as_tensor(row["input_ids"], dtype=torch.long),
        "verifier_last_hidden_states": st[:, -1],  # shape: [T, H]
        "loss_mask": (torch.ones(T, dtype=torch.long) if all_positions
                      else torch.as_tensor(row["loss_mask"], dtype=torch.long)),
        "lengths": torch.tensor([T]),
        "position_ids": torch.arange(T),
    })


def add_hidden_noise(hidden_states, num_aux: int, scale: float):
    """Feature-noise augmentation (EAGLE, Li et al. 2024): ``h + scale * rms(h) * N(0, 1)`` per auxiliary layer.

    Args:
        hidden_states: [..., num_aux * H] concatenated auxiliary hidden states (speculators' layout).
        num_aux: number of auxiliary layers concatenated on the last axis.
        scale: noise standard deviation as a fraction of each layer's per-token root-mean-square.

    Returns a new tensor of the same shape and dtype (the input is not modified).
    """
    import torch

    x = hidden_states.unflatten(-1, (num_aux, -1))  # shape: [..., num_aux, H]
    rms = x.float().pow(2).mean(-1, keepdim=True).sqrt()
    return (x + (scale * rms * torch.randn_like(x, dtype=torch.float32)).to(x.dtype)).flatten(-2)


def pack_rows(rows, max_tokens: int):
    """Group (sample_id, sample) pairs greedily into lists of at most ``max_tokens`` shifted tokens."""
    cur, n = [], 0
    for sid, s in rows:
        t = int(s["lengths"][0])
        if cur and n + t > max_tokens:
            yield cur
            cur, n = [], 0
        cur.append((sid, s))
        n += t
    if cur:
        yield cur


def _lr_lambda(warmup: int, total: int, floor: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _summarize(sums: dict, ttt_steps: int, prefix: str) -> dict:
    out = {}
    if sums.get("loss_total"):
        out[f"{prefix}loss"] = sums["loss_sum"] / sums["loss_total"]
    for k in range(ttt_steps):
        tot = sums.get(f"full_acc_{k}_total", 0.0)
        if tot:
            out[f"{prefix}full_acc_{k}"] = sums[f"full_acc_{k}_sum"] / tot
        tot = sums.get(f"cond_acc_{k}_total", 0.0)
        if tot:
            out[f"{prefix}cond_acc_{k}"] = sums[f"cond_acc_{k}_sum"] / tot
    return out


def _accumulate(acc: dict, metrics: dict) -> None:
    for k, v in metrics.items():
        acc[k] = acc.get(k, 0.0) + float(v)


def train_loop_per_worker(config: dict) -> None:  # noqa: C901 - one readable loop
    """The Ray Train worker loop (see module docstring). ``config`` is built by :func:`train`."""
    import ray.train
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from speculators.losses import resolve_loss_config
    from speculators.train.data import CollateFn

    tc = config["train"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    check_code_fingerprint(config.get("code_fingerprint"), f"Ray Train worker {rank}")
    device = ray.train.torch.get_device()
    use_cuda = device.type == "cuda"
    random.seed(tc["seed"] + rank)
    np.random.seed(tc["seed"] + rank)
    torch.manual_seed(tc["seed"])  # same init on every rank

    draft = build_draft(config["verifier_path"], config["aux_layer_ids"], config["d2t"], config["t2d"], tc)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=tc["lr"], weight_decay=tc["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(tc["warmup_steps"], tc["max_steps"], tc["min_lr_ratio"]))
    step, epoch, consumed, resumed_from = 0, 0, set(), None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = load_file(os.path.join(d, TRAINABLE_FILE))
            missing = {n for n, p in draft.named_parameters() if p.requires_grad} - set(state)
            if missing:
                raise RuntimeError(f"checkpoint {ckpt.path} lacks trainable weights {sorted(missing)[:5]}")
            draft.load_state_dict(state, strict=False)
            ts = torch.load(os.path.join(d, STATE_FILE), weights_only=True)
            opt.load_state_dict(ts["optimizer"])
            sched.load_state_dict(ts["scheduler"])
            step, epoch = int(ts["step"]), int(ts["epoch"])
            torch.set_rng_state(ts["torch_rng"])
            for name in os.listdir(d):  # data positions of every rank (the split may differ now)
                if name.startswith("data_rank"):
                    with open(os.path.join(d, name)) as f:
                        ds_state = json.load(f)
                    if ds_state["epoch"] == epoch:
                        consumed.update(ds_state["consumed"])
        resumed_from = step
        if rank == 0:
            print(f"[eagle3ray.train] resumed from step {step} (epoch {epoch}, {len(consumed)} samples of this "
                  f"epoch already consumed) checkpoint {ckpt.path}", flush=True)
    draft = draft.to(device)
    model = ray.train.torch.prepare_model(draft) if world > 1 else draft
    core = model.module if hasattr(model, "module") else model
    loss_cfg = resolve_loss_config(tc["loss"], tc["loss_impl"])
    H = config["hidden_size"]
    collate = CollateFn(tc["max_tokens_per_batch"], H, len(config["aux_layer_ids"]),
                        dtype=torch.float32)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config["autocast_bf16"])

    def all_min(flag: int) -> int:
        if world == 1:
            return flag
        t = torch.tensor([flag], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_sum(d: dict) -> dict:
        if world == 1 or not d:
            return d
        keys = sorted(d)
        t = torch.tensor([d[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def forward(batch, train: bool):
        b = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if train and tc["hidden_noise"] > 0:
            b["hidden_states"] = add_hidden_noise(b["hidden_states"], len(config["aux_layer_ids"]), tc["hidden_noise"])
        with autocast:
            _, loss, metrics = (model if train else core)(**b, ttt_steps=tc["ttt_steps"],
                                                          ttt_step_loss_decay=tc["ttt_step_loss_decay"],
                                                          loss_config=loss_cfg)
        return loss, metrics

    def batches(shard, seed, skip: set, holder: dict, all_positions: bool = False):
        """Packed batches of one epoch of ``shard``; ``holder["it"]`` lets the caller drain the rest."""
        it = iter(shard.iter_batches(batch_size=8, batch_format="pyarrow",
                                     local_shuffle_buffer_size=tc["shuffle_buffer_rows"] or None,
                                     local_shuffle_seed=seed if tc["shuffle_buffer_rows"] else None))
        holder["it"] = it

        def rows():
            for tbl in it:
                for row in tbl.to_pylist():
                    if row["sample_id"] not in skip:
                        yield row["sample_id"], row_to_sample(row, all_positions)

        for group in pack_rows(rows(), tc["max_tokens_per_batch"]):
            yield [sid for sid, _ in group], collate([s for _, s in group])

    def drain(holder: dict) -> int:
        """Consume the rest of an epoch without decoding it (streaming splits expect full epochs)."""
        return sum(t.num_rows for t in holder.get("it", ()))

    def evaluate() -> dict:
        sums: dict = {}
        model.eval()
        with torch.no_grad():
            for _, batch in batches(ray.train.get_dataset_shard("val"), 0, set(), {}):
                _, metrics = forward(batch, train=False)
                _accumulate(sums, metrics)
        model.train()
        return _summarize(all_sum(sums), tc["ttt_steps"], "val_")

    metrics_fs, metrics_path = storage.filesystem(config["storage_uri"], config["endpoint_url"])
    metrics_path = f"{metrics_path.rstrip('/')}/{config['run_name']}/checkpoints/metrics.jsonl"

    def log_metrics(entry: dict) -> None:
        if rank != 0:
            return
        old = b""
        if metrics_fs.exists(metrics_path):
            with metrics_fs.open(metrics_path, "rb") as f:
                old = f.read()
        storage.write_bytes_atomic(metrics_fs, metrics_path, old + (json.dumps(entry) + "\n").encode())

    def save_and_report(metrics: dict) -> None:
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                save_file({n: p.detach().cpu().contiguous() for n, p in core.named_parameters() if p.requires_grad},
                          os.path.join(d, TRAINABLE_FILE))
                torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step,
                            "epoch": epoch, "torch_rng": torch.get_rng_state()}, os.path.join(d, STATE_FILE))
            with open(os.path.join(d, f"data_rank{rank}.json"), "w") as f:
                json.dump({"epoch": epoch, "consumed": sorted(mine)}, f)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        log_metrics(metrics)
        if rank == 0:
            from . import metrics as ray_metrics

            ray_metrics.train_report(config["run_name"], metrics, tc["ttt_steps"])

    trace = None
    if config.get("trace_dir"):
        os.makedirs(config["trace_dir"], exist_ok=True)
        trace = open(os.path.join(config["trace_dir"], f"rank{rank}-{os.getpid()}-{time.time_ns()}.jsonl"), "a")

    if resumed_from is None and rank == 0:
        print("[eagle3ray.train] evaluating the untrained draft on the held-out blocks", flush=True)
    if resumed_from is None:
        untrained = evaluate()
        log_metrics({"step": 0, "event": "untrained", **untrained})
    else:
        log_metrics({"step": step, "event": "resumed"})
    model.train()
    mine: set = set()  # sample ids this rank consumed in the current epoch (since the last restore)
    sums: dict = {}
    t_last, tokens_since, tail = time.time(), 0, 0
    while step < tc["max_steps"]:
        holder: dict = {}
        for ids, batch in batches(ray.train.get_dataset_shard("train"), tc["seed"] + epoch, consumed, holder,
                                  tc["loss_positions"] == "all"):
            if not all_min(1):  # another rank's share of this epoch is used up: all end the epoch together
                tail += len(ids) + drain(holder)
                break
            if config.get("fail_at_step") is not None and step == config["fail_at_step"] and resumed_from is None \
                    and rank == world - 1:
                print(f"[eagle3ray.train] test hook: worker {rank} exits at step {step}", flush=True)
                os._exit(1)
            loss, metrics = forward(batch, train=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, tc["grad_clip"])
            opt.step()
            sched.step()
            step += 1
            mine.update(ids)
            tokens_since += int((batch["document_ids"] >= 0).sum())
            _accumulate(sums, metrics)
            if trace is not None:
                trace.write(json.dumps({"step": step, "epoch": epoch, "ids": ids}) + "\n")
                trace.flush()
            if rank == 0 and step % 10 == 0:
                m = _summarize(sums, tc["ttt_steps"], "")
                print(f"[eagle3ray.train] step {step}/{tc['max_steps']} loss {m.get('loss', float('nan')):.3f} "
                      + " ".join(f"acc{k} {m.get(f'full_acc_{k}', 0):.3f}" for k in range(tc["ttt_steps"]))
                      + f" lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if step % tc["checkpoint_every"] == 0 or step >= tc["max_steps"]:
                dt = time.time() - t_last
                train_m = _summarize(all_sum(sums), tc["ttt_steps"], "train_")
                tok = all_sum({"t": float(tokens_since)})["t"]
                report = {"step": step, "epoch": epoch, **train_m, **evaluate(),
                          "tokens_per_s": tok / max(dt, 1e-9), "lr": sched.get_last_lr()[0],
                          "epoch_tail_samples": tail}
                save_and_report(report)
                if rank == 0:
                    print(f"[eagle3ray.train] checkpoint at step {step}: " + json.dumps(
                        {k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}), flush=True)
                sums, tokens_since, t_last = {}, 0, time.time()
            if step >= tc["max_steps"]:
                break
        else:
            all_min(0)  # this rank ran out: tell the others the epoch is over
        if step >= tc["max_steps"]:
            break
        epoch += 1
        consumed, mine = set(), set()
    if trace is not None:
        trace.close()


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
_RESUMABLE_FIELDS = ("max_steps", "checkpoint_every", "max_failures")


def train_settings(cfg, paths: storage.RunPaths) -> dict:
    """What the checkpoints of a run depend on, flat (``train.lr``, ``vocab.token_freq_sha256``, ...): the train
    section less ``_RESUMABLE_FIELDS``, and the draft vocabulary."""
    vocab = storage.read_json(paths.fs, f"{paths.sub('vocab')}/vocab.json") or {}
    out = {f"train.{k}": v for k, v in cfg.train.model_dump(mode="json").items() if k not in _RESUMABLE_FIELDS}
    out.update({f"vocab.{k}": vocab.get(k) for k in ("draft_vocab_size", "token_freq_sha256")})
    return out


def _supersede_if_settings_changed(paths: storage.RunPaths, ck: str, settings: dict) -> None:
    """Checkpoints made with other settings are moved aside (never resumed, never deleted); then record ours.

    A run's ``checkpoints/settings.json`` holds :func:`train_settings` of the config that made them. When the
    config now differs (say ``train.lr``), resuming would mix two trainings and skipping would keep a draft the
    config does not describe, so the old folder becomes ``checkpoints.superseded-<n>`` and training starts over.
    """
    path = f"{ck}/settings.json"
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
        paths.fs.mv(ck, f"{ck}.superseded-{n}", recursive=True)
        log.warning("train settings changed (%s): the previous checkpoints moved to %s.superseded-%d; training "
                    "starts from step 0", "; ".join(changed), ck, n)
        old = None
    if old is None:
        storage.write_json_atomic(paths.fs, path, settings)


def train(cfg, fail_at_step: int | None = None, trace_dir: str | None = None) -> TrainSummary:
    """Run (or resume, or skip when finished) the train stage of ``cfg``.

    Args:
        fail_at_step: test hook, the last worker exits at this step on the first attempt.
        trace_dir: test hook, each worker appends the sample ids of every step there.

    Raises:
        FileNotFoundError: extract or vocab has not completed.
        blocks.ManifestMismatch: the blocks were made for another verifier/layers/tokenizer.
        ValueError: too few committed blocks to hold out a validation slice.
    """
    import ray
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from .service import ensure_ray
    from .verifier import VerifierSpec
    from .vocab import load_vocab

    t0 = time.time()
    paths = storage.run_paths(cfg)
    storage.write_resolved_config(cfg, paths)
    man, files = blocks.read_committed(paths.fs, paths.hidden_states)
    if not man.get("complete"):
        raise FileNotFoundError(f"{paths.uri}/hidden_states: extraction is not complete; run `eagle3ray extract`")
    spec = VerifierSpec.from_config(cfg)
    _check_manifest(man, spec, f"{paths.uri}/hidden_states/manifest.json")
    ck = paths.sub("checkpoints")
    tc = cfg.train.model_dump()
    _supersede_if_settings_changed(paths, ck, train_settings(cfg, paths))
    done = storage.read_json(paths.fs, f"{ck}/complete.json")
    if done and done.get("max_steps") == cfg.train.max_steps:
        return TrainSummary(steps=done["steps"], skipped=True, best_step=done.get("best_step"),
                            best_metrics=done.get("best_metrics", {}), checkpoint=done.get("best_checkpoint", ""))
    if len(files) < 2:
        raise ValueError(f"{paths.uri}/hidden_states has {len(files)} block(s); training needs >= 2 "
                         "(one is held out). Extract more samples or lower extract.max_tokens_per_batch.")
    n_val = max(1, round(len(files) * cfg.train.val_fraction))
    train_files, val_files = files[:-n_val], files[-n_val:]
    d2t, t2d = load_vocab(paths)
    ensure_ray(cfg)
    afs = storage.arrow_filesystem(paths.fs)
    ds_train = ray.data.read_parquet(train_files, filesystem=afs)
    ds_val = ray.data.read_parquet(val_files, filesystem=afs)
    autocast_bf16 = resolve_autocast(cfg.train.autocast, "cuda" if cfg.train.use_gpu else "cpu")
    log.info("train: draft forward %s (train.autocast %s)", "in bf16 autocast" if autocast_bf16 else "in fp32",
             cfg.train.autocast)
    loop_cfg = {
        "train": tc, "autocast_bf16": autocast_bf16, "verifier_path": spec.model_path, "aux_layer_ids": spec.layer_ids[:-1],
        "hidden_size": spec.model_identity["hidden_size"], "d2t": d2t.numpy(), "t2d": t2d.numpy(),
        "storage_uri": cfg.run.storage, "endpoint_url": cfg.run.endpoint_url, "run_name": cfg.run.name,
        "fail_at_step": fail_at_step, "trace_dir": trace_dir, "code_fingerprint": code_fingerprint(),
    }
    resources = {"CPU": cfg.train.cpus_per_worker}
    if cfg.train.use_gpu:
        resources["GPU"] = 1
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
        ),
        datasets={"train": ds_train, "val": ds_val},
    )
    result = trainer.fit()
    if result.error:
        raise result.error
    history = read_metrics(paths)
    best = max((m for m in history if "val_full_acc_0" in m and m.get("event") is None),
               key=lambda m: m["val_full_acc_0"], default={})
    best_ckpt = ""
    for c, m in getattr(result, "best_checkpoints", None) or []:
        if m.get("step") == best.get("step"):
            best_ckpt = c.path
    if not best_ckpt and result.checkpoint is not None:
        best_ckpt = result.checkpoint.path
    untrained = next((m for m in history if m.get("event") == "untrained"), {})
    resumed = [m["step"] for m in history if m.get("event") == "resumed"]
    final = result.metrics or {}
    summary = TrainSummary(steps=int(final.get("step", 0)), resumed_from=resumed[-1] if resumed else None,
                           best_step=best.get("step"), best_metrics=best, untrained_metrics=untrained,
                           final_metrics=final, seconds=time.time() - t0, checkpoint=best_ckpt)
    storage.write_json_atomic(paths.fs, f"{ck}/best.json", {"step": best.get("step"), "checkpoint": best_ckpt,
                                                            "metrics": best})
    storage.write_json_atomic(paths.fs, f"{ck}/complete.json", {
        "steps": summary.steps, "max_steps": cfg.train.max_steps, "best_step": summary.best_step,
        "best_metrics": best, "best_checkpoint": best_ckpt, "untrained_metrics": untrained})
    return summary


def read_metrics(paths: storage.RunPaths) -> list[dict]:
    """Every line of ``<run>/checkpoints/metrics.jsonl`` (reports, 'untrained' and 'resumed' events)."""
    p = f"{paths.sub('checkpoints')}/metrics.jsonl"
    if not paths.fs.exists(p):
        return []
    with paths.fs.open(p, "rb") as f:
        return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
