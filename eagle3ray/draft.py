"""What the EAGLE-3 draft *is*, for a given verifier: the one home of its shape.

Everything that decides the draft's tensors lives here, so that preflight (``eagle3ray check -c``), training,
export and the export check agree by construction:

- the verifier's text config, read one way (:func:`read_config_json` + :func:`text_config`; ``text_config``,
  ``language_config`` and ``llm_config`` of nested/multimodal configs resolved);
- the auxiliary layer ids (:func:`default_aux_layer_ids`, :func:`resolve_layer_ids`; vLLM/speculators
  convention: id ``i < L`` is the *input* of decoder layer ``i``, id ``L`` the last layer's output before the
  final norm);
- the draft's decoder-layer config per verifier architecture (:func:`draft_layer_config`, explicit
  ``head_dim`` from :func:`resolve_head_dim`) and the speculators-format ``config.json`` fields vLLM reads
  (:func:`draft_config_dict`);
- the tensor shapes vLLM allocates for that draft (:func:`expected_shapes`, :func:`vllm_key`);
- the speculators model itself (:func:`build_draft`) and the name of its trainable-weights file.

This module reads configs only (never weights) and imports no stage.
"""

from __future__ import annotations

import json

#: Decoder-layer types both speculators (model_definitions) and vLLM (``update_eagle3``) have an EAGLE-3 layer for.
DRAFT_LAYER_TYPES = ("llama", "qwen3")
#: Fields a Llama decoder layer reads, copied from a verifier of another architecture.
_LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
               "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
               "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")
#: The trainable weights of a draft checkpoint (fc, decoder layer, norms, lm_head), safetensors.
TRAINABLE_FILE = "draft_trainable.safetensors"


# ------------------------------------------------------------------------------------- the verifier's config
def read_config_json(path: str, storage_options: dict | None = None) -> dict:
    """A verifier's (or draft's) ``config.json`` as a dict, through fsspec (local paths and object storage).

    Args:
        path: the ``config.json`` file itself, or a folder/URI holding it.
        storage_options: fsspec options for ``path`` (e.g. ``{"endpoint_url": ...}`` for an S3-compatible store).

    Raises:
        FileNotFoundError: no such file.
        json.JSONDecodeError: the file is not JSON.
    """
    import fsspec

    if not path.endswith(".json"):
        path = f"{path.rstrip('/')}/config.json"
    with fsspec.open(path, "rb", **(storage_options or {})) as f:
        return json.loads(f.read())


def text_config(cfg: dict) -> dict:
    """The language model's settings of a (possibly nested, multimodal) HF ``config.json`` dict
    (``text_config``/``language_config``/``llm_config``; a top-level ``quantization_config`` is carried in)."""
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(key), dict):
            inner = dict(cfg[key])
            if "quantization_config" not in inner and "quantization_config" in cfg:
                inner["quantization_config"] = cfg["quantization_config"]
            return inner
    return cfg


def verifier_text_config(model_path: str) -> dict:
    """:func:`text_config` of the verifier at ``model_path`` (a folder, or a hub id resolved with transformers'
    ``cached_file``, which downloads only ``config.json``).

    Raises:
        OSError: transformers cannot find ``config.json`` there.
    """
    from transformers.utils import cached_file

    with open(cached_file(model_path, "config.json")) as f:
        return text_config(json.load(f))


def normalized_text_config(model_path: str) -> dict:
    """The text config as transformers normalises it (``AutoConfig`` with its defaults filled in,
    ``get_text_config()``), as a dict. The verifier identity hashes this form (``verifier.model_identity``),
    so that a config written with or without default-valued keys names the same verifier. Reads config.json only.
    """
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return text.to_dict()


# ------------------------------------------------------------------------------------------ auxiliary layers
def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """speculators' ``resolve_target_layer_ids`` and vLLM's default for a verifier of L layers: [2, L//2, L-3]."""
    L = num_hidden_layers
    return [2, L // 2, L - 3]


def resolve_layer_ids(aux_layer_ids: list[int] | None, num_hidden_layers: int) -> list[int]:
    """Auxiliary layer ids plus the final pre-norm id ``num_hidden_layers``.

    Default auxiliary ids: :func:`default_aux_layer_ids`.

    Raises:
        ValueError: ids out of [0, L), duplicated, or the final id given explicitly.
    """
    L = num_hidden_layers
    aux = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(L)
    if L in aux:
        raise ValueError(f"verifier.aux_layer_ids: {L} (= num_hidden_layers) is the final pre-norm state and is "
                         "appended automatically; list only the auxiliary layers")
    bad = [i for i in aux if not 0 <= i < L]
    if bad or len(set(aux)) != len(aux):
        raise ValueError(f"verifier.aux_layer_ids {aux}: each id must be unique and in [0, {L}) "
                         f"for a verifier with {L} layers (bad: {bad or 'duplicates'})")
    return aux + [L]


# ----------------------------------------------------------------------------------------- the decoder layer
def resolve_head_dim(t: dict, override: int | None) -> tuple[int, str]:
    """(head_dim, where it came from): ``train.draft_head_dim`` > the verifier's explicit ``head_dim`` >
    hidden_size / num_attention_heads. MLA verifiers (``kv_lora_rank``) carry a ``head_dim`` for RoPE only
    (transformers sets it to ``qk_rope_head_dim``), so it is not taken from them."""
    if override:
        return override, "train.draft_head_dim"
    if t.get("head_dim") and not t.get("kv_lora_rank"):
        return int(t["head_dim"]), "verifier config head_dim"
    return t["hidden_size"] // t["num_attention_heads"], "hidden_size / num_attention_heads"


def draft_layer_config(verifier_text: dict, num_draft_layers: int, head_dim_override: int | None = None) -> dict:
    """The draft's decoder-layer config (speculators ``transformer_layer_config``) for a verifier.

    Llama and Qwen3 verifiers keep their own config (depth set to ``num_draft_layers``); any other
    architecture gets a Llama layer with the verifier's hidden size, heads, KV heads, MLP width
    (the dense ``intermediate_size`` for MoE verifiers), vocabulary, norm epsilon and RoPE settings.
    ``head_dim`` is always written explicitly (see :func:`resolve_head_dim`).

    Returns:
        A config dict that ``transformers.AutoConfig.for_model(**d)`` accepts (``model_type`` llama or qwen3).
    """
    t = verifier_text
    hd, _ = resolve_head_dim(t, head_dim_override)
    if t.get("model_type") in DRAFT_LAYER_TYPES:
        d = {k: v for k, v in t.items() if k not in ("quantization_config", "architectures", "auto_map")}
    else:
        d = {k: t[k] for k in _LLAMA_KEYS if t.get(k) is not None}
        d.update(model_type="llama", attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
        d.setdefault("num_key_value_heads", t["num_attention_heads"])
    d["num_hidden_layers"] = num_draft_layers
    d["head_dim"] = hd
    return d


def draft_config_dict(cfg, vtext: dict, layer_ids: list[int]) -> dict:
    """The speculators-format draft ``config.json`` fields vLLM reads (what export will write)."""
    layer = draft_layer_config(vtext, cfg.train.num_draft_layers, cfg.train.draft_head_dim)
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "norm_before_residual": cfg.train.norm_before_residual,
        "norm_before_fc": cfg.train.norm_before_fc,
        "norm_output": cfg.train.norm_output,
        "target_hidden_size": vtext["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(layer_ids[:-1]),
    }


# ------------------------------------------------------------------------------------- what vLLM allocates
def vllm_key(name: str) -> str | None:
    """The parameter name vLLM's Eagle3LlamaForCausalLM loads a checkpoint key into (None: ignored)."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    name = name.replace("midlayer.", "layers.0.")
    return name if "lm_head" in name else "model." + name


def expected_shapes(draft_cfg: dict, num_aux: int, target_hidden: int) -> dict[str, list[int]]:
    """Shapes vLLM allocates for a speculators EAGLE-3 Llama draft (renamed keys; the table is in
    :mod:`eagle3ray.draft_check`'s docstring, from vLLM 0.32 ``llama_eagle3.py``)."""
    t = draft_cfg.get("transformer_layer_config", draft_cfg)
    H = t["hidden_size"]
    nh, nkv = t["num_attention_heads"], t.get("num_key_value_heads", t["num_attention_heads"])
    hd = t.get("head_dim") or H // nh
    inter = t["intermediate_size"]
    Vd = draft_cfg.get("draft_vocab_size") or t["vocab_size"]
    L = t.get("num_hidden_layers", 1)
    shapes = {
        "model.fc.weight": [H, num_aux * target_hidden],
        "model.norm.weight": [H],
        "lm_head.weight": [Vd, H],
        "draft_id_to_target_id": [Vd],
    }
    if draft_cfg.get("norm_before_fc"):  # one RMSNorm over the concatenated auxiliary states (vLLM input_norm)
        shapes["model.input_norm.weight"] = [num_aux * target_hidden]
    if draft_cfg.get("fc_norm"):  # one RMSNorm per auxiliary state (Eagle 3.1)
        shapes.update({f"model.fc_norm.{j}.weight": [target_hidden] for j in range(num_aux)})
    for i in range(L):
        p = f"model.layers.{i}."
        qkv_in = 2 * H if i == 0 else H
        shapes.update({
            p + "self_attn.q_proj.weight": [nh * hd, qkv_in],
            p + "self_attn.k_proj.weight": [nkv * hd, qkv_in],
            p + "self_attn.v_proj.weight": [nkv * hd, qkv_in],
            p + "self_attn.o_proj.weight": [H, nh * hd],
            p + "mlp.gate_proj.weight": [inter, H],
            p + "mlp.up_proj.weight": [inter, H],
            p + "mlp.down_proj.weight": [H, inter],
            p + "input_layernorm.weight": [H],
            p + "post_attention_layernorm.weight": [H],
        })
        if i == 0:
            shapes[p + "hidden_norm.weight"] = [H]
    return shapes


# ------------------------------------------------------------------------------------------- the model
def build_draft(verifier_path: str, aux_layer_ids: list[int], d2t, t2d, tcfg: dict):
    """speculators ``Eagle3DraftModel`` for a verifier; embeddings/lm_head/norm loaded from the verifier's weights.

    The decoder-layer config is :func:`draft_layer_config` of :func:`verifier_text_config` (Llama layer for
    architectures speculators has none for; ``train.draft_head_dim`` honoured), so the draft trained is the one
    ``eagle3ray check -c`` printed.

    Args:
        verifier_path: folder or hub id.
        aux_layer_ids: the three auxiliary ids (without the final id L).
        d2t: [Vd] int64 offsets; t2d: [V] bool.
        tcfg: ``train`` section as a dict (num_draft_layers, draft_head_dim, norm_before_residual,
            norm_before_fc, norm_output, output_norm_init, ttt_steps, attn_impl). The config defaults
            ``norm_before_fc`` and ``norm_output`` to True as speculators' training CLI does for eagle3
            (``from_training_args`` itself defaults them to False); ``output_norm_init`` absent means ``ones``.
    """
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    layer = draft_layer_config(verifier_text_config(verifier_path), tcfg["num_draft_layers"],
                               tcfg.get("draft_head_dim"))
    text = AutoConfig.for_model(**layer)
    draft = Eagle3DraftModel.from_training_args(
        text, t2d=torch.as_tensor(t2d, dtype=torch.bool), d2t=torch.as_tensor(d2t, dtype=torch.long),
        num_layers=tcfg["num_draft_layers"], norm_before_residual=tcfg["norm_before_residual"],
        norm_before_fc=tcfg["norm_before_fc"], norm_output=tcfg["norm_output"],
        ttt_steps=tcfg["ttt_steps"], verifier_name_or_path=verifier_path, draft_vocab_size=len(d2t),
        target_layer_ids=list(aux_layer_ids), draft_attn_impl=tcfg["attn_impl"],
    )
    if tcfg.get("output_norm_init", "ones") == "verifier":
        # The frozen lm_head is the verifier's; its input norm starts as the verifier's final norm (loaded by
        # speculators into ``verifier_norm`` for the loss targets) instead of ones.
        with torch.no_grad():
            draft.norm.weight.copy_(draft.verifier_norm.weight)
    return draft
