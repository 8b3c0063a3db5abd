"""Draft heads on disk: every file specjax reads or writes of a head, in one package.

- ``exported``: the format specjax exports (``head.json`` and ``params.safetensors``),
  kind-agnostic: ``export_head``, ``load_head``, ``read_meta``, ``CheckpointError``.
- ``kinds``: one save and one load per head kind over that format (``save_eagle`` /
  ``load_eagle``, ``eagle3``, ``redrafter``, ``exit_heads``; ``Record``), used by decoding
  and training alike.
- ``published``: EAGLE-1/2 and EAGLE-3 heads in SafeAILab/EAGLE's and SpecForge's layouts
  (``config.json`` and torch or safetensors weights): ``published.load``, ``published.save``.
- ``shipped``: the heads that ship as package data, in the directories beside these
  modules (``shipped_head(kind, model)``).
- ``checks``: what is wrong with a head directory a user names (``head_dir_error``).

The drafting math these heads feed is ``specjax.drafters``'; this package sits above it.
"""

from __future__ import annotations

from specjax.heads import checks, exported, kinds, published, shipped
from specjax.heads.checks import head_dir_error
from specjax.heads.exported import (HEAD_JSON, PARAMS, CheckpointError, export_head,
                                    file_sha256, load_head, place, read_kind, read_meta)
from specjax.heads.kinds import (EAGLE, EAGLE3, EXIT_HEADS, REDRAFTER, Record, eagle3_fields,
                                 eagle_attn_norm, eagle_layers, load_eagle, load_eagle3,
                                 load_exit_heads, load_redrafter, redrafter_vocab, save_eagle,
                                 save_eagle3, save_exit_heads, save_redrafter)
from specjax.heads.published import NoPublishedLayout, PublishedHead, is_published
from specjax.heads.shipped import SHIPPED, shipped_head

__all__ = ["checks", "exported", "kinds", "published", "shipped",
           "HEAD_JSON", "PARAMS", "CheckpointError", "export_head", "file_sha256", "load_head",
           "place", "read_kind", "read_meta",
           "EAGLE", "EAGLE3", "EXIT_HEADS", "REDRAFTER", "Record", "eagle3_fields",
           "eagle_attn_norm", "eagle_layers", "load_eagle", "load_eagle3", "load_exit_heads",
           "load_redrafter", "redrafter_vocab", "save_eagle", "save_eagle3", "save_exit_heads",
           "save_redrafter", "NoPublishedLayout", "PublishedHead", "is_published",
           "SHIPPED", "shipped_head", "head_dir_error"]
