"""Draft heads as SafeAILab/EAGLE publishes them: a directory with a Llama-style
``config.json`` and ``pytorch_model.bin`` (read first) or ``model.safetensors``.

**EAGLE-1/2** (``fc.weight`` [D, 2D]): ``fc`` (with ``fc.bias`` unless the config says
``"bias": false``) and one decoder layer ``layers.0.*`` with no ``input_layernorm``
(q/k/v biases where the config has ``qkv_bias``), read as ``eagle.apply_head``'s pytree;
the target's embedding and LM head complete it.

**EAGLE-3** (``fc.weight`` [D, 3D]): ``fc``, ``midlayer.*`` (``input_layernorm`` of the
embedding, ``hidden_norm`` of the hidden state, q/k/v over their ``2D`` concatenation),
``norm``, ``lm_head`` over the draft vocabulary and ``d2t`` (target id = draft id +
``d2t[draft id]``; ``t2d`` marks the covered target ids), read as ``eagle3.apply_head``'s.
tails-mpt/SpecJAX's heads (thoughtworks' on the hub) are this layout exactly: the same
tensors, a thinner ``config.json`` (``head_dim`` and ``draft_vocab_size``, no
``target_hidden_size`` or ``eagle_config``; ``architectures`` ``LlamaForCausalLM``) and
``d2t`` as int32 offsets where JAX ran without x64.

**EAGLE 3.1** (vLLM's ``llama_eagle3.py``, SpecForge, TorchSpec) is EAGLE-3 with two
``config.json`` flags: ``"fc_norm": true`` adds one RMSNorm per fused stream before ``fc``
(``fc_norm.{i}.weight`` [target_hidden_size]), and ``"norm_output": true`` feeds the
head's post-norm output back to the next draft step (``PublishedHead.post_norm``). The
variants of vLLM's file that specjax does not compute (``norm_before_fc``,
``norm_before_residual``, no ``use_aux_hidden_state``) and a head of more than one layer are
refused in one line naming the field.

Each tensor name is mapped explicitly; a missing or unexpected tensor, a head for another
hidden size or vocabulary, or fused layers the target lacks fail with one line naming it.
A head that carries ``embed_tokens.weight`` drafts with that embedding. Weights must be
floating point (EAGLE-3's ``d2t`` holds integers, ``t2d`` booleans), and ``config.json``'s
values of the types transformers reads, its RoPE read as transformers reads it
(``specjax.models.loading.hf_rope``).

``save`` writes the other way: a specjax head (``eagle.apply_head``'s or
``eagle3.apply_head``'s pytree) as a directory of that layout (``config.json`` and
``model.safetensors``, with the sidecar ``model.safetensors.sha256``), which ``load`` reads
back to the same parameters; a head the
layout cannot express is refused in one line (``NoPublishedLayout``), as is, unless the
caller says the files are for SpecForge/SGLang (``for_sglang``), a head that SafeAILab/EAGLE's
own code would run differently (linear RoPE scaling with a base other than 10000).

The layout carries no checksum of its own, so ``save`` writes one beside the weights:
``model.safetensors.sha256``, one ``sha256sum`` line (``HEX  model.safetensors``; other
tools ignore the file, ``sha256sum -c`` reads it). ``load`` refuses weights that no longer
match it (``check_digest``); a head without the file (published elsewhere, or converted
before it was written) is read unchecked.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from specjax.drafters import blocks
from specjax.heads.exported import CheckpointError
from specjax.models.loading import (
    ConfigFields,
    check_floating,
    hf_rope,
    read_config_json,
)

WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")  # EAGLE's loader's order
DIGEST_FILE = "model.safetensors.sha256"  # save's sidecar: the SHA-256 of model.safetensors
_ROTARY = ".rotary_emb.inv_freq"  # buffers older transformers saved; derived from the config


@dataclasses.dataclass(frozen=True)
class PublishedHead:
    """A loaded published head: ``kind`` (``"eagle"`` for EAGLE-1/2, ``"eagle3"``, EAGLE 3.1
    included), the layer's sizes, the parameter pytree (numpy, float32; EAGLE 3.1's
    ``fc_norm`` [n, D_target] where the head has one), EAGLE-3's target id per draft id and
    fused layers, the directory it came from, and whether the head feeds its output back
    after the final norm (EAGLE 3.1's ``norm_output``)."""

    kind: str
    spec: blocks.LayerSpec
    params: dict
    vocab_ids: np.ndarray | None
    layers: tuple[int, ...] | None
    source: str
    post_norm: bool = False


def is_published(path: str | Path) -> bool:
    """Whether ``path`` is a published head's directory (``config.json`` and a weights
    file, and no specjax ``head.json``)."""
    p = Path(path)
    return ((p / "config.json").is_file() and not (p / "head.json").exists()
            and any((p / f).is_file() for f in WEIGHT_FILES))


def read_config(path: str | Path) -> dict:
    """The head's ``config.json`` object; ``CheckpointError`` naming the file if it is not
    readable JSON or not an object."""
    return read_config_json(Path(path) / "config.json", CheckpointError).d


def read_tensors(path: str | Path) -> tuple[dict[str, np.ndarray], Path]:
    """Every tensor of the head's weights file as numpy (floats as float32), and the file."""
    p = Path(path)
    f = next((p / n for n in WEIGHT_FILES if (p / n).is_file()), None)
    if f is None:
        raise CheckpointError(f"{p} has no {' or '.join(WEIGHT_FILES)}")
    try:
        raw = _read_bin(f) if f.suffix == ".bin" else _read_safetensors(f)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- torch and safetensors raise assorted errors
        raise CheckpointError(f"cannot read {f}: corrupt or truncated "
                              f"({type(e).__name__}: {str(e)[:200]})") from None
    return {k: v for k, v in raw.items() if not k.endswith(_ROTARY)}, f


def _read_bin(f: Path) -> dict[str, np.ndarray]:
    from specjax._optional import MissingExtra, require

    try:
        torch = require("torch", f"{f} is a PyTorch file: reading it")
    except MissingExtra as e:  # a CheckpointError, as every unreadable head
        raise CheckpointError(f"{e} (or convert it to model.safetensors)") from None
    sd = torch.load(f, map_location="cpu", weights_only=True)
    return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in sd.items()}


def _read_safetensors(f: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    with safe_open(f, framework="np") as st:
        out = {k: np.asarray(st.get_tensor(k)) for k in st.keys()}
    return {k: v.astype(np.float32) if v.dtype.kind == "f" or v.dtype.name == "bfloat16"
            else v for k, v in out.items()}


def _digest_line(hex_digest: str) -> str:
    return f"{hex_digest}  model.safetensors\n"


def write_digest(path: str | Path) -> Path:
    """Writes ``DIGEST_FILE`` beside ``path``'s ``model.safetensors``: its SHA-256 as a
    ``sha256sum`` line. Returns the file."""
    from specjax.heads.exported import file_sha256

    p = Path(path)
    out = p / DIGEST_FILE
    out.write_text(_digest_line(file_sha256(p / "model.safetensors")))
    return out


def check_digest(path: str | Path) -> None:
    """``CheckpointError`` (one line naming the file) when ``path`` holds ``DIGEST_FILE``
    (written by ``save``) and the ``model.safetensors`` it would read no longer has that
    SHA-256, or the file is not a ``sha256sum`` line; nothing without the file (a head
    published elsewhere carries none) or where ``pytorch_model.bin`` is read instead."""
    import re

    from specjax.heads.exported import checked_sha256

    p = Path(path).absolute()
    side = p / DIGEST_FILE
    if not side.is_file():
        return
    f = next((p / n for n in WEIGHT_FILES if (p / n).is_file()), None)
    if f is None or f.name != "model.safetensors":
        return
    try:
        text = side.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{side} cannot be read ({e})") from None
    m = re.fullmatch(r"([0-9a-fA-F]{64}) [ *]model\.safetensors\n?", text)
    if m is None:
        raise CheckpointError(f"{side} is damaged: not a SHA-256 line of model.safetensors "
                              f"('HEX  model.safetensors'); convert the head again")
    if checked_sha256(f) != m.group(1).lower():
        raise CheckpointError(
            f"{f} is corrupt or truncated: its SHA-256 differs from the one {DIGEST_FILE} "
            f"records (convert the head again; if you changed the weights on purpose, delete "
            f"{DIGEST_FILE})")


def _fields(cfg: dict | ConfigFields) -> ConfigFields:
    return cfg if isinstance(cfg, ConfigFields) else ConfigFields(cfg, error=CheckpointError)


def layer_spec(cfg: dict | ConfigFields, in_width: int) -> blocks.LayerSpec:
    """The head layer's sizes from its ``config.json``: its own heads, MLP width, eps and
    RoPE (``hf_rope``: base 10000 unless given; linear or llama3 scaling; ``dynamic`` NTK
    scaling changes nothing within ``max_position_embeddings``, so it reads as none).
    ``CheckpointError`` naming the file and key for a missing key or a value of the wrong
    type."""
    f = _fields(cfg)
    d, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    theta, scaling = hf_rope(f, dynamic_ok=True)
    return blocks.LayerSpec(
        width=d, in_width=in_width, num_heads=heads,
        num_kv_heads=f.integer("num_key_value_heads", heads),
        head_dim=f.integer("head_dim", d // heads),
        intermediate_size=f.integer("intermediate_size"),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6, positive=True),
        rope_theta=theta, rope_scaling=scaling)


def _check_dtypes(tensors: dict[str, np.ndarray], f: Path) -> None:
    """``CheckpointError`` naming a weight that is not floating point, or an EAGLE-3 index
    tensor of another kind than its own (``d2t`` integers, ``t2d`` booleans or 0/1 integers)."""
    index = {"d2t": ("iu", "integers"), "t2d": ("biu", "booleans")}
    for k, v in tensors.items():
        if k not in index:
            check_floating(k, v.dtype, f, CheckpointError)
        elif v.dtype.kind not in index[k][0]:
            raise CheckpointError(f"{f}: tensor {k!r} is stored as {v.dtype.name}; it must "
                                  f"hold {index[k][1]}")


def load(path: str | Path, target_cfg) -> PublishedHead:
    """The published head in ``path`` for a target of configuration ``target_cfg``,
    checked against it, and its ``model.safetensors`` against the SHA-256 ``save`` wrote
    beside it where there is one (``check_digest``, after the checks that name a tensor or
    field); ``CheckpointError`` with one line naming what does not fit."""
    p = Path(path)
    if not is_published(p):
        raise CheckpointError(f"{p} is not a published EAGLE head (config.json and "
                              f"{' or '.join(WEIGHT_FILES)})")
    cfg = read_config_json(p / "config.json", CheckpointError)
    tensors, f = read_tensors(p)
    if "fc.weight" not in tensors:
        raise CheckpointError(f"{f}: no 'fc.weight': not an EAGLE head")
    _check_dtypes(tensors, f)
    d_t, v = target_cfg.hidden_size, target_cfg.vocab_size
    d_head = cfg.integer("target_hidden_size", cfg.integer("hidden_size"))
    if d_head != d_t:
        raise CheckpointError(f"{p} is a head for hidden size {d_head}, but the target's is "
                              f"{d_t}")
    if cfg.integer("vocab_size", v) != v:
        raise CheckpointError(f"{p} is a head for a vocabulary of {cfg.d['vocab_size']} "
                              f"tokens, but the target has {v}")
    fused = any(k.startswith("midlayer.") for k in tensors) or "d2t" in tensors
    loader = _eagle3 if fused else _eagle1
    head = loader(p, f, cfg, tensors, target_cfg)
    check_digest(p)
    return head


def _take(tensors: dict, want: dict[str, tuple], where: Path, optional=()) -> dict:
    """``want``'s tensors, shapes checked; ``CheckpointError`` for a missing, unexpected or
    misshapen one (``optional`` names may be absent)."""
    missing = [k for k in want if k not in tensors and k not in optional]
    extra = sorted(set(tensors) - set(want))
    problems = ([f"missing tensors {missing}"] if missing else []) + (
        [f"unexpected tensors {extra}"] if extra else [])
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))
    for k, shape in want.items():
        if k in tensors and tuple(tensors[k].shape) != tuple(shape):
            raise CheckpointError(f"{where}: {k} has shape {tuple(tensors[k].shape)}; "
                                  f"expected {tuple(shape)}")
    return {k: tensors[k] for k in want if k in tensors}


def _layer(t: dict, prefix: str, bias: bool) -> dict:
    """One layer's weights in ``blocks``' names: fused ``qkv`` (and ``qkv_b``),
    ``gate_up``; ``mlp_norm`` is the post-attention norm."""
    g = lambda n: t[prefix + n]  # noqa: E731
    out = {"qkv": np.concatenate([g(f"self_attn.{n}_proj.weight") for n in "qkv"], 0),
           "o": g("self_attn.o_proj.weight"), "mlp_norm": g("post_attention_layernorm.weight"),
           "gate_up": np.concatenate([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")], 0),
           "down": g("mlp.down_proj.weight")}
    if bias:
        out["qkv_b"] = np.concatenate([g(f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
    return out


def _layer_shapes(prefix: str, spec: blocks.LayerSpec, bias: bool) -> dict[str, tuple]:
    d, i, hd, f = spec.width, spec.in_width, spec.head_dim, spec.intermediate_size
    nq, nk = spec.num_heads * hd, spec.num_kv_heads * hd
    out = {f"{prefix}self_attn.q_proj.weight": (nq, i), f"{prefix}self_attn.k_proj.weight": (nk, i),
           f"{prefix}self_attn.v_proj.weight": (nk, i), f"{prefix}self_attn.o_proj.weight": (d, nq),
           f"{prefix}post_attention_layernorm.weight": (d,),
           f"{prefix}mlp.gate_proj.weight": (f, d), f"{prefix}mlp.up_proj.weight": (f, d),
           f"{prefix}mlp.down_proj.weight": (d, f)}
    if bias:
        out.update({f"{prefix}self_attn.{n}_proj.bias": (c,)
                    for n, c in (("q", nq), ("k", nk), ("v", nk))})
    return out


def _eagle1(p: Path, f: Path, cfg: ConfigFields, tensors: dict, target_cfg) -> PublishedHead:
    d, v = target_cfg.hidden_size, target_cfg.vocab_size
    spec = layer_spec(cfg, d)
    qkv_bias = cfg.flag("qkv_bias", cfg.flag("attention_bias", False))
    fc_bias = cfg.flag("bias", True)
    n = cfg.integer("num_hidden_layers", 1)
    want = {"fc.weight": (d, 2 * d), "embed_tokens.weight": (v, d)}
    for i in range(n):  # layer i > 0 normalizes its input (cnets1.py's LlamaDecoderLayer)
        want.update(_layer_shapes(f"layers.{i}.", spec, qkv_bias))
        if i:
            want[f"layers.{i}.input_layernorm.weight"] = (spec.width,)
    if fc_bias:
        want["fc.bias"] = (d,)
    t = _take(tensors, want, f, optional=("embed_tokens.weight",))
    hp = {"fc": t["fc.weight"].T, "fc_b": t.get("fc.bias", np.zeros((d,), np.float32)),
          "layer": _layer(t, "layers.0.", qkv_bias)}
    if n > 1:
        hp["extra_layers"] = [{"attn_norm": t[f"layers.{i}.input_layernorm.weight"],
                               **_layer(t, f"layers.{i}.", qkv_bias)} for i in range(1, n)]
    if "embed_tokens.weight" in t:
        hp["embed"] = t["embed_tokens.weight"]
    return PublishedHead("eagle", spec, hp, None, None, str(p))


# vLLM's EAGLE-3 variants (``llama_eagle3.py``) that specjax's head does not compute: each
# changes the forward where set true, so a head that sets one is refused, not misrun
_UNCOMPUTED = {
    "norm_before_fc": "one RMSNorm over the whole concatenation of the fused features "
                      "(input_norm.weight), vLLM's gpt-oss speculators",
    "norm_before_residual": "the layer's residual taken after hidden_norm",
}


def _eagle3_variant(p: Path, cfg: ConfigFields, tensors: dict, layers: tuple) -> tuple[bool, bool]:
    """``(fc_norm, norm_output)``: EAGLE 3.1's flags in ``config.json`` (absent: false);
    ``CheckpointError`` naming the field for a value that is not true or false, a variant
    ``_UNCOMPUTED`` names, ``eagle_config.use_aux_hidden_state`` false (no fused features),
    a ``num_aux_hidden_states`` other than the fused layers', more than one layer, or
    ``fc_norm.*`` tensors the config does not ask for."""
    where = p / "config.json"
    ec = cfg.obj("eagle_config")
    for key, what in _UNCOMPUTED.items():
        for fields in (cfg, ec):
            if fields.flag(key, False):
                raise CheckpointError(f"{where}: {fields.name(key)} is true ({what}), which "
                                      "specjax's EAGLE-3 head does not compute")
    if not ec.flag("use_aux_hidden_state", True):
        raise CheckpointError(f"{where}: 'eagle_config.use_aux_hidden_state' is false (a head "
                              "without fused features); specjax's EAGLE-3 head reads them")
    if cfg.integer("num_aux_hidden_states", len(layers)) != len(layers):
        raise CheckpointError(f"{where}: 'num_aux_hidden_states' is "
                              f"{cfg.d['num_aux_hidden_states']}, but the head fuses "
                              f"{len(layers)} layers {list(layers)}")
    if cfg.integer("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{where}: 'num_hidden_layers' is {cfg.d['num_hidden_layers']}; "
                              "an EAGLE-3 head is one layer (midlayer)")
    fc_norm, norm_output = cfg.flag("fc_norm", False), cfg.flag("norm_output", False)
    stray = sorted(k for k in tensors if k.startswith("fc_norm."))
    if stray and not fc_norm:
        raise CheckpointError(f"{where}: the weights hold {stray[:3]} (EAGLE 3.1's per-stream "
                              "norms), but 'fc_norm' is not true")
    return fc_norm, norm_output


def _eagle3(p: Path, f: Path, cfg: ConfigFields, tensors: dict, target_cfg) -> PublishedHead:
    from specjax.drafters.eagle3 import fused_layers

    d_t, v, n = target_cfg.hidden_size, target_cfg.vocab_size, target_cfg.num_layers
    d = cfg.integer("hidden_size")  # the head's own width (target_hidden_size: the target's)
    # SpecForge/SGLang's aux ids name layer outputs: id k is the state entering layer k + 1
    ids = cfg.obj("eagle_config").integers("eagle_aux_hidden_state_layer_ids", None)
    try:
        layers = fused_layers(n) if ids is None else tuple(i + 1 for i in ids)
    except ValueError as e:
        raise CheckpointError(f"{p}: {e}") from None
    if any(not 0 <= l < n for l in layers):
        raise CheckpointError(f"{p} fuses the outputs of layers {list(ids)} (the hidden "
                              f"states entering layers {list(layers)}), which a {n}-layer "
                              f"target does not have")
    fc_norm, post_norm = _eagle3_variant(p, cfg, tensors, layers)
    dv = cfg.integer("draft_vocab_size", v)
    spec = layer_spec(cfg, 2 * d)
    want = {"fc.weight": (d, len(layers) * d_t), "midlayer.input_layernorm.weight": (d,),
            "midlayer.hidden_norm.weight": (d,), **_layer_shapes("midlayer.", spec, False),
            "norm.weight": (d,), "lm_head.weight": (dv, d), "d2t": (dv,), "t2d": (v,),
            "embed_tokens.weight": (v, d)}
    if fc_norm:  # EAGLE 3.1: one norm per fused stream, each of the target's width
        want.update({f"fc_norm.{i}.weight": (d_t,) for i in range(len(layers))})
    # EAGLE drops d2t and t2d from a head whose draft vocabulary is the target's; a head
    # narrower than its target cannot read the target's embedding and carries its own
    optional = ("t2d",) + (("d2t",) if dv == v else ()) + (() if d != d_t
                                                            else ("embed_tokens.weight",))
    t = _take(tensors, want, f, optional=optional)
    d2t = t.get("d2t", np.zeros((dv,), np.int64))
    vocab_ids = np.arange(dv) + d2t.astype(np.int64)  # d2t holds offsets
    if vocab_ids.min() < 0 or vocab_ids.max() >= v or len(np.unique(vocab_ids)) != dv:
        raise CheckpointError(f"{f}: d2t does not map the {dv} draft ids to distinct target "
                              f"ids in [0, {v}) (target id = draft id + d2t[draft id])")
    if "t2d" in t and (int(t["t2d"].sum()) != dv or not t["t2d"][vocab_ids].all()):
        raise CheckpointError(f"{f}: t2d does not mark exactly the target ids d2t maps to")
    hp = {"fc": t["fc.weight"], "embed_norm": t["midlayer.input_layernorm.weight"],
          "hidden_norm": t["midlayer.hidden_norm.weight"],
          "layer": _layer(t, "midlayer.", False), "norm": t["norm.weight"],
          "lm_head": t["lm_head.weight"]}
    if "embed_tokens.weight" in t:
        hp["embed"] = t["embed_tokens.weight"]
    if fc_norm:
        hp["fc_norm"] = np.stack([t[f"fc_norm.{i}.weight"] for i in range(len(layers))])
    return PublishedHead("eagle3", spec, hp, vocab_ids.astype(np.int32), layers, str(p),
                         post_norm)


def drafter_and_params(head: PublishedHead, target, dtype, **sizes) -> tuple[Any, dict]:
    """``(drafter, dparams)`` for ``head`` on ``target`` (an ``EagleDrafter`` or an
    ``Eagle3Drafter`` with the head's layer sizes), weights cast to ``dtype``."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters import eagle, eagle3

    hp = jax.tree.map(lambda x: jnp.asarray(x, dtype), head.params)
    if head.kind == "eagle":
        return eagle.EagleDrafter(target, spec=head.spec, **sizes), {"head": hp}
    drafter = eagle3.Eagle3Drafter(target, spec=head.spec, layers=head.layers,
                                   post_norm=head.post_norm, **sizes)
    return drafter, eagle3.draft_params(hp, target, head.vocab_ids)


# ----------------------------------------------------------------------------- writing

SAVED_FILES = ("config.json", "model.safetensors", DIGEST_FILE)  # what ``save`` writes, only
_SAVED_BEFORE = ("config.json", "model.safetensors")  # a conversion from before the sidecar
SAVE_DTYPES = ("bfloat16", "float16", "float32")
_LAYER_KEYS = {"qkv", "o", "mlp_norm", "gate_up", "down"}
EAGLE_LINEAR_ROPE_BASE = 10000.0  # the base EAGLE's linear-scaling RoPE always uses


class NoPublishedLayout(ValueError):
    """A head that no published EAGLE layout expresses exactly (one line saying why)."""


def _np_dtype(name: str):
    import ml_dtypes

    if name not in SAVE_DTYPES:
        raise ValueError(f"dtype {name!r}: the published layouts store {', '.join(SAVE_DTYPES)}")
    return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}[name]


def _rope_fields(spec: blocks.LayerSpec, for_sglang: bool = False) -> dict:
    """``rope_theta`` and, for linear scaling, ``rope_scaling`` as SafeAILab/EAGLE's heads
    read it (``{"type": "linear", "factor": f}``; ``hf_rope`` reads it back to the same
    ``spec``). ``NoPublishedLayout`` for llama3 scaling, which EAGLE's head code does not
    apply (it knows linear and dynamic only), and ``_check_eagle_linear_rope``'s refusal."""
    rs = spec.rope_scaling
    out: dict = {"rope_theta": float(spec.rope_theta)}
    if rs.rope_type == "linear":
        _check_eagle_linear_rope(spec, for_sglang)
        out["rope_scaling"] = {"type": "linear", "factor": float(rs.factor)}
    elif rs.rope_type != "default":
        raise NoPublishedLayout(f"the head's RoPE has {rs.rope_type} scaling; SafeAILab/EAGLE's "
                                "head layers apply linear or dynamic scaling only")
    return out


def _check_eagle_linear_rope(spec: blocks.LayerSpec, for_sglang: bool) -> None:
    """``NoPublishedLayout`` for linear RoPE scaling with a base other than 10000, unless
    ``for_sglang``. SafeAILab/EAGLE (``cnets.py``, ``cnets1.py``) builds its linear-scaling
    rotary embedding without ``base=``, so it runs such a head with base 10000 whatever
    ``rope_theta`` says and drafts wrongly (measured: top-1 agreement 83% and 24% with the
    head's own forward); SpecForge and SGLang pass ``rope_theta`` and run it as trained.
    Refused by default rather than warned about, because the files load without error in
    EAGLE and only the acceptance rate shows the mistake."""
    if for_sglang or float(spec.rope_theta) == EAGLE_LINEAR_ROPE_BASE:
        return
    raise NoPublishedLayout(
        f"the head's RoPE has linear scaling with rope_theta {float(spec.rope_theta):g}, but "
        f"SafeAILab/EAGLE's code builds linear-scaled RoPE with base "
        f"{EAGLE_LINEAR_ROPE_BASE:g} whatever rope_theta says, so it would draft wrongly; "
        "SpecForge and SGLang pass rope_theta: to write the head for them, pass --for-sglang "
        "(convert-head) or for_sglang=True (published.save)")


def _float32_decimal(x: float) -> float:
    """``x``, or, when ``x`` is exactly a float32 value (a GGUF's metadata, read as float32:
    ``9.999999747378752e-06``), the shortest decimal that rounds to that float32 (``1e-05``);
    either way a number whose float32 rounding is ``x``'s."""
    f = np.float32(x)
    return float(str(f)) if float(f) == float(x) else float(x)


def _check_target_and_spec(kind: str, spec: blocks.LayerSpec, target_cfg) -> None:
    """``NoPublishedLayout`` for a target EAGLE's code does not draft for (not a Llama-family
    configuration) or a layer whose head size is not ``hidden_size // num_attention_heads``
    (EAGLE's configs have no ``head_dim``)."""
    from specjax.models.loading import family

    if family(target_cfg) != "Llama":
        raise NoPublishedLayout(f"the target is a {family(target_cfg)} model; the published "
                                f"EAGLE layouts are Llama-style heads for Llama-family targets")
    if spec.head_dim * spec.num_heads != spec.width:
        raise NoPublishedLayout(
            f"the head's attention has {spec.num_heads} heads of {spec.head_dim}, not "
            f"hidden_size {spec.width} // {spec.num_heads}: EAGLE's {kind} configs have no "
            "head_dim to say so")


def _config(kind: str, spec: blocks.LayerSpec, target_cfg, dtype: str, extra: dict,
            for_sglang: bool = False) -> dict:
    """The head's ``config.json`` object, keys in the published configs' order;
    ``rms_norm_eps`` as ``_float32_decimal`` writes it."""
    arch = "LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLM"
    cfg = {"architectures": [arch], "hidden_act": "silu", "hidden_size": spec.width,
           "intermediate_size": spec.intermediate_size,
           "max_position_embeddings": int(target_cfg.max_position_embeddings),
           "model_type": "llama", "num_attention_heads": spec.num_heads,
           "num_hidden_layers": 1, "num_key_value_heads": spec.num_kv_heads,
           "rms_norm_eps": _float32_decimal(spec.rms_norm_eps), **_rope_fields(spec, for_sglang),
           "tie_word_embeddings": False, "torch_dtype": dtype,
           "vocab_size": int(target_cfg.vocab_size)}
    return {**cfg, **extra}


def _split_layer(lp: dict, prefix: str, spec: blocks.LayerSpec) -> dict[str, np.ndarray]:
    """``blocks``' fused layer as the published tensors: ``qkv`` split into q, k, v (and
    ``qkv_b`` into their biases), ``gate_up`` into gate and up (``_layer``'s inverse)."""
    nq, nk = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    f = spec.intermediate_size
    qkv, gu = np.asarray(lp["qkv"]), np.asarray(lp["gate_up"])
    out = {f"{prefix}self_attn.q_proj.weight": qkv[:nq],
           f"{prefix}self_attn.k_proj.weight": qkv[nq:nq + nk],
           f"{prefix}self_attn.v_proj.weight": qkv[nq + nk:],
           f"{prefix}self_attn.o_proj.weight": np.asarray(lp["o"]),
           f"{prefix}post_attention_layernorm.weight": np.asarray(lp["mlp_norm"]),
           f"{prefix}mlp.gate_proj.weight": gu[:f], f"{prefix}mlp.up_proj.weight": gu[f:],
           f"{prefix}mlp.down_proj.weight": np.asarray(lp["down"])}
    if "qkv_b" in lp:
        b = np.asarray(lp["qkv_b"])
        out.update({f"{prefix}self_attn.q_proj.bias": b[:nq],
                    f"{prefix}self_attn.k_proj.bias": b[nq:nq + nk],
                    f"{prefix}self_attn.v_proj.bias": b[nq + nk:]})
    return out


def _check_keys(params: dict, top: set, optional: set, layer_optional: set, kind: str) -> None:
    """``NoPublishedLayout`` naming parameters the layout has no tensor for, or lacks."""
    layer = params.get("layer")
    got_layer = set(layer) if isinstance(layer, dict) else set()
    if "attn_norm" in got_layer and kind == "eagle":
        raise NoPublishedLayout(
            "the head's layer normalizes its attention input (attn_norm, as heads specjax "
            "trains do by default); EAGLE-1/2's layer 0 has no input_layernorm, so no EAGLE-1/2 "
            "layout computes this head: train with --no-attn-norm (train eagle, or train "
            "onpolicy --kind eagle) for a head that exports to it, or fine-tune this one "
            "into that layout (train onpolicy --no-attn-norm --fold-attn-norm --init DIR)")
    extra = sorted((set(params) - top - optional)
                   | {f"layer/{k}" for k in got_layer - _LAYER_KEYS - layer_optional})
    missing = sorted((top - set(params)) | {f"layer/{k}" for k in _LAYER_KEYS - got_layer})
    if extra or missing:
        what = "; ".join(([f"parameters {extra} have no tensor in it"] if extra else [])
                         + ([f"it needs {missing}"] if missing else []))
        raise NoPublishedLayout(f"not an {kind} head of the published layout: {what}")


def _eagle1_tensors(hp: dict, spec: blocks.LayerSpec, target_cfg, draft_vocab: int
                    ) -> tuple[dict, dict[str, np.ndarray]]:
    v = int(target_cfg.vocab_size)
    if 0 < int(draft_vocab) < v:
        raise NoPublishedLayout(
            f"the head drafts over a reduced vocabulary of {draft_vocab} of the target's {v} "
            "tokens, which the EAGLE-1/2 layout cannot express (it drafts over the target's "
            "whole LM head)")
    _check_keys(hp, {"fc", "fc_b", "layer"}, {"embed", "extra_layers"}, {"qkv_b"}, "eagle")
    if spec.in_width != spec.width:
        raise NoPublishedLayout(f"the head's layer reads {spec.in_width} features, not its "
                                f"width {spec.width}: not an EAGLE-1/2 layer")
    t = {"fc.weight": np.asarray(hp["fc"]).T, "fc.bias": np.asarray(hp["fc_b"]),
         **_split_layer(hp["layer"], "layers.0.", spec)}
    bias = "qkv_b" in hp["layer"]
    for i, lp in enumerate(hp.get("extra_layers", ()), start=1):
        if set(lp) != _LAYER_KEYS | {"attn_norm"} | ({"qkv_b"} if bias else set()):
            raise NoPublishedLayout(f"the head's layer {i} has parameters {sorted(lp)}; "
                                    "EAGLE-1/2's layer i > 0 is a whole pre-norm decoder "
                                    "layer, its biases as layer 0's")
        t.update(_split_layer(lp, f"layers.{i}.", spec))
        t[f"layers.{i}.input_layernorm.weight"] = np.asarray(lp["attn_norm"])
    if "embed" in hp:
        t["embed_tokens.weight"] = np.asarray(hp["embed"])
    extra = {"num_hidden_layers": 1 + len(hp.get("extra_layers", ())), "bias": True,
             "qkv_bias": bias}
    return extra, t


def _eagle3_tensors(hp: dict, spec: blocks.LayerSpec, target_cfg, vocab_ids, layers,
                    post_norm: bool = False) -> tuple[dict, dict[str, np.ndarray]]:
    from specjax.drafters.eagle3 import fused_layers

    n, d_t, v = target_cfg.num_layers, int(target_cfg.hidden_size), int(target_cfg.vocab_size)
    _check_keys(hp, {"fc", "embed_norm", "hidden_norm", "layer", "norm", "lm_head"},
                {"embed", "fc_norm"}, set(), "eagle3")
    if "fc_norm" in hp and tuple(np.shape(hp["fc_norm"])) != (len(fused_layers(n)), d_t):
        raise NoPublishedLayout(f"the head's fc_norm has shape {tuple(np.shape(hp['fc_norm']))}"
                                f"; EAGLE 3.1's is one norm of the target's width {d_t} per "
                                f"fused layer, ({len(fused_layers(n))}, {d_t})")
    if layers is not None and tuple(int(x) for x in layers) != fused_layers(n):
        raise NoPublishedLayout(
            f"the head fuses the hidden states entering layers {list(layers)}; SafeAILab/EAGLE "
            f"fuses layers {list(fused_layers(n))} of a {n}-layer target and reads no other")
    if spec.in_width != 2 * spec.width:
        raise NoPublishedLayout(f"the head's layer reads {spec.in_width} features, not twice "
                                f"its width {spec.width}: not an EAGLE-3 layer")
    if spec.width != d_t and "embed" not in hp:
        raise NoPublishedLayout(f"the head is {spec.width} wide and its target {d_t}: EAGLE-3 "
                                "needs such a head to carry its own embedding")
    dv = int(np.shape(hp["lm_head"])[0])
    ids = np.arange(dv) if vocab_ids is None else np.asarray(vocab_ids).astype(np.int64)
    if ids.shape != (dv,) or ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != dv:
        raise NoPublishedLayout(f"the head's vocabulary does not map its {dv} draft ids to "
                                f"distinct target ids in [0, {v})")
    lm_head, ids = _identity_order(np.asarray(hp["lm_head"]), ids, v)
    t2d = np.zeros((v,), np.bool_)
    t2d[ids] = True
    t = {"fc.weight": np.asarray(hp["fc"]),
         "midlayer.input_layernorm.weight": np.asarray(hp["embed_norm"]),
         "midlayer.hidden_norm.weight": np.asarray(hp["hidden_norm"]),
         **_split_layer(hp["layer"], "midlayer.", spec),
         "norm.weight": np.asarray(hp["norm"]), "lm_head.weight": lm_head,
         "d2t": (ids - np.arange(dv)).astype(np.int64), "t2d": t2d}
    if "embed" in hp:
        t["embed_tokens.weight"] = np.asarray(hp["embed"])
    if "fc_norm" in hp:
        t.update({f"fc_norm.{i}.weight": np.asarray(w) for i, w in enumerate(hp["fc_norm"])})
    extra = {"draft_vocab_size": dv, **({"target_hidden_size": d_t} if spec.width != d_t else {}),
             **({"fc_norm": True} if "fc_norm" in hp else {}),
             **({"norm_output": True} if post_norm else {})}
    return extra, t


def _identity_order(lm_head: np.ndarray, ids: np.ndarray, v: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """``(lm_head, ids)`` as written: unchanged for a reduced draft vocabulary; for a
    full-size one (``v`` rows, any order), the rows permuted into target-id order and the
    identity map, exactly (row ``j`` is the one that drafted target id ``j``). SafeAILab/EAGLE
    discards ``d2t``/``t2d`` when the draft vocabulary is as large as the target's, so it
    reads row ``j`` as target id ``j``: only identity order drafts right there. ``d2t``
    (zeros) and ``t2d`` (all true) are still written, because SpecForge's loader refuses a
    head missing any tensor but its embedding."""
    if len(ids) != v or np.array_equal(ids, np.arange(v)):
        return lm_head, ids
    return lm_head[np.argsort(ids)], np.arange(v)


def embedding_note(params: dict) -> str:
    """One line saying which token embedding the head written from ``params`` expects: its
    own (``embed_tokens.weight`` is written) or the target's (none is written)."""
    if "embed" in params:
        return ("the head carries its own embedding (embed_tokens.weight) and drafts with it; "
                "SpecForge by default replaces a head's embed_tokens with the target's: keep "
                "the head's own")
    return ("the head carries no embed_tokens.weight: it expects the target's embedding, "
            "which SafeAILab/EAGLE and SpecForge load from the target")


def to_published(kind: str, params: dict, target_cfg, *, spec: blocks.LayerSpec | None = None,
                 vocab_ids=None, layers=None, draft_vocab: int = 0, dtype: str = "bfloat16",
                 for_sglang: bool = False, post_norm: bool = False
                 ) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config.json object, {tensor name: array})`` of the published layout of the head
    ``params`` of ``kind`` (``"eagle"``: EAGLE-1/2, ``"eagle3"``) for a target of
    ``target_cfg``; floating tensors cast to ``dtype`` (``SAVE_DTYPES``). ``spec``: the
    head layer's sizes (default the target's: ``LayerSpec.of`` for ``eagle``,
    ``eagle3.layer_spec`` for ``eagle3``). ``vocab_ids`` (eagle3): the target id of each
    draft id (default the identity; a full-size vocabulary in another order is written in
    identity order, ``_identity_order``); ``layers`` (eagle3): the fused layers (must be
    EAGLE's own); ``draft_vocab`` (eagle): a reduced vocabulary the head drafts over (0:
    none). ``for_sglang``: the files are for SpecForge/SGLang, so linear RoPE scaling with
    a base other than 10000 is written rather than refused (``_check_eagle_linear_rope``).
    ``rms_norm_eps`` is written as ``_float32_decimal`` says. EAGLE 3.1 (eagle3): a head
    with ``fc_norm`` writes ``fc_norm.{i}.weight`` and ``"fc_norm": true``, and
    ``post_norm`` writes ``"norm_output": true``. ``NoPublishedLayout`` (one line) for a
    head the layout cannot express."""
    from specjax.drafters import eagle3

    np_dtype = _np_dtype(dtype)
    if kind not in ("eagle", "eagle3"):
        raise NoPublishedLayout(f"a {kind!r} head has no published EAGLE layout (eagle, eagle3)")
    if spec is None:
        spec = blocks.LayerSpec.of(target_cfg) if kind == "eagle" else eagle3.layer_spec(target_cfg)
    _check_target_and_spec(kind, spec, target_cfg)
    if kind == "eagle":
        if post_norm:
            raise NoPublishedLayout("post-norm feedback (norm_output) is EAGLE 3.1's; the "
                                    "EAGLE-1/2 layout has no such field")
        extra, t = _eagle1_tensors(params, spec, target_cfg, draft_vocab)
    else:
        extra, t = _eagle3_tensors(params, spec, target_cfg, vocab_ids, layers, post_norm)
    t = {k: np.ascontiguousarray(a.astype(np_dtype) if k not in ("d2t", "t2d") else a)
         for k, a in sorted(t.items())}
    return _config(kind, spec, target_cfg, dtype, extra, for_sglang), t


def check_out_dir(out: Path) -> None:
    """``FileExistsError`` unless ``out`` is absent, an empty directory, or a previous
    ``save`` (exactly ``SAVED_FILES``, or the two files before its sidecar), which is then
    overwritten."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    names = sorted(f.name for f in out.iterdir())
    if names and names not in (sorted(SAVED_FILES), sorted(_SAVED_BEFORE)):
        raise FileExistsError(f"{out} is not empty and not a previous conversion "
                              f"(it holds {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})")


def save(kind: str, params: dict, out_dir: str | Path, target_cfg, *, spec=None,
         vocab_ids=None, layers=None, draft_vocab: int = 0, dtype: str = "bfloat16",
         for_sglang: bool = False, post_norm: bool = False) -> Path:
    """Writes the head ``params`` of ``kind`` in its published layout (``to_published``) to
    ``out_dir`` (absent, empty, or a previous ``save``: ``FileExistsError`` otherwise):
    ``config.json`` (2-space JSON), ``model.safetensors`` (metadata ``format: pt``) and
    its SHA-256 in ``DIGEST_FILE`` (``write_digest``); returns the absolute directory.
    Deterministic: the same head writes the same bytes. The files are checked with
    ``load`` against ``target_cfg`` before they replace ``out_dir``'s, so a directory ``save`` returns is one ``load`` reads back to ``params``
    (cast to ``dtype``; a full-size draft vocabulary with its ``lm_head`` rows in identity
    order, the same draft logits over the target's vocabulary). The head drafts with the
    embedding ``embedding_note`` names: its own if ``params`` has ``embed``, else the
    target's. ``post_norm``: an EAGLE 3.1 head that feeds its post-norm output back
    (``PublishedHead.post_norm``; written as ``"norm_output": true``)."""
    import json

    from safetensors.numpy import save_file

    from specjax import _atomic

    out = Path(out_dir).absolute()
    _atomic.recover(out)  # a conversion a kill moved aside is back before the check
    check_out_dir(out)
    cfg, tensors = to_published(kind, params, target_cfg, spec=spec, vocab_ids=vocab_ids,
                                layers=layers, draft_vocab=draft_vocab, dtype=dtype,
                                for_sglang=for_sglang, post_norm=post_norm)
    with _atomic.replace_dir(out) as tmp:  # swapped in whole: a kill leaves old or new
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _atomic.plain_mode(tmp / "model.safetensors")
        write_digest(tmp)
        load(tmp, target_cfg)  # what was written reads back, for this target
    return out


__all__ = ["PublishedHead", "WEIGHT_FILES", "NoPublishedLayout", "drafter_and_params",
           "is_published", "load", "read_config", "read_tensors", "layer_spec", "save",
           "to_published", "check_out_dir", "SAVED_FILES", "SAVE_DTYPES", "embedding_note",
           "EAGLE_LINEAR_ROPE_BASE", "DIGEST_FILE", "write_digest", "check_digest"]
