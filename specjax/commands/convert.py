"""``specjax convert-head``: a head specjax exported, written in the layout SafeAILab/EAGLE
publishes (``specjax.heads.published.save`` does the work; this module reads the
arguments, the head and its target's configuration). After writing it prints which token
embedding the converted head expects (``published.embedding_note``): SpecForge by default
replaces a head's ``embed_tokens`` with the target's. ``--for-sglang`` writes a head with
linear RoPE scaling and a base other than 10000, which SafeAILab/EAGLE's code runs with base
10000 (refused without it: ``published._check_eagle_linear_rope``).

Before the target's configuration is read, the head's files are checked whole
(``exported.check_files``: ``head.json``'s ``head_sha256`` and ``vocab_ids``,
``params.safetensors``' SHA-256), and a ``head.json`` without ``vocab_ids`` (every export
writes it, null where no vocabulary is ranked) is refused. The EAGLE-1/2 layout holds no
vocabulary: converting a head that ranks one (``vocab_ids``, what ``eagle2:...:vocab=N``
drafts over) prints one warning saying it is not written (``vocabulary_warning``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from specjax.commands.common import UsageError

KINDS = ("eagle", "eagle3")  # --to: the published layout, named as the head kind it holds


def _head_kind(head_dir: str) -> str:
    """The kind in ``head_dir``'s ``head.json``; ``UsageError`` for a path that is not an
    exported head's directory."""
    p = Path(head_dir)
    if not os.path.lexists(p):  # an export killed between its renames: its old head back
        from specjax import _atomic

        _atomic.recover(p.absolute())
    if not p.exists():
        raise UsageError(f"HEAD_DIR {head_dir} does not exist")
    if not p.is_dir():
        raise UsageError(f"HEAD_DIR {head_dir} is a file; give the directory of an exported head")
    if not (p / "head.json").is_file():
        what = ("a published head already" if (p / "config.json").is_file()
                else "not a head specjax exported")
        raise UsageError(f"HEAD_DIR {head_dir} has no head.json: {what}")
    try:
        meta = json.loads((p / "head.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"HEAD_DIR {head_dir}: cannot read head.json ({e})") from None
    if not isinstance(meta, dict):
        raise UsageError(f"HEAD_DIR {head_dir}: head.json holds a JSON "
                         f"{type(meta).__name__}, not an object; export the head again")
    if "kind" not in meta:
        raise UsageError(f"HEAD_DIR {head_dir}: head.json names no kind (eagle or eagle3); "
                         "export the head again")
    return meta["kind"]


def vocabulary_warning(meta: dict, vocab_size: int) -> str | None:
    """The line ``convert-head --to eagle`` prints for a head whose ``head.json`` ranks a
    vocabulary (``vocab_ids``), which the EAGLE-1/2 layout cannot hold; None otherwise. (A
    reduced ``draft_vocab`` is refused before: ``published.NoPublishedLayout``.)"""
    ids = meta.get("vocab_ids")
    if not isinstance(ids, list) or not ids:
        return None
    train = meta.get("train")
    dv = train.get("draft_vocab") if isinstance(train, dict) else None
    reduced = isinstance(dv, int) and not isinstance(dv, bool) and 0 < dv < vocab_size
    trained = f", trained over the first {dv}" if reduced else ""
    return (f"the EAGLE-1/2 layout holds no draft vocabulary: the head's vocab_ids ({len(ids)} "
            f"token ids ranked by frequency{trained}) are not written, so the converted head "
            f"drafts over all {vocab_size} of the target's tokens; eagle2's "
            f"vocab={dv if reduced else 'N'} needs the exported head")


def target_config(model: str):
    """The configuration of the target ``model`` (a registered name, a GGUF file or an HF
    directory), read without its weights."""
    from specjax.models import loading, registry

    path = registry.resolve(model)
    return loading.hf_dir_config(path) if path.is_dir() else loading.gguf_file_config(path)


def cmd_convert(args) -> int:
    import jax
    import numpy as np

    from specjax import _atomic
    from specjax.heads import exported, kinds, published

    kind = _head_kind(args.head_dir)
    if kind != args.to:
        hint = f": use --to {kind}" if kind in KINDS else ", which has no published layout"
        raise UsageError(f"{args.head_dir} holds an exported {kind!r} head, not "
                         f"{args.to!r}{hint}")
    out = Path(args.out_dir).absolute()
    try:
        _atomic.check_writable(out, f"OUT_DIR {args.out_dir}")
        _atomic.recover(out)  # a conversion a kill moved aside is back before the check
        published.check_out_dir(out)
    except FileExistsError as e:
        raise UsageError(f"OUT_DIR {e}") from None
    except _atomic.OutputError as e:
        raise UsageError(str(e)) from None
    # every file of the head whole (head.json's own SHA-256, its vocab_ids, the
    # parameters'), before the target's configuration is read
    meta = exported.check_files(args.head_dir, kind)
    if "vocab_ids" not in meta:
        raise exported.CheckpointError(
            f"{Path(args.head_dir).absolute() / exported.HEAD_JSON} has no vocab_ids (every "
            f"export records the head's vocabulary, null where none is ranked): a damaged or "
            f"hand-written head.json; export the head again")
    model = args.model or meta.get("model")
    if not model:
        raise UsageError(f"{args.head_dir}'s head.json names no target: pass --model")
    cfg = target_config(model)
    # the validating loader decoding uses: head.json's sizes, vocabulary and layers checked
    load = kinds.load_eagle3 if kind == "eagle3" else kinds.load_eagle
    params, meta = load(args.head_dir, cfg)
    params = jax.tree.map(np.asarray, params)
    out = published.save(kind, params, args.out_dir, cfg, vocab_ids=meta.get("vocab_ids"),
                         layers=meta.get("layers"), draft_vocab=meta.get("draft_vocab") or 0,
                         dtype=args.dtype, for_sglang=args.for_sglang)
    layout = "EAGLE-3" if kind == "eagle3" else "EAGLE-1/2"
    print(f"wrote {out}: the {layout} layout (config.json, model.safetensors, {args.dtype}; "
          f"its SHA-256 in {published.DIGEST_FILE})")
    print(f"embedding: {published.embedding_note(params)}")
    if kind == "eagle" and (note := vocabulary_warning(meta, int(cfg.vocab_size))):
        print(f"specjax: warning: {note}", file=sys.stderr, flush=True)
    return 0


def register(sub) -> list:
    """Adds ``convert-head`` to ``sub``; returns its parser."""
    from specjax.heads.published import SAVE_DTYPES

    c = sub.add_parser(
        "convert-head", help="write an exported EAGLE head in SafeAILab/EAGLE's layout",
        description="Writes the head in HEAD_DIR (exported by specjax) to OUT_DIR as "
                    "SafeAILab/EAGLE publishes heads: config.json and model.safetensors "
                    "(with d2t/t2d for EAGLE-3). OUT_DIR must be absent, empty or an "
                    "earlier conversion. A head the layout cannot express is refused. "
                    "It prints which token embedding the written head expects, and "
                    "warns when the EAGLE-1/2 layout drops the head's ranked vocabulary "
                    "(vocab_ids). model.safetensors.sha256 beside the weights holds their "
                    "SHA-256, checked when specjax reads the head.")
    c.add_argument("head_dir", metavar="HEAD_DIR", help="an exported eagle or eagle3 head")
    c.add_argument("out_dir", metavar="OUT_DIR", help="the published head's directory")
    c.add_argument("--to", required=True, choices=KINDS,
                   help="eagle: the EAGLE-1/2 layout (an eagle head); eagle3: EAGLE-3's "
                        "(an eagle3 head, loaded by SafeAILab/EAGLE and SpecForge)")
    c.add_argument("--model", default=None,
                   help="the head's target (registered name, .gguf file or HF directory), "
                        "read for its configuration only; default: head.json's model")
    c.add_argument("--dtype", default="bfloat16", choices=SAVE_DTYPES,
                   help="the weights' dtype in model.safetensors (published heads: bfloat16)")
    c.add_argument("--for-sglang", action="store_true",
                   help="write a head with linear RoPE scaling and rope_theta other than 10000 "
                        "for SpecForge/SGLang, which pass rope_theta (SafeAILab/EAGLE's code "
                        "uses 10000 and drafts wrongly with it; refused without this flag)")
    c.set_defaults(fn=cmd_convert)
    return [c]
