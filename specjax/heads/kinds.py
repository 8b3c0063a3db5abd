"""One save and one load function per kind of exported head: the single place that writes
and reads each kind's parameters and ``head.json``.

=================  ===============  ==================  ======================================
kind (head.json)   head             save                load
=================  ===============  ==================  ======================================
``eagle``          EAGLE-1/2        ``save_eagle``      ``load_eagle``
``eagle3``         EAGLE-3          ``save_eagle3``     ``load_eagle3``
``redrafter``      ReDrafter        ``save_redrafter``  ``load_redrafter``
``exit-heads``     early-exit       ``save_exit_heads`` ``load_exit_heads``
=================  ===============  ==================  ======================================

Decoding (``specjax.methods``) loads heads here; training (``specjax.train``: exports, warm
starts, ``--init DIR``) saves and loads them here too, so both read a directory the same
way. The file layout, dtypes and device placement are ``specjax.heads.exported``'s
(``export_head`` / ``load_head``); this module adds what each kind writes into ``head.json``
and the parameter template a directory is checked against when it loads. Published EAGLE
layouts (``config.json`` and torch weights) are ``specjax.heads.published``'s.

``head.json`` holds ``kind``, the target's registry name (``model``), the kind's sizes, the
rest of the ``Record`` (how the head was trained), the kind's vocabulary and fused layers,
and ``shapes`` and ``dtypes`` (added by ``export_head``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.heads import exported

EAGLE, EAGLE3, REDRAFTER, EXIT_HEADS = "eagle", "eagle3", "redrafter", "exit-heads"


@dataclasses.dataclass(frozen=True)
class Record:
    """What ``head.json`` records of how a head was made, beside what its kind needs to
    load: the target's registry name, the training configuration (a JSON object), the
    optimizer steps done, the data it saw (None: unknown), and, written only when given,
    the tokens it saw and the head it started from (a directory name)."""

    model: str
    train: dict
    steps_done: int
    data: dict | None = None
    tokens_seen: int | None = None
    init: str | None = None

    def fields(self) -> dict:
        """The record as ``head.json`` fields, in the order they are written."""
        out: dict = {"model": self.model, "train": self.train, "steps_done": self.steps_done}
        if self.tokens_seen is not None:
            out["tokens_seen"] = self.tokens_seen
        if self.init is not None:
            out["init"] = self.init
        return {**out, "data": self.data}


def _ids(ids) -> list[int] | None:
    """Token ids as the JSON list ``head.json`` stores (None stays None)."""
    return None if ids is None else np.asarray(ids).astype(int).tolist()


def _save(params: Any, out_dir, kind: str, record: Record | None, sizes: dict, rest: dict,
          dtype) -> Path:
    """``exported.export_head`` of ``params``; ``head.json`` holds, in this order, ``kind``,
    the record's ``model``, ``sizes``, the rest of the record, then ``rest``."""
    rec = record.fields() if record is not None else {}
    model = {"model": rec.pop("model")} if "model" in rec else {}
    meta = {"kind": kind, **model, **sizes, **rec, **rest}
    return exported.export_head(params, out_dir, meta, dtype=dtype)


def _template(path, kind: str, make) -> Any:
    """``make()``, the parameters the head of ``kind`` in ``path`` must match; a one-line
    ``CheckpointError`` when the sizes its ``head.json`` gives cannot build one (a corrupt
    or hand-edited file)."""
    try:
        return make()
    except (KeyError, TypeError) as e:  # a size missing, None or not a number
        raise exported.CheckpointError(
            f"{Path(path).absolute()}: its {exported.HEAD_JSON} does not describe a {kind!r} "
            f"head ({type(e).__name__}: {str(e)[:200]})") from e


# ----------------------------------------------------------------------------- EAGLE-1/2

def save_eagle(params: Any, out_dir: str | Path, record: Record | None = None, *,
               vocab_ids=None, draft_vocab: int = 0, dtype=jnp.bfloat16) -> Path:
    """Writes an EAGLE-1/2 head (``eagle.init_head``'s tree) to ``out_dir``; returns the
    absolute directory. ``head.json``: ``draft_vocab`` (how many of ``vocab_ids`` a
    decoder drafts over by default; 0: the whole vocabulary), ``attn_norm: false`` for a
    head whose layer has no attention-input norm (written only then, so a normed head's
    ``head.json`` is as before), ``layers`` for a head of more than one decoder layer
    (written only then) and ``vocab_ids`` (token ids, most frequent first; None: none
    ranked). ``load_eagle`` reads it back bit for bit (in ``dtype``)."""
    sizes = {"draft_vocab": int(draft_vocab)}
    if "attn_norm" not in params["layer"]:
        sizes["attn_norm"] = False
    if len(params.get("extra_layers", ())):
        sizes["layers"] = 1 + len(params["extra_layers"])
    return _save(params, out_dir, EAGLE, record, sizes, {"vocab_ids": _ids(vocab_ids)}, dtype)


def eagle_attn_norm(meta: dict) -> bool:
    """Whether the EAGLE-1/2 head ``head.json``'s ``meta`` describes normalizes its
    layer's attention input (``layer["attn_norm"]``): ``meta["attn_norm"]``, True where
    absent (every head saved before heads without it could be trained). ``TypeError``
    for a value that is not a JSON boolean."""
    v = meta.get("attn_norm", True)
    if not isinstance(v, bool):
        raise TypeError(f"attn_norm is {v!r}, not true or false")
    return v


def eagle_layers(meta: dict) -> int:
    """How many decoder layers the EAGLE-1/2 head ``head.json``'s ``meta`` describes has:
    ``meta["layers"]``, 1 where absent. ``TypeError`` for a value that is not a positive
    JSON integer."""
    v = meta.get("layers", 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise TypeError(f"layers is {v!r}, not a positive integer")
    return v


def load_eagle(path: str | Path, target_cfg, *, mesh=None, specs=None) -> tuple[dict, dict]:
    """``(params, meta)`` of the EAGLE-1/2 head in ``path`` for a target of ``target_cfg``
    (with or without the layer's ``attn_norm``, as ``head.json`` says:
    ``eagle_attn_norm``; of ``eagle_layers`` decoder layers), placed as
    ``exported.load_head`` documents; ``CheckpointError``
    (one line) when ``path`` is not an exported ``eagle`` head or was made for another
    target's sizes."""
    from specjax.drafters import eagle

    meta = exported.read_meta(path, EAGLE)
    like = _template(path, EAGLE, lambda: eagle.init_head(
        target_cfg, jax.random.key(0), attn_norm=eagle_attn_norm(meta),
        layers=eagle_layers(meta)))
    return exported.load_head(path, EAGLE, like=like, mesh=mesh, specs=specs)


# ----------------------------------------------------------------------------- EAGLE-3

def save_eagle3(params: Any, out_dir: str | Path, record: Record | None = None, *,
                vocab_ids, layers: Sequence[int], dtype=jnp.bfloat16) -> Path:
    """Writes an EAGLE-3 head (``eagle3.init_head``'s tree, a row of ``lm_head`` per id of
    ``vocab_ids``) to ``out_dir``; returns the absolute directory. ``head.json``:
    ``vocab_ids`` (the head's draft vocabulary) and ``layers`` (the target layers whose
    hidden states it fuses). ``load_eagle3`` reads it back bit for bit (in ``dtype``)."""
    return _save(params, out_dir, EAGLE3, record, {"draft_vocab": 0},
                 {"vocab_ids": _ids(vocab_ids), "layers": [int(x) for x in layers]}, dtype)


def _int_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                       for x in v)


def eagle3_fields(meta: dict) -> tuple[list[int], list[int]]:
    """``(vocab_ids, layers)`` of the EAGLE-3 head ``head.json``'s ``meta`` describes: its
    draft vocabulary (a non-empty list of token ids) and fused layers (a list of layer
    numbers). ``TypeError`` naming the field otherwise (``null``, a string such as
    ``"2,3,3"``)."""
    ids, layers = meta.get("vocab_ids"), meta.get("layers")
    if not _int_list(ids) or not ids:
        raise TypeError(f"vocab_ids is {str(ids)[:40]}, not a list of token ids")
    if not _int_list(layers) or not layers:
        raise TypeError(f"layers is {layers!r}, not a list of layer numbers")
    return ids, layers


def load_eagle3(path: str | Path, target_cfg, *, mesh=None, specs=None) -> tuple[dict, dict]:
    """``(params, meta)`` of the EAGLE-3 head in ``path`` for a target of ``target_cfg``
    (its draft vocabulary is ``meta["vocab_ids"]``, its fused layers ``meta["layers"]``);
    ``CheckpointError`` (one line) when ``path`` is not an exported ``eagle3`` head or was
    made for another target's sizes."""
    from specjax.drafters import eagle3

    meta = exported.read_meta(path, EAGLE3)
    like = _template(path, EAGLE3, lambda: eagle3.init_head(target_cfg, jax.random.key(0),
                                                      len(eagle3_fields(meta)[0])))
    return exported.load_head(path, EAGLE3, like=like, mesh=mesh, specs=specs)


# ----------------------------------------------------------------------------- ReDrafter

def save_redrafter(params: Any, out_dir: str | Path, record: Record | None = None, *,
                   vocab_ids=None, dtype=jnp.bfloat16) -> Path:
    """Writes a ReDrafter head (``redrafter.init_head``'s tree, ``blocks`` keyed by int or
    str) to ``out_dir``; returns the absolute directory. ``head.json``: ``hidden_size``,
    ``blocks`` and ``draft_vocab``, read from the parameters, and ``vocab_ids`` (the ids
    the head's rows stand for; None: the whole vocabulary). ``ValueError`` when
    ``vocab_ids`` does not have a row per id. ``load_redrafter`` reads it back bit for bit
    (in ``dtype``, ``blocks`` keyed by str)."""
    from specjax.drafters import redrafter

    d, v, blocks = (int(n) for n in redrafter.head_sizes(params))
    if vocab_ids is not None and len(vocab_ids) != v:
        raise ValueError(f"the ReDrafter head drafts over {v} tokens, but {len(vocab_ids)} "
                         "vocab_ids were given")
    return _save(redrafter.exportable(params), out_dir, REDRAFTER, record,
                 {"hidden_size": d, "blocks": blocks, "draft_vocab": v},
                 {"vocab_ids": _ids(vocab_ids)}, dtype)


def load_redrafter(path: str | Path, hidden_size: int | None = None, *,
                   target: str = "the target", mesh=None, specs=None) -> tuple[dict, dict]:
    """``(params, meta)`` of the ReDrafter head in ``path`` (``blocks`` keyed by str, as
    stored; its draft vocabulary is ``meta["vocab_ids"]``, None: the whole vocabulary).
    ``ValueError`` naming ``target`` when ``hidden_size`` is given and the head was made
    for another; ``CheckpointError`` (one line) when ``path`` is not an exported
    ``redrafter`` head or its parameters differ from the sizes its ``head.json`` gives."""
    from specjax.drafters import redrafter

    meta = exported.read_meta(path, REDRAFTER)
    if hidden_size is not None and meta.get("hidden_size") != hidden_size:
        raise ValueError(f"{path} holds a ReDrafter head for hidden size "
                         f"{meta.get('hidden_size')}, but {target} has {hidden_size}")
    like = _template(path, REDRAFTER, lambda: redrafter.exportable(redrafter.init_head(
        meta["hidden_size"], meta["draft_vocab"], jax.random.key(0), meta["blocks"])))
    return exported.load_head(path, REDRAFTER, like=like, mesh=mesh, specs=specs)


def redrafter_vocab(meta: dict) -> np.ndarray | None:
    """The ReDrafter head's draft vocabulary from its ``meta`` as int32 ids (None: the
    whole vocabulary)."""
    ids = meta.get("vocab_ids")
    return None if ids is None else np.asarray(ids, np.int32)


# ----------------------------------------------------------------------------- exit heads

def save_exit_heads(params: Any, out_dir: str | Path, record: Record | None = None, *,
                    layers: Sequence[int], rank: int, vocab_ids=None,
                    dtype=jnp.bfloat16) -> Path:
    """Writes exit heads (``exit_heads.init_heads``' tree, an adapter per ``str(layer)``)
    to ``out_dir``; returns the absolute directory. ``head.json``: ``layers`` (in the
    order given), ``rank`` and, when given, ``vocab_ids`` (the only tokens the exits
    propose). ``ValueError`` when ``layers`` does not name exactly the adapters in
    ``params``. ``load_exit_heads`` reads it back."""
    if sorted(str(x) for x in layers) != sorted(str(k) for k in params):
        raise ValueError(f"layers {list(layers)} do not name the exit heads' adapters "
                         f"{sorted(params, key=int)}")
    rest = {} if vocab_ids is None else {"vocab_ids": _ids(vocab_ids)}
    return _save(params, out_dir, EXIT_HEADS, record,
                 {"layers": [int(x) for x in layers], "rank": int(rank)}, rest, dtype)


def load_exit_heads(path: str | Path, target, dtype=jnp.float32) -> tuple[dict, dict]:
    """``({layer: adapter}, meta)`` of the exit heads in ``path`` for the model ``target``,
    in ``dtype``, each adapter carrying ``vocab_ids`` when the heads have one; a one-line
    ``CheckpointError`` when ``path`` is not an exported ``exit-heads`` directory, is
    corrupt, or was made for another model."""
    from specjax.drafters import exit_heads

    meta = exported.read_meta(path, EXIT_HEADS)
    like = exit_heads.init_heads(target.config, meta["layers"], jax.random.key(0), meta["rank"])
    heads, meta = exported.load_head(path, EXIT_HEADS, like=like)
    heads = {int(l): jax.tree.map(lambda x: jnp.asarray(x, dtype), hp) for l, hp in heads.items()}
    ids = meta.get("vocab_ids")
    if ids is not None:
        ids = np.asarray(ids, np.int32)
        v = target.config.vocab_size
        if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= v \
                or len(np.unique(ids)) != len(ids):
            raise exported.CheckpointError(
                f"{path}: vocab_ids must be distinct token ids in [0, {v})")
        heads = {l: {**hp, "vocab_ids": jnp.asarray(ids)} for l, hp in heads.items()}
    return heads, meta


__all__ = ["Record", "EAGLE", "EAGLE3", "REDRAFTER", "EXIT_HEADS", "save_eagle", "load_eagle",
           "eagle_attn_norm", "eagle_layers",
           "save_eagle3", "load_eagle3", "eagle3_fields", "save_redrafter", "load_redrafter",
           "redrafter_vocab",
           "save_exit_heads", "load_exit_heads"]
