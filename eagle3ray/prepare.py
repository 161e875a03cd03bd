"""Stage ``prepare``: prompts -> conversations (token ids + loss masks) under ``<run>/conversations/``.

Reads the training sources of ``data.train``, drops every training conversation whose user turns
appear in a held-out set of ``data.eval`` (``in_eval_set``) or repeat an earlier one
(``duplicate``), optionally replaces the assistant answers with the verifier's own
(``data.regenerate``, self-distillation through the verifier service), renders each with the
verifier's chat template and marks the assistant tokens (:mod:`eagle3ray.chat`).

Output: ``conversations.parquet`` (sample_id, source, input_ids int32[T], loss_mask int8[T],
num_tokens) and ``manifest.json`` (counts, rejected records by reason with examples, tokenizer
identity, sha256 of the Parquet file, the config hash). A finished prepare whose config hash
matches is not redone.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field

import pyarrow as pa
from tqdm.auto import tqdm

from . import storage
from .artifacts import CONV_SCHEMA
from .chat import ChatTemplateError, tokenize_conversation, tokenizer_identity
from .sources import Record, RejectCounter, held_out_user_turns, iter_source, normalize_text

log = logging.getLogger(__name__)


@dataclass
class PrepareSummary:
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    seconds: float = 0.0
    bytes_written: int = 0
    regenerated: bool = False
    skipped: bool = False
    rejected: RejectCounter = field(default_factory=RejectCounter)
    path: str = ""

    @property
    def title(self) -> str:
        return "prepare" + (" (already complete: skipped)" if self.skipped else "")

    def headline(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.rejected.counts.items(), key=lambda kv: -kv[1]))
        return (f"prepare: {self.samples} conversations, {self.tokens} tokens, {self.regenerated} answers regenerated"
                + (" (already complete)" if self.skipped else "")
                + (f"; rejected {self.rejected.total} ({reasons})" if self.rejected.total else ""))

    def rows(self) -> list[tuple[str, object]]:
        """(label, value) rows for the CLI's table."""
        return [("conversations", self.samples), ("tokens", self.tokens), ("assistant (loss) tokens", self.loss_tokens),
                ("regenerated answers", self.regenerated), ("seconds", f"{self.seconds:.1f}"),
                ("bytes written", self.bytes_written), ("rejected records", self.rejected.total), ("output", self.path)]

    @property
    def rejected_by_stage(self) -> dict:
        return {"prepare": self.rejected.to_json()} if self.rejected.total else {}


def _config_hash(cfg, spec_identity: dict) -> str:
    blob = cfg.data.model_dump_json(exclude={"tokens_per_sample_estimate", "regenerate_engine"}) + repr(sorted(spec_identity.items()))
    if cfg.data.regenerate and cfg.verifier.dtype != "float32":  # greedy answers depend on the compute dtype
        blob += f"|dtype={cfg.verifier.dtype}"  # (float32, the former only dtype, keeps the former hashes)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _prompt_ids(tokenizer, msgs: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids


def collect_records(cfg, rejected: RejectCounter, tokenizer=None) -> list[Record]:
    """Training records after eval de-duplication, duplicate removal and ``data.max_prompt_tokens``
    (needs ``tokenizer``), at most ``data.max_samples``."""
    held_out = {normalize_text(p) for p in held_out_user_turns(cfg.data.eval)}
    seen: set[str] = set()
    ids: set[str] = set()
    kept: list[Record] = []
    for spec in cfg.data.train:
        for rec in iter_source(spec):
            if not isinstance(rec, Record):
                rejected.add(rec.reason, rec.where, rec.detail)
                continue
            users = [normalize_text(m["content"]) for m in rec.messages if m["role"] == "user"]
            if any(u in held_out for u in users):
                rejected.add("in_eval_set", rec.sample_id, "a user turn appears in a held-out eval set")
                continue
            key = "\x1e".join(users)
            if key in seen:
                rejected.add("duplicate", rec.sample_id, "same user turns as an earlier record")
                continue
            seen.add(key)
            if cfg.data.max_prompt_tokens and tokenizer is not None:
                first = []
                for m in rec.messages:
                    first.append(m)
                    if m["role"] == "user":
                        break
                n = len(_prompt_ids(tokenizer, first))
                if n > cfg.data.max_prompt_tokens:
                    rejected.add("too_long", rec.sample_id,
                                 f"first prompt of {n} tokens > data.max_prompt_tokens {cfg.data.max_prompt_tokens}")
                    continue
            sid = rec.sample_id
            while sid in ids:  # ids must be unique in the run
                sid += "+"
            ids.add(sid)
            rec.sample_id = sid
            if cfg.data.max_turns:
                rec.messages = _cut_turns(rec.messages, cfg.data.max_turns)
            kept.append(rec)
            if cfg.data.max_samples and len(kept) >= cfg.data.max_samples:
                return kept
    return kept


def _cut_turns(messages: list[dict], max_turns: int) -> list[dict]:
    out, answers = [], 0
    for m in messages:
        out.append(m)
        if m["role"] == "assistant":
            answers += 1
            if answers >= max_turns:
                break
    return out


@contextlib.contextmanager
def answer_engine(cfg, spec):
    """The engine that regenerates answers (``data.regenerate_engine``), as ``generate(prompts, seed) -> texts``.

    ``service``: the verifier service (started or reused; it stays up for extraction). ``dedicated``: a
    plain vLLM engine (:class:`eagle3ray.serving_engine.ServingEngine`, in-process on CPU with TP 1) in a Ray
    actor with the verifier's resources, killed on exit so that extraction has the cores or GPUs. The
    stand-in engine (``verifier.engine: stand_in``) always goes through the service.

    Yields a callable: prompts ([[token ids]]) and a sampling seed -> one answer text per prompt
    (vLLM's detokenized output, special tokens skipped).
    """
    import ray

    v, d = cfg.verifier, cfg.data
    if d.regenerate_engine == "service" or v.engine == "stand_in":
        from .verifier_service import start_for_config

        handle = start_for_config(cfg)
        yield lambda prompts, seed: [o["text"] for o in handle.generate.remote(
            prompts, d.max_new_tokens, d.temperature, seed).result()]
        return
    from .serving_engine import ServingEngine

    opts = {"num_cpus": v.num_cpus, **({"num_gpus": v.num_gpus} if v.num_gpus else {})}
    t0 = time.time()
    eng = ray.remote(**opts)(ServingEngine).remote(
        spec.model_path, draft_dir=None, dtype=v.dtype, max_model_len=v.max_model_len,
        enforce_eager=v.enforce_eager, max_num_seqs=v.max_num_seqs, seed=v.seed,
        cpu_kv_cache_gib=v.cpu_kv_cache_gib, gpu_memory_utilization=v.gpu_memory_utilization,
        tensor_parallel_size=v.tensor_parallel_size, device=v.device, cpu_threads=v.cpu_threads)
    try:
        ray.get(eng.__ray_ready__.remote())
        log.info("dedicated regeneration engine loaded in %.1f s", time.time() - t0)
        yield lambda prompts, seed: ray.get(eng.generate.remote(prompts, d.max_new_tokens, d.temperature,
                                                                 seed=seed))["texts"]
    finally:
        ray.kill(eng)


def regenerate_answers(cfg, records: list[Record], tokenizer, generate, rejected: RejectCounter) -> list[Record]:
    """Replace assistant answers with the verifier's own, round by round (turn k of every sample at once).

    ``generate(prompts, seed) -> texts`` is :func:`answer_engine`'s callable; prompts go to it
    ``verifier.max_num_seqs`` at a time. A conversation whose next prompt would not leave
    ``max_new_tokens`` room in ``max_model_len`` stops at the previous round; one that cannot fit even
    its first prompt is rejected (``too_long``).
    """
    limit = cfg.verifier.max_model_len - cfg.data.max_new_tokens
    convs = {r.sample_id: [m for m in r.messages if m["role"] == "system"] for r in records}
    users = {r.sample_id: [m for m in r.messages if m["role"] == "user"] for r in records}
    active = [r.sample_id for r in records]
    rounds = max((len(u) for u in users.values()), default=0)
    chunk = max(1, cfg.verifier.max_num_seqs)
    for k in range(rounds):
        prompts, owners = [], []
        for sid in active:
            if k >= len(users[sid]):
                continue
            msgs = convs[sid] + [users[sid][k]]
            ids = _prompt_ids(tokenizer, msgs)
            if len(ids) > limit:
                if k == 0:
                    rejected.add("too_long", sid, f"prompt of {len(ids)} tokens leaves no room for "
                                 f"{cfg.data.max_new_tokens} new tokens in max_model_len {cfg.verifier.max_model_len}")
                continue
            prompts.append(ids)
            owners.append(sid)
        if not prompts:
            break
        bar = tqdm(total=len(prompts), desc=f"regenerate round {k + 1}/{rounds}", unit="answer")
        for i in range(0, len(prompts), chunk):
            outs = generate(prompts[i:i + chunk], cfg.data.seed + k)
            for sid, text in zip(owners[i:i + chunk], outs):
                convs[sid] = convs[sid] + [users[sid][k], {"role": "assistant", "content": text}]
            bar.update(len(outs))
        bar.close()
        active = owners
    out = []
    for r in records:
        if any(m["role"] == "assistant" for m in convs[r.sample_id]):
            out.append(Record(r.sample_id, convs[r.sample_id], r.source))
    return out


def prepare(cfg, force: bool = False) -> PrepareSummary:
    """Run the prepare stage for ``cfg`` (see module docstring). Returns the summary.

    Raises:
        FileNotFoundError: a source file or package is missing.
        ChatTemplateError: the verifier's chat template cannot locate assistant turns.
        ManifestMismatch: the run's hidden states were extracted at another verifier dtype (checked before
            anything is regenerated over the conversations they came from).
    """
    from transformers import AutoTokenizer

    from .verifier import VerifierSpec

    t0 = time.time()
    paths = storage.run_paths(cfg)
    storage.write_resolved_config(cfg, paths)
    spec = VerifierSpec.from_config(cfg)
    chash = _config_hash(cfg, spec.model_identity)
    man_path = f"{paths.conversations}/manifest.json"
    existing = storage.read_json(paths.fs, man_path)
    if existing and existing.get("complete") and existing.get("config_hash") == chash and not force:
        s = PrepareSummary(samples=existing["counts"]["samples"], tokens=existing["counts"]["tokens"],
                           loss_tokens=existing["counts"]["loss_tokens"], skipped=True,
                           rejected=RejectCounter.from_json(existing["rejected"]), path=paths.uri + "/conversations")
        return s
    if not force:  # refuse before regenerating over conversations that extracted blocks were made from
        from .blocks import check_compute_dtype

        check_compute_dtype(storage.read_json(paths.fs, f"{paths.hidden_states}/manifest.json"),
                            cfg.verifier.dtype, f"{paths.uri}/hidden_states/manifest.json")
    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    rejected = RejectCounter()
    records = collect_records(cfg, rejected, tokenizer)
    if cfg.data.regenerate:
        from .machine import ensure_ray

        ensure_ray(cfg)
        with answer_engine(cfg, spec) as generate:
            records = regenerate_answers(cfg, records, tokenizer, generate, rejected)
    rows = {k: [] for k in CONV_SCHEMA.names}
    for rec in tqdm(records, desc="tokenize", unit="conv", disable=len(records) < 200):
        try:
            ids, mask = tokenize_conversation(tokenizer, rec.messages)
        except ChatTemplateError as e:
            rejected.add("chat_template", rec.sample_id, str(e))
            continue
        if not any(mask):
            rejected.add("no_assistant_turn", rec.sample_id, "no assistant tokens after templating")
            continue
        rows["sample_id"].append(rec.sample_id)
        rows["source"].append(rec.source)
        rows["input_ids"].append(ids)
        rows["loss_mask"].append(mask)
        rows["num_tokens"].append(len(ids))
    table = pa.table(rows, schema=CONV_SCHEMA)
    buf = storage.parquet_bytes(table, "zstd")
    storage.write_bytes_atomic(paths.fs, f"{paths.conversations}/conversations.parquet", buf)
    tokens = sum(rows["num_tokens"])
    loss_tokens = sum(sum(m) for m in rows["loss_mask"])
    manifest = {
        "schema_version": 1, "kind": "eagle3ray.conversations", "complete": True, "config_hash": chash,
        "file": "conversations.parquet", "sha256": hashlib.sha256(buf).hexdigest(), "bytes": len(buf),
        "counts": {"samples": table.num_rows, "tokens": tokens, "loss_tokens": loss_tokens},
        "rejected": rejected.to_json(), "regenerated": cfg.data.regenerate,
        "sources": [s.model_dump() for s in cfg.data.train], "eval": [s.model_dump() for s in cfg.data.eval],
        "verifier": spec.model_identity, **tokenizer_identity(tokenizer), "created_at": time.time(),
    }
    storage.write_json_atomic(paths.fs, man_path, manifest)
    return PrepareSummary(samples=table.num_rows, tokens=tokens, loss_tokens=loss_tokens, seconds=time.time() - t0,
                          bytes_written=len(buf), regenerated=cfg.data.regenerate, rejected=rejected,
                          path=paths.uri + "/conversations")

