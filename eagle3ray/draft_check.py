"""Offline compatibility check: will stock vLLM load this EAGLE-3 draft for this verifier?

Loads no verifier weights: it reads the verifier's ``config.json`` and the draft's ``config.json``
plus the *headers* of its safetensors files (names, shapes, dtypes; no tensor data), applies
vLLM's key renaming (``llama_eagle3.Eagle3LlamaForCausalLM.load_weights``: ``t2d`` dropped, ``d2t`` ->
``draft_id_to_target_id``, ``midlayer.`` -> ``layers.0.``, everything but ``lm_head`` prefixed with
``model.``) and compares every tensor with the shape vLLM's EAGLE-3 Llama model allocates:

================================  =====================================================
tensor                            shape (vLLM 0.32 ``llama_eagle3.py``)
================================  =====================================================
model.fc.weight                   [H, A*H_t]  (A aux layers, H_t = target hidden size)
model.layers.0.self_attn.q_proj   [n_heads*head_dim, 2H]  (layer 0 sees [embeds, hidden])
model.layers.0.self_attn.k/v_proj [n_kv*head_dim, 2H]
model.layers.0.self_attn.o_proj   [H, n_heads*head_dim]
model.layers.0.mlp.gate/up_proj   [I, H];  down_proj [H, I]
model.layers.0.*norm*             [H]  (input_layernorm, hidden_norm, post_attention_layernorm)
model.norm.weight                 [H]
model.input_norm.weight           [A*H_t]  (only with ``norm_before_fc``: RMSNorm before fc)
model.fc_norm.{j}.weight          [H_t]  (only with ``fc_norm``: one RMSNorm per auxiliary state)
lm_head.weight                    [Vd, H]
draft_id_to_target_id (d2t)       [Vd] integer offsets, d2t[i] + i < V
model.embed_tokens.weight         [V, H]  (optional: vLLM shares the verifier's when absent)
================================  =====================================================

``head_dim`` is the draft config's explicit ``head_dim`` when present, else H / n_heads (Kimi-K2's
draft declares 128 although 7168/64 = 112). The verifier side: ``text_config`` resolved for nested
configs; hidden size and vocabulary must match; aux layer ids must lie in [0, L].
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import fsspec

from .draft import default_aux_layer_ids, expected_shapes, read_config_json, text_config, vllm_key

_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32", "BOOL": "bool",
           "I8": "int8", "U8": "uint8", "F8_E4M3": "float8_e4m3fn"}


@dataclass
class CheckReport:
    """Problems (each names the key/field) and notes; ``ok`` when there is no problem."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    shapes: dict[str, list[int]] = field(default_factory=dict)  # expected vLLM shapes

    @property
    def ok(self) -> bool:
        return not self.problems

    title = "check"

    def headline(self) -> str:
        return self.render().splitlines()[0]

    def render(self) -> str:
        lines = ["eagle3ray check: " + ("OK: vLLM's eagle3 loader accepts this draft" if self.ok else
                                        f"{len(self.problems)} problem(s)")]
        lines += [f"  PROBLEM {p}" for p in self.problems]
        lines += [f"  note    {n}" for n in self.notes]
        return "\n".join(lines)


class BadSafetensors(ValueError):
    """A weights file that is not a complete safetensors file (cut short, or not safetensors at all)."""


def safetensors_header(path: str, storage_options: dict | None = None) -> dict[str, dict]:
    """{name: {"dtype", "shape"}} from a safetensors file's JSON header (reads the header, and the file's size to
    check that every tensor's bytes are there).

    Raises:
        BadSafetensors: the file is shorter than its header says, or its header is not one (message names it).
    """
    with fsspec.open(path, "rb", **(storage_options or {})) as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadSafetensors(f"{path}: {len(head)} bytes, truncated (a safetensors file starts with an 8-byte "
                                 "header length)")
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n) if n < 100_000_000 else b""
        size = f.size if getattr(f, "size", None) is not None else None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadSafetensors(f"{path}: truncated or not safetensors (header of {n} bytes announced, "
                             f"{len(raw)} readable)") from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if size is not None and size < 8 + n + end:
        raise BadSafetensors(f"{path}: truncated ({size} bytes; its header needs {8 + n + end})")
    header.pop("__metadata__", None)
    return {k: {"dtype": _DTYPES.get(v["dtype"], v["dtype"]), "shape": list(v["shape"])} for k, v in header.items()}


def check_draft(draft_dir: str, verifier: str, storage_options: dict | None = None) -> CheckReport:
    """Compare an exported draft directory with what vLLM expects for ``verifier``.

    Args:
        draft_dir: folder (or URI) with ``config.json`` and ``*.safetensors`` in speculators format.
        verifier: the verifier's folder or its ``config.json`` path (no weights are read).
        storage_options: fsspec options for ``draft_dir`` (``{"endpoint_url": run.endpoint_url}`` on an
            S3-compatible store; credentials come from the environment).

    Returns:
        A :class:`CheckReport`; each problem names the tensor key or config field.
    """
    rep = CheckReport()
    vpath = verifier if verifier.endswith(".json") else f"{verifier.rstrip('/')}/config.json"
    try:
        vcfg = text_config(read_config_json(vpath))
    except FileNotFoundError:
        rep.problems.append(f"verifier config {vpath}: not found")
        return rep
    try:
        dcfg = read_config_json(f"{draft_dir.rstrip('/')}/config.json", storage_options)
    except FileNotFoundError:
        rep.problems.append(f"{draft_dir}/config.json: not found")
        return rep
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        rep.problems.append(f"{draft_dir}/config.json: not valid JSON (truncated?): {e}")
        return rep
    if dcfg.get("speculators_model_type") != "eagle3":
        rep.problems.append(f"config.json: field 'speculators_model_type' is {dcfg.get('speculators_model_type')!r}, "
                            "vLLM's eagle3 method needs 'eagle3'")
    t = dcfg.get("transformer_layer_config")
    if not isinstance(t, dict):
        rep.problems.append("config.json: field 'transformer_layer_config' missing")
        return rep
    missing = [k for k in ("hidden_size", "num_attention_heads") if k not in t]
    if missing:
        rep.problems.append(f"config.json: field 'transformer_layer_config' lacks {missing}")
        return rep
    VH, VL, VV = vcfg["hidden_size"], vcfg["num_hidden_layers"], vcfg["vocab_size"]
    if t["hidden_size"] != VH:
        rep.problems.append(f"config.json: field 'transformer_layer_config.hidden_size' is {t['hidden_size']}, "
                            f"the verifier's hidden_size is {VH}")
    aux = dcfg.get("eagle_aux_hidden_state_layer_ids") or []
    if not aux:
        rep.notes.append("eagle_aux_hidden_state_layer_ids not set: vLLM uses its default [2, L//2, L-3]")
        aux = default_aux_layer_ids(VL)
    bad = [i for i in aux if not 0 <= i <= VL]
    if bad:
        rep.problems.append(f"config.json: field 'eagle_aux_hidden_state_layer_ids' {aux}: {bad} outside the "
                            f"verifier's depth [0, {VL}]")
    nh = t["num_attention_heads"]
    if t.get("head_dim") not in (None, t["hidden_size"] // nh):
        rep.notes.append(f"explicit head_dim {t['head_dim']} (hidden/heads = {t['hidden_size'] // nh}): q/k/v/o "
                         "shapes use the explicit value, as vLLM does")
    target_hidden = t.get("target_hidden_size") or dcfg.get("target_hidden_size") or VH
    rep.shapes = expected_shapes(dcfg, len(aux), target_hidden)
    files = sorted(fsspec.open_files(f"{draft_dir.rstrip('/')}/*.safetensors", **(storage_options or {})),
                   key=lambda of: of.path)
    if not files:
        rep.problems.append(f"{draft_dir}: no *.safetensors weights")
        return rep
    tensors: dict[str, dict] = {}
    for of in files:
        try:
            tensors.update(safetensors_header(of.full_name if hasattr(of, "full_name") else of.path, storage_options))
        except BadSafetensors as e:
            rep.problems.append(str(e))
    if any("truncated" in p or "not safetensors" in p for p in rep.problems):
        return rep
    loaded = {}
    for name, info in tensors.items():
        k = vllm_key(name)
        if k is not None:
            loaded[k] = (name, info)
    Vd = rep.shapes["lm_head.weight"][0]
    for key, shape in rep.shapes.items():
        if key not in loaded:
            ckpt = "d2t" if key == "draft_id_to_target_id" else key.removeprefix("model.")
            if key == "draft_id_to_target_id" and Vd == VV:
                continue  # full-vocabulary draft: vLLM needs no mapping
            rep.problems.append(f"weights: key {ckpt!r} missing (vLLM parameter {key}, shape {shape})")
            continue
        name, info = loaded[key]
        if info["shape"] != shape:
            rep.problems.append(f"weights: key {name!r} has shape {info['shape']}, vLLM expects {shape}")
    if "draft_id_to_target_id" in loaded:
        name, info = loaded["draft_id_to_target_id"]
        if not info["dtype"].startswith("int"):
            rep.problems.append(f"weights: key {name!r} dtype {info['dtype']}, vLLM expects integer offsets")
    if "model.embed_tokens.weight" in loaded:
        name, info = loaded["model.embed_tokens.weight"]
        if info["shape"] != [VV, t["hidden_size"]]:
            rep.problems.append(f"weights: key {name!r} has shape {info['shape']}, vLLM expects [{VV}, "
                                f"{t['hidden_size']}] (the verifier's vocabulary)")
    else:
        rep.notes.append("no embed_tokens in the draft: vLLM shares the verifier's embedding")
    t2d = [info for name, info in tensors.items() if "t2d" in name]
    if t2d and t2d[0]["shape"] != [VV]:
        rep.problems.append(f"weights: key 't2d' has shape {t2d[0]['shape']}, the verifier's vocabulary is {VV}")
    known = set(rep.shapes) | {"model.embed_tokens.weight"}
    extra = sorted(k for k in loaded if k not in known)
    if extra:
        rep.problems.append(f"weights: keys vLLM's eagle3 model has no parameter for: {extra[:6]}")
    dvocab = dcfg.get("draft_vocab_size")
    if dvocab is not None and dvocab != Vd:
        rep.problems.append(f"config.json: field 'draft_vocab_size' {dvocab} != lm_head rows {Vd}")
    return rep

