"""Stage ``vocab``: the draft vocabulary from the loss-masked token frequencies written by extract (with
``train.data_source: online``, counted from the conversations: :func:`eagle3ray.online.conversation_frequencies`).

The ``draft_vocab_size`` most frequent target tokens, through speculators'
``build_vocab_mappings_from_distribution``: ``d2t`` [Vd] int64 offsets (target id = draft id +
d2t[draft id]) and ``t2d`` [V] bool (target token is in the draft vocabulary). Written to
``<run>/vocab/vocab.safetensors`` with ``vocab.json`` (sizes, coverage of the training answers).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from . import storage
from .artifacts import load_token_frequencies, read_vocab_meta


@dataclass
class VocabSummary:
    draft_vocab_size: int
    target_vocab_size: int
    coverage: float  # share of loss-masked training tokens inside the draft vocabulary
    path: str
    skipped: bool = False

    @property
    def title(self) -> str:
        return "vocab" + (" (already built: skipped)" if self.skipped else "")

    def rows(self) -> list[tuple[str, object]]:
        """(label, value) rows for the CLI's table."""
        return [("draft vocabulary", self.draft_vocab_size), ("target vocabulary", self.target_vocab_size),
                ("coverage of training answer tokens", self.coverage), ("output", self.path)]

    def headline(self) -> str:
        return f"vocab: {self.draft_vocab_size} tokens cover {self.coverage:.3f} of training answer tokens"


def build_vocab(cfg, force: bool = False, token_freq=None) -> VocabSummary:
    """Build (or reuse) the draft vocabulary of a run.

    Args:
        token_freq: with ``train.data_source: online`` (no extraction stored), the loss-masked token counts [V]
            int64 (:func:`eagle3ray.online.conversation_frequencies`); otherwise read from the extraction.

    Raises:
        FileNotFoundError: extract has not completed (no token_freq.safetensors).
        ValueError: ``train.data_source: online`` without ``token_freq``.
        ValueError: draft_vocab_size larger than the verifier's vocabulary.
    """
    import torch
    from safetensors.torch import save as st_save
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    paths = storage.run_paths(cfg)
    if cfg.train.data_source == "offline":
        man = storage.read_json(paths.fs, f"{paths.hidden_states}/manifest.json")
        if not man or not man.get("complete"):
            raise FileNotFoundError(f"{paths.uri}/hidden_states: extraction is not complete; run `eagle3ray extract`")
        freq = load_token_frequencies(paths)
    elif token_freq is None:
        raise ValueError("train.data_source online: build_vocab() needs token_freq (run the stage through "
                         "eagle3ray.pipeline.run_stage, which counts it: eagle3ray.online.conversation_frequencies)")
    else:
        freq = np.asarray(token_freq, dtype=np.int64)
    V, Vd = len(freq), cfg.vocab.draft_vocab_size
    if Vd > V:
        raise ValueError(f"vocab.draft_vocab_size {Vd} > verifier vocabulary {V}")
    freq_hash = hashlib.sha256(freq.tobytes()).hexdigest()[:16]
    meta_path = f"{paths.sub('vocab')}/vocab.json"
    old = read_vocab_meta(paths)
    if old and not force and old.get("draft_vocab_size") == Vd and old.get("token_freq_sha256") == freq_hash:
        return VocabSummary(Vd, V, old["coverage"], paths.uri + "/vocab", skipped=True)
    d2t, t2d = build_vocab_mappings_from_distribution({int(i): int(c) for i, c in enumerate(freq) if c}, Vd, V)
    coverage = float(freq[t2d.numpy()].sum() / max(freq.sum(), 1))
    storage.write_bytes_atomic(paths.fs, f"{paths.sub('vocab')}/vocab.safetensors",
                               st_save({"d2t": d2t.to(torch.int64), "t2d": t2d.to(torch.bool)}))
    storage.write_json_atomic(paths.fs, meta_path, {
        "draft_vocab_size": Vd, "target_vocab_size": V, "coverage": coverage, "token_freq_sha256": freq_hash,
        "distinct_training_tokens": int(np.count_nonzero(freq)),
    })
    return VocabSummary(Vd, V, coverage, paths.uri + "/vocab")

