"""RoPE settings between a Hugging Face config.json and GPTConfig's ``rotary_base``/``rope_*``/``yarn_*`` fields.

transformers 5 writes ``rope_parameters`` (``rope_type``, ``rope_theta`` and the scaling keys);
transformers 4 wrote ``rope_theta`` beside a ``rope_scaling`` dict (``rope_type`` or ``type``) or
null.  Both are read; a config is written back in the form it came in, with the keys it had
(a fresh export uses ``rope_parameters``).  YaRN's ``mscale``/``mscale_all_dim`` (DeepSeek) are
``yarn_mscale``/``yarn_mscale_all_dim``; transformers uses their ratio only when both are non-zero (else
``0.1 ln(factor) + 1``), so a config with just one of them is read with that scale as ``yarn_attention_factor``.
A scaling megalite cannot compute (``dynamic``, ``longrope``) is an error naming the field.
"""

from __future__ import annotations

from megalite.models.rotary import yarn_mscale

SCALING_KEYS = {
    # HF key: (GPTConfig field, the value a config without the key means)
    "factor": ("rope_scaling_factor", None),
    "low_freq_factor": ("rope_low_freq_factor", None),
    "high_freq_factor": ("rope_high_freq_factor", None),
    "original_max_position_embeddings": ("rope_original_max_position_embeddings", None),
    "beta_fast": ("yarn_beta_fast", 32.0),
    "beta_slow": ("yarn_beta_slow", 1.0),
    "attention_factor": ("yarn_attention_factor", None),
    "truncate": ("yarn_truncate", True),
    "mscale": ("yarn_mscale", 1.0),
    "mscale_all_dim": ("yarn_mscale_all_dim", 0.0),
}
_KEYS_OF = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                     "truncate", "mscale", "mscale_all_dim")}
_IGNORED = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _rope_dict(hf: dict) -> tuple[str, dict]:
    """``(name of the field holding the RoPE dict, the dict)``."""
    for name in ("rope_parameters", "rope_scaling"):
        if isinstance(hf.get(name), dict):
            return name, hf[name]
    return "rope_parameters", {}


def rope_fields(hf: dict) -> dict:
    """GPTConfig keyword arguments of the RoPE settings in ``hf`` (ValueError naming an unsupported field)."""
    where, rope = _rope_dict(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _KEYS_OF:
        raise ValueError(f"{where}.rope_type {kind!r} is not supported (megalite computes "
                         f"{', '.join(sorted(_KEYS_OF))})")
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor {rope.get('partial_rotary_factor', hf.get('partial_rotary_factor'))}"
                         " is not supported for this family (it rotates whole heads)")
    unknown = sorted(set(rope) - set(_KEYS_OF[kind]) - set(_IGNORED))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not supported with rope_type {kind!r}")
    fields = {"rotary_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
              "rope_scaling": None if kind == "default" else kind}
    for key in _KEYS_OF[kind]:
        field, default = SCALING_KEYS[key]
        value = rope.get(key, default)
        if key == "original_max_position_embeddings" and value is None:
            value = hf["max_position_embeddings"]
        if value is None and key != "attention_factor":
            raise ValueError(f"{where}.{key} is required with rope_type {kind!r}")
        fields[field] = value
    if kind == "yarn" and rope.get("attention_factor") is None and ("mscale" in rope or "mscale_all_dim" in rope) \
            and not (rope.get("mscale") and rope.get("mscale_all_dim")):
        fields["yarn_attention_factor"] = yarn_mscale(fields["rope_scaling_factor"], 1.0)
    return fields


def rope_config(config, base: dict) -> dict:
    """The RoPE keys of a config.json for ``config``, in the form (and with the keys) of ``base``."""
    kind = config.rope_scaling or "default"
    _, old = _rope_dict(base)
    old_kind = old.get("rope_type", old.get("type", "default"))
    keep = old if old_kind == kind else {k: v for k, v in old.items() if k in ("rope_type", "type", "rope_theta")}
    rope = {**keep, "type": kind} if "type" in keep else {**keep, "rope_type": kind}
    for key in _KEYS_OF[kind]:
        field, default = SCALING_KEYS[key]
        value = getattr(config, field)
        if key in keep or value != default:  # keys HF requires have no default, so they are always written
            rope[key] = value
    if "rope_parameters" not in base and ("rope_theta" in base or "rope_scaling" in base):
        out = {"rope_theta": config.rotary_base}
        if kind != "default" or "rope_scaling" in base:
            rope.pop("rope_theta", None)
            out["rope_scaling"] = None if kind == "default" and not base.get("rope_scaling") else rope
        return out
    return {"rope_parameters": {**rope, "rope_theta": config.rotary_base}}
