"""Checks of a head directory a user names (``--draft-checkpoint``, ``--exit-heads``, ...)
before anything loads: what is wrong with it, in one line naming the flag, and whether its
files are whole."""

from __future__ import annotations

import os
from pathlib import Path

from specjax.heads import exported
from specjax.heads.published import WEIGHT_FILES, check_digest


def head_dir_error(path, flag: str, kind: str, published: bool = False) -> str | None:
    """None when ``path`` is a directory holding an exported head of ``kind``
    (``head.json``) or, with ``published``, a published EAGLE head (``config.json`` and a
    weights file); otherwise the one-line error naming ``flag`` and ``path`` (a usage
    error). A head that a killed export or conversion left in its backup
    (``.NAME.old-PID``) is put back first (``specjax._atomic.recover``), as loading it
    would. Damaged files raise ``CheckpointError`` (one line naming the file) rather than
    return: an exported head's ``head.json`` that is not readable, was edited (its
    ``head_sha256``) or holds duplicate ``vocab_ids``, or its ``params.safetensors``
    against its ``params_sha256`` (``exported.check_files``); a published head's
    ``model.safetensors`` against the sidecar ``save`` writes (``published.check_digest``).
    No parameter is read into memory."""
    p = Path(str(path))
    if not os.path.lexists(p):  # an export or conversion killed between its renames
        from specjax import _atomic

        _atomic.recover(p)
    want = (f"an exported {kind} head (head.json)" + (" or a published EAGLE head "
            f"(config.json and {' or '.join(WEIGHT_FILES)})" if published else ""))
    if not p.exists():
        return f"{flag} {path} does not exist"
    if not p.is_dir():
        return f"{flag} {path} is a file; give the directory of {want}"
    if (p / exported.HEAD_JSON).is_file():
        got = exported.read_kind(p)
        method = {"eagle": "eagle2", "eagle3": "eagle3"}
        if got not in (None, kind):
            return f"{flag} {path} holds an exported {got!r} head, not {kind!r}" + (
                f": use --method {method[got]}" if got in method and kind in method else "")
        exported.check_files(p, kind)
        return None
    if published and (p / "config.json").is_file():
        if not any((p / f).is_file() for f in WEIGHT_FILES):
            return (f"{flag} {path} has config.json but no weights: want "
                    f"{' or '.join(WEIGHT_FILES)} beside it")
        check_digest(p)
        return None
    what = "is empty" if not any(p.iterdir()) else (
        "has no head.json" + (" and no config.json" if published else ""))
    return f"{flag} {path} {what}: want {want}"


__all__ = ["head_dir_error"]
