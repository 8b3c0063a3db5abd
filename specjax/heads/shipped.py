"""The heads that ship with specjax: package data under ``specjax/heads/``, one table per
head kind from a target's registry name to its directory there."""

from __future__ import annotations

from importlib import resources

from specjax.heads.exported import HEAD_JSON
from specjax.heads.kinds import EAGLE, EXIT_HEADS, REDRAFTER

# kind -> registry name -> directory under specjax/heads/. No ReDrafter head ships: the
# trained SmolLM2-135M and Gemma-3-270M heads decoded slower than plain decoding (0.84x and
# 0.78x ``ar``); train one with ``REDRAFTER_RECIPE``.
SHIPPED: dict[str, dict[str, str]] = {
    EAGLE: {"smollm2-135m": "smollm2-135m-eagle", "gemma3-270m": "gemma3-270m-eagle"},
    EXIT_HEADS: {"smollm2-135m": "smollm2-135m-exits"},
    REDRAFTER: {},
}
REDRAFTER_RECIPE = (
    "`specjax features --model {model} --prompts PROMPTS --out FEAT`, then `specjax train "
    "redrafter --model {model} --data FEAT --run RUN --export DIR`, then pass "
    "--redrafter-checkpoint DIR")


def shipped_dir(name: str | None):
    """The package-data directory ``specjax/heads/<name>`` when it holds ``head.json``,
    else None (also for ``name`` None)."""
    if name is None:
        return None
    p = resources.files("specjax.heads").joinpath(name)
    return p if p.joinpath(HEAD_JSON).is_file() else None


def shipped_head(kind: str, model_name: str):
    """The directory of the head of ``kind`` (``"eagle"``, ``"exit-heads"``,
    ``"redrafter"``) that ships for the registry name ``model_name``, or None when none
    ships or its files are missing."""
    return shipped_dir(SHIPPED.get(kind, {}).get(model_name))


__all__ = ["SHIPPED", "REDRAFTER_RECIPE", "shipped_dir", "shipped_head"]
