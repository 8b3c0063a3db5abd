"""What the training commands do around training: CLI flags into training configurations,
warm starts from exported heads (``--init``), and exports that record what a head was
trained on.

Head directories are read and written by ``specjax.heads``, the functions decoding
(``specjax.methods``) uses too, so a head a run exports or starts from is read exactly as a
decoder reads it. Nothing here parses arguments or reports usage errors: that stays in
``specjax.commands.train``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specjax.heads import exported, kinds

# ----------------------------------------------------------------------------- configs
#
# Every training setting is a field of a frozen config dataclass, declared once by
# ``option``: its default, its help, the values it accepts and its CLI flag. The CLI makes
# its flags from the fields (``specjax.commands.common.config_flags``), ``from_args`` makes
# the config from them, and the config's ``__post_init__`` (``check_fields``) refuses a
# value out of range in the flag's words, from the CLI and the Python API alike. The
# settings several trainers share (``lr``, ``warmup``, ...) are declared once below.


def option(default, help: str, *, low=None, above=None, finite: bool = False,
           flag: str | None = None, parse=None, cli: bool = True,
           argparse: dict | None = None):
    """A config field: ``default``, the ``help`` of its flag, the smallest value it takes
    (``low``: ``>= low``; ``above``: ``> above``; ``finite``: no nan or inf), its flag
    (default ``--kebab-case`` of the field's name), ``parse`` (the flag's value to the
    field's, as ``from_args`` applies it; ``ValueError`` for a bad one), ``cli`` False for
    a field no flag sets, and ``argparse``: ``add_argument``'s keywords where the default
    ones (the default's type and value, ``store_true`` for a bool) do not fit."""
    return dataclasses.field(default=default, metadata={
        "help": help, "low": low, "above": above, "finite": finite, "flag": flag,
        "parse": parse, "cli": cli, "argparse": dict(argparse or {})})


def flag_of(f: dataclasses.Field) -> str:
    """The CLI flag of the config field ``f``."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def dest_of(f: dataclasses.Field) -> str:
    """The ``argparse`` attribute the flag of ``f`` sets."""
    return f.metadata.get("argparse", {}).get("dest") or flag_of(f)[2:].replace("-", "_")


def check_fields(cfg) -> None:
    """``ValueError`` naming the first field of the config ``cfg`` out of its ``option``'s
    range, in its flag's words (``--lr must be > 0, got 0.0``)."""
    import math

    for f in dataclasses.fields(cfg):
        m, v = f.metadata, getattr(cfg, f.name)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if m.get("finite") and not math.isfinite(v):
            raise ValueError(f"{flag_of(f)} must be a finite number, got {v}")
        if m.get("low") is not None and not v >= m["low"]:
            raise ValueError(f"{flag_of(f)} must be >= {m['low']}, got {v}")
        if m.get("above") is not None and not v > m["above"]:
            raise ValueError(f"{flag_of(f)} must be > {m['above']}, got {v}")


def from_args(cls, args, **given):
    """An instance of the config dataclass ``cls``: each field named in ``given`` takes
    that value, every other field the attribute of ``args`` (an ``argparse`` namespace)
    its flag sets (``dest_of``; through its ``option``'s ``parse``) where ``args`` has
    one, and the rest keep ``cls``'s defaults. ``TypeError`` for a ``given`` name that is
    not a field; ``ValueError`` for a value the config refuses."""
    fields = dataclasses.fields(cls)
    unknown = sorted(set(given) - {f.name for f in fields})
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}")
    kw = {}
    for f in fields:
        if f.name in given or not f.metadata.get("cli", True):
            continue
        if hasattr(args, dest_of(f)):
            v, parse = getattr(args, dest_of(f)), f.metadata.get("parse")
            kw[f.name] = v if parse is None or v is None else parse(v)
    return cls(**kw, **given)


def int_list(flag: str, low: int | None = None):
    """``parse`` of a comma-separated list of ints (a tuple; each ``>= low``)."""
    def parse(text):
        if not isinstance(text, str):
            return tuple(text)
        try:
            out = tuple(int(x) for x in text.split(","))
        except ValueError:
            out = None
        if out is None or (low is not None and (not out or min(out) < low)):
            want = "ints" if low is None else f"layer ids >= {low}"
            raise ValueError(f"{flag} must be comma-separated {want}, got {text!r}")
        return out
    return parse


# the settings several trainers share, each declared here once (its default the trainer's)

def steps(default: int):
    return option(default, "optimizer steps", low=1)


def batch_tokens(default: int):
    return option(default, "tokens per minibatch (about: sequences of like length, padded)",
                  low=1)


def max_len(default: int = 512):
    return option(default, "tokens per training sequence (a longer one keeps its last ones)",
                  low=1)


def lr(default: float):
    return option(default, "peak learning rate (AdamW, reached after a linear warmup)",
                  finite=True, above=0)


def warmup(default: int):
    return option(default, "steps of linear learning-rate warmup", low=0)


def weight_decay(default: float):
    return option(default, "AdamW's weight decay", low=0)


def clip(default: float = 1.0):
    return option(default, "gradients clipped to this global norm", above=0)


def seed(default: int = 0):
    return option(default, "seed of the initialization, the data order and the noise")


def save_every(default: int):
    return option(default, "checkpoint every this many steps", low=1)


def val_examples(default: int = 0):
    return option(default, "examples held out and scored at every checkpoint (val_acc in "
                           "the log)", low=0)


def w_reg(default: float = 1.0, help: str = "weight of the feature regression"):
    return option(default, help, low=0)


def w_ce(default: float = 0.1, help: str = "weight of the cross-entropy against the "
                                           "target's distribution"):
    return option(default, help, low=0)


def noise(default: float = 0.1, help: str = "uniform noise on the input features, relative "
                                            "to their RMS"):
    return option(default, help, low=0)


def head_layers(default: int = 1, suffix: str = ""):
    return option(default, "decoder layers of the EAGLE-2 head; layers a warm start lacks "
                           "are added as the identity, so it starts from that head's "
                           "drafts" + suffix, low=1)


NO_ATTN_NORM = ("train the EAGLE-2 head without its layer's attention-input norm, as "
                "published EAGLE-1/2 heads' layer 0: the head SafeAILab/EAGLE's layout "
                "holds, exportable with --export-format eagle")


def attn_norm(suffix: str):
    """``--no-attn-norm`` (default None on the CLI: the command resolves it from --init)."""
    return option(True, NO_ATTN_NORM + suffix, flag="--no-attn-norm",
                  argparse={"dest": "attn_norm", "action": "store_const", "const": False,
                            "default": None})


# ----------------------------------------------------------------------------- provenance


def data_summary(data_dir: str | Path | None) -> dict | None:
    """The ``summary.json`` of a training corpus directory (None: no such file)."""
    f = Path(data_dir, "summary.json") if data_dir else None
    return json.loads(f.read_text()) if f is not None and f.exists() else None


def store_summary(root: str | Path, rounds: int | None = None) -> dict:
    """What an exported head records of the token shard store it trained on: its first
    ``rounds`` rounds (default: all it holds), not those the store gained since, nor those
    a run given a smaller ``--rounds`` never read."""
    m = json.loads(Path(root, "manifest.json").read_text())
    used = m["shards"] if rounds is None else m["shards"][:rounds]
    return {"kind": "onpolicy", "store": Path(root).name, "target": m["target"],
            "sampling": m["sampling"], "rounds": len(used),
            "tokens": sum(s["tokens"] for s in used),
            "answer_tokens": sum(s["answer_tokens"] for s in used)}


def record(model: str, cfg, state: dict, data: dict | None, *, train: dict | None = None,
           **extra) -> kinds.Record:
    """The ``kinds.Record`` of a finished run: ``model``, the config ``cfg`` as a dict (or
    ``train``), the steps in ``state``, the ``data`` summary and ``extra`` fields
    (``tokens_seen``, ``init``)."""
    return kinds.Record(model=model, train=dataclasses.asdict(cfg) if train is None else train,
                        steps_done=int(state["step"]), data=data, **extra)


# ----------------------------------------------------------------------------- warm starts


def eagle_init(path: str | Path, target_cfg) -> dict:
    """The parameters of the exported EAGLE-1/2 head in ``path`` (``train eagle --init``),
    read by ``kinds.load_eagle``, as decoding reads them."""
    return kinds.load_eagle(path, target_cfg)[0]


def redrafter_init(path: str | Path) -> tuple[dict, np.ndarray | None]:
    """``(parameters, draft vocabulary)`` of the exported ReDrafter head in ``path``
    (``train redrafter --init``: fine-tuning keeps both), read by
    ``kinds.load_redrafter``, as decoding reads them."""
    head, meta = kinds.load_redrafter(path)
    return head, kinds.redrafter_vocab(meta)


@dataclasses.dataclass(frozen=True)
class Start:
    """Where an on-policy run starts: the head directory whose parameters it loads (None: a
    random head), the vocabulary order it drafts from (None: none known), the name its
    export records as ``init``, and the EAGLE-2 head's drafting vocabulary (its first
    ``draft_vocab`` ids of ``order``; 0: the whole vocabulary), which its export keeps."""

    path: Any
    order: list | None
    name: str
    draft_vocab: int = 0


def onpolicy_start(init: str, shipped, kind) -> Start:
    """The ``Start`` of ``train onpolicy --init init`` for a head of ``kind``
    (``specjax.train.ttt.Kind``), read from ``head.json`` alone: ``none`` is a random head
    (with ``shipped``'s vocabulary order, if a head ships), ``shipped`` the head
    ``shipped`` (a directory; the caller refuses None), anything else a head directory.
    An EAGLE-2 head gives an EAGLE-3 run its vocabulary order only. ``CheckpointError``
    when the directory holds no EAGLE head."""
    if init == "none":
        order = exported.read_meta(shipped, kinds.EAGLE).get("vocab_ids") if shipped else None
        return Start(None, order, "none")
    path = shipped if init == "shipped" else init
    if path is None:
        raise ValueError("--init shipped: no EAGLE head ships for this model")
    saved = exported.read_kind(path)
    meta = exported.read_meta(path, saved if saved in (kinds.EAGLE, kinds.EAGLE3)
                              else kind.name)
    same = meta["kind"] == kind.name
    return Start(path if same else None, meta.get("vocab_ids"), Path(str(path)).name,
                 (meta.get("draft_vocab") or 0) if same and kind.name == kinds.EAGLE else 0)


def onpolicy_head(start: Start, target_cfg, kind) -> dict | None:
    """The parameters of ``start``'s head for a target of ``target_cfg`` (None: a random
    head), read by ``kinds.load_eagle`` or ``kinds.load_eagle3`` as ``kind`` says."""
    if start.path is None:
        return None
    load = kinds.load_eagle if kind.name == kinds.EAGLE else kinds.load_eagle3
    return load(start.path, target_cfg)[0]


def folded_head(lm, head: dict, store, layers) -> dict:
    """``head`` (an EAGLE-1/2 head with ``attn_norm``) with its norm folded
    (``train.eagle.fold_attn_norm``) at the ``fc`` output's mean RMS over the first round of
    ``store`` (``ShardStore``), its features from one prefill by ``lm``; prints the scale."""
    import jax
    import jax.numpy as jnp

    from specjax.train import eagle as train_eagle
    from specjax.train.onpolicy import prefill_features

    ex = prefill_features(lm, store.read(0), layers)
    hp = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), head)
    scale = train_eagle.fc_rms(lm.model, hp, lm.params, ex)
    print(f"folding the head's attention-input norm at RMS {scale:.4f} (the fc output's mean "
          f"over round 1's {len(ex)} sequences)", flush=True)
    return train_eagle.fold_attn_norm(hp, scale)


# ----------------------------------------------------------------------------- exports


def eagle_order(path: str | Path) -> list | None:
    """The vocabulary order (``vocab_ids``) the exported EAGLE-1/2 head in ``path``
    records, or None: a head warm-started from it keeps that order."""
    return exported.read_meta(path, "eagle").get("vocab_ids")


def export_eagle(state: dict, cfg, out: str | Path, *, model: str, corpus: Sequence,
                 vocab_size: int, draft_vocab: int, data_dir, order=None) -> Path:
    """``train eagle --export``: the trained head with the vocabulary order ``order`` (that
    of the head it started from), else the corpus's 32768 most frequent ids
    (``draft_vocab`` of them drafted by default; 0: all), and the corpus summary."""
    from specjax.train import eagle as train_eagle

    ids = (np.asarray(order, np.int32) if order is not None
           else train_eagle.vocab_by_frequency(corpus, vocab_size, 32768))
    return kinds.save_eagle(state["params"], out, record(model, cfg, state,
                                                         data_summary(data_dir)),
                            vocab_ids=ids, draft_vocab=draft_vocab)


def export_redrafter(state: dict, cfg, ids, out: str | Path, *, model: str, data_dir,
                     shards, init) -> Path:
    """``train redrafter --export``: the trained head over ``ids`` (None: the whole
    vocabulary), with the summary of the corpus (``data_dir``) or shard store (``shards``)
    and the name of the head it started from (``init``, a directory, or None)."""
    data = data_summary(data_dir) if data_dir else store_summary(shards) if shards else None
    rec = record(model, cfg, state, data, init=init and Path(init).name)
    return kinds.save_redrafter(state["params"], out, rec, vocab_ids=ids)


def export_exit_heads(state: dict, cfg, out: str | Path, *, model: str, corpus: Sequence,
                      vocab_size: int, data_dir) -> Path:
    """``train exit-heads --export``: the trained adapters, with the ids the KL was taken
    over (the only tokens the exits propose; none when it was the whole vocabulary)."""
    from specjax.train import exit_heads as train_exits

    ids = train_exits.vocab_ids(corpus, vocab_size, cfg)
    return kinds.save_exit_heads(state["params"], out,
                                 record(model, cfg, state, data_summary(data_dir)),
                                 layers=cfg.layers, rank=cfg.rank, vocab_ids=ids)


def export_onpolicy(state: dict, kind, cfg, out: str | Path, *, model: str, target_cfg,
                    start: Start, shards, vocab_ids) -> Path:
    """``train onpolicy --export``: the trained head of ``kind``, with the shard store's
    summary; an EAGLE-2 head keeps the full vocabulary order it started from and the
    drafting vocabulary of the head it started from (``start.draft_vocab``: Gemma's heads
    draft over 8,192 ids of 262,144), an EAGLE-3 head records its ``vocab_ids`` and the
    target layers it fuses."""
    rec = record(model, cfg, state, store_summary(shards, int(state["round"])),
                 train={**dataclasses.asdict(cfg), "onpolicy": True},
                 tokens_seen=int(state["tokens"]), init=start.name)
    if kind.name == kinds.EAGLE:
        order = start.order if start.order is not None else vocab_ids
        return kinds.save_eagle(state["params"], out, rec, vocab_ids=order,
                                draft_vocab=start.draft_vocab)
    return kinds.save_eagle3(state["params"], out, rec, vocab_ids=vocab_ids,
                             layers=kind.layers(target_cfg)[:-1])


# ----------------------------------------------------------------------------- published

def published_dir(export_dir: str | Path, kind: str) -> Path:
    """Where ``--export-format KIND`` writes the published copy of the head exported to
    ``export_dir``: the sibling directory ``EXPORT-KIND`` (``EXPORT-eagle``,
    ``EXPORT-eagle3``)."""
    p = Path(export_dir).absolute()
    return p.with_name(f"{p.name}-{kind}")


def export_published(head_dir: str | Path, target_cfg) -> Path:
    """The EAGLE-1/2 or EAGLE-3 head exported to ``head_dir`` (its ``head.json`` says
    which), written again in SafeAILab/EAGLE's published layout to
    ``published_dir(head_dir, kind)`` (``published.save``, bfloat16: the exported weights
    unchanged); returns that directory. ``NoPublishedLayout`` for a head the layout
    cannot express (an EAGLE-1/2 head with ``attn_norm`` or a reduced ``draft_vocab``)."""
    import jax

    from specjax.heads import published

    kind = exported.read_kind(head_dir)
    if kind == kinds.EAGLE:
        params, meta = kinds.load_eagle(head_dir, target_cfg)
        sizes = {"draft_vocab": meta.get("draft_vocab") or 0}
    else:
        params, meta = kinds.load_eagle3(head_dir, target_cfg)
        sizes = {"vocab_ids": meta["vocab_ids"], "layers": meta["layers"]}
    return published.save(kind, jax.tree.map(np.asarray, params),
                          published_dir(head_dir, kind), target_cfg, **sizes)


def eagle_attn_norm(path: str | Path) -> bool | None:
    """Whether the exported EAGLE-1/2 head in ``path`` normalizes its layer's attention
    input (``kinds.eagle_attn_norm``), read from ``head.json`` alone; None when ``path``
    holds no readable ``eagle`` head (the loader reports that)."""
    try:
        return kinds.eagle_attn_norm(exported.read_meta(path, kinds.EAGLE))
    except (exported.CheckpointError, TypeError):
        return None


__all__ = ["option", "flag_of", "dest_of", "check_fields", "from_args", "int_list", "data_summary", "store_summary", "record", "eagle_init", "eagle_order",
           "redrafter_init", "Start", "onpolicy_start", "onpolicy_head", "export_eagle",
           "export_redrafter", "export_exit_heads", "export_onpolicy", "published_dir",
           "export_published", "eagle_attn_norm"]
