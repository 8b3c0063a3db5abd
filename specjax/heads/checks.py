"""Checks of a head directory a user names (``--draft-checkpoint``, ``--exit-heads``, ...)
before anything loads: what is wrong with it, in one line naming the flag."""

from __future__ import annotations

from pathlib import Path

from specjax.heads import exported
from specjax.heads.published import WEIGHT_FILES


def head_dir_error(path, flag: str, kind: str, published: bool = False) -> str | None:
    """None when ``path`` is a directory holding an exported head of ``kind``
    (``head.json``) or, with ``published``, a published EAGLE head (``config.json`` and a
    weights file); otherwise the one-line error naming ``flag`` and ``path``. A
    ``head.json`` that cannot be read passes: loading names the corruption."""
    p = Path(str(path))
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
        return None
    if published and (p / "config.json").is_file():
        if not any((p / f).is_file() for f in WEIGHT_FILES):
            return (f"{flag} {path} has config.json but no weights: want "
                    f"{' or '.join(WEIGHT_FILES)} beside it")
        return None
    what = "is empty" if not any(p.iterdir()) else (
        "has no head.json" + (" and no config.json" if published else ""))
    return f"{flag} {path} {what}: want {want}"


__all__ = ["head_dir_error"]
