"""Loads an EAGLE-3 head in the published layout (``specjax convert-head ... --to eagle3``,
``--export-format eagle3``) with sgl-project/SpecForge's and SafeAILab/EAGLE's own model
code, unmodified, and compares their forward with specjax's on the same weights.

Run out of CI, by hand (needs torch, transformers and safetensors; tests never import it):

    python scripts/check_specforge_load.py SPECFORGE_DIR HEAD_DIR [--eagle EAGLE_DIR]
    # EAGLE's code under the transformers 4 it pins, SpecForge skipped:
    PYTHONPATH=DIR_WITH_TRANSFORMERS_4_46 python scripts/check_specforge_load.py \
        SPECFORGE_DIR HEAD_DIR --eagle EAGLE_DIR --only eagle

SPECFORGE_DIR is a checkout of SpecForge (the directory holding ``specforge/``; its package
is imported from there as is), EAGLE_DIR one of SafeAILab/EAGLE (holding ``eagle/``), HEAD_DIR
a head directory (``config.json`` and ``model.safetensors``). For each codebase it prints:

1. the model built from HEAD_DIR/config.json the way that code builds it (SpecForge:
   ``AutoDraftModelConfig.from_file`` then ``AutoDraftModel.from_config`` in bfloat16, as its
   exporters do, and again in float32 for step 4; EAGLE: ``EConfig.from_pretrained`` then
   ``cnets.Model``, which needs the transformers 4 its setup.py pins (4.46.2): under
   transformers 5 every config gets a ``rope_scaling`` without the ``"type"`` key it reads);
2. ``load_state_dict(strict=True)`` of model.safetensors: ok, or the missing and unexpected
   keys;
3. that code's own loading rule (SpecForge's ``materialize_draft``: no unexpected key, only
   embedding keys missing; EAGLE's ``EaModel``: ``strict=False``, the embedding comes from
   the target), ok or not;
4. its forward in float32 on random fused hidden states and tokens (a missing embedding
   filled with one random table, given to both sides), and the largest |difference| of its
   draft logits from specjax's (``published.load`` and ``eagle3.apply_head``).

Exits 1 if a model cannot be built, a loading rule fails, or the logits differ by more
than 1e-3.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from specjax.jax_setup import setup_jax  # noqa: E402

setup_jax()  # as the specjax commands run: XLA:CPU's in-place flag, the compilation cache

B, T, TOL = 2, 9, 1e-3


def _inputs(cfg: dict, seed: int = 0):
    """Random tokens [B,T], fused hidden states [B,T,3*th] and an embedding table [V,h]."""
    g = torch.Generator().manual_seed(seed)
    th = cfg.get("target_hidden_size", cfg["hidden_size"])
    tokens = torch.randint(0, cfg["vocab_size"], (B, T), generator=g)
    fused = torch.randn(B, T, 3 * th, generator=g)
    table = torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g) * 0.5
    return tokens, fused, table


def specjax_logits(head_dir: Path, cfg: dict, tokens, fused, table) -> np.ndarray:
    """specjax's draft logits [B,T,draft_vocab] of the head in ``head_dir``, float32. The
    target configuration is the head's (hidden size, vocabulary) with 32 layers (the layer
    count only decides which fused layers are in range)."""
    import jax.numpy as jnp

    from specjax.drafters import blocks, eagle3
    from specjax.heads import published

    target = types.SimpleNamespace(hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
                                   vocab_size=cfg["vocab_size"], num_layers=32)
    head = published.load(head_dir, target)
    hp = {k: v for k, v in head.params.items()}
    emb = np.asarray(hp.pop("embed", table.numpy()))[tokens.numpy()]
    hp = __import__("jax").tree.map(jnp.asarray, hp)
    k, v = blocks.empty_kv(head.spec, B, T, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    out, _, _ = eagle3.apply_head(head.spec, hp, jnp.asarray(emb), jnp.asarray(fused.numpy()),
                                  pos, k, v, jnp.zeros((B,), jnp.int32), blocks.causal(B, T))
    return np.asarray(eagle3.draft_logits(head.spec, hp, out))


def _strict(model, sd) -> tuple[bool, str]:
    try:
        model.load_state_dict(sd, strict=True)
        return True, "ok"
    except RuntimeError as e:
        return False, " ".join(str(e).split())[:400]


def check_specforge(sf_dir: Path, head_dir: Path, tokens, fused, table) -> np.ndarray:
    """SpecForge's LlamaForCausalLMEagle3 on the head; returns its float32 draft logits."""
    sys.path.insert(0, str(sf_dir))
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    config = AutoDraftModelConfig.from_file(str(head_dir / "config.json"))
    model = AutoDraftModel.from_config(config, torch_dtype=torch.bfloat16)
    print(f"specforge: built {type(model).__name__} from config.json")
    sd = load_file(str(head_dir / "model.safetensors"))
    ok, msg = _strict(model, sd)
    print(f"specforge: load_state_dict(strict=True): {msg}")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    rule = not unexpected and all("embed" in k.lower() for k in missing)
    print(f"specforge: materialize_draft's rule (no unexpected key, only embeddings missing): "
          f"{'ok' if rule else 'FAILS'}; missing {sorted(missing)}, unexpected "
          f"{sorted(unexpected)}")
    if not rule:
        raise SystemExit(1)
    # the forward on a float32 build: a bfloat16 build also rounds its RoPE cos/sin caches
    # (non-persistent buffers) to bfloat16, which .float() does not undo (~1e-3 in logits)
    model = AutoDraftModel.from_config(config).eval()
    model.load_state_dict(sd, strict=False)
    if "embed_tokens.weight" in missing:
        model.embed_tokens.weight.data.copy_(table)
    with torch.no_grad():  # as SpecForge's eagle3 trainer runs one step (cache_hidden None)
        h = model.project_hidden_states(fused)
        e = model.embed_input_ids(tokens).to(h.dtype)
        mask = model.prepare_decoder_attention_mask(torch.ones(B, T, dtype=torch.bool), h,
                                                    B, T, 0)
        pos = torch.arange(T)[None].expand(B, T)
        x = model.backbone(input_embeds=e, hidden_states=h, cache_hidden=None,
                           attention_mask=mask, position_ids=pos)
        return model.compute_logits(x).numpy()


def check_eagle(eagle_dir: Path, head_dir: Path, tokens, fused, table) -> np.ndarray:
    """SafeAILab/EAGLE's EAGLE-3 ``cnets.Model`` on the head; returns its float32 logits."""
    sys.path.insert(0, str(eagle_dir))
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    config = EConfig.from_pretrained(str(head_dir))
    model = Model(config, load_emb=False)
    print("eagle: built cnets.Model from config.json")
    sd = load_file(str(head_dir / "model.safetensors"))
    ok, msg = _strict(model, sd)
    print(f"eagle: load_state_dict(strict=True): {msg}")
    missing, unexpected = model.load_state_dict(sd, strict=False)  # as EaModel loads it
    rule = not unexpected and set(missing) <= {"embed_tokens.weight"}
    print(f"eagle: EaModel's load (strict=False, embedding from the target): "
          f"{'ok' if rule else 'FAILS'}; missing {sorted(missing)}, unexpected "
          f"{sorted(unexpected)}")
    if not rule:
        raise SystemExit(1)
    model = model.float().eval()
    if "embed_tokens.weight" in missing:
        model.embed_tokens.weight.data.copy_(table)
    with torch.no_grad():
        x = model(fused, input_ids=tokens)
        return model.lm_head(model.norm(x)).numpy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specforge_dir", type=Path)
    ap.add_argument("head_dir", type=Path)
    ap.add_argument("--eagle", type=Path, default=None, help="a SafeAILab/EAGLE checkout")
    ap.add_argument("--only", choices=("specforge", "eagle"), default=None,
                    help="run one codebase (they pin different transformers versions)")
    args = ap.parse_args(argv)
    cfg = json.loads((args.head_dir / "config.json").read_text())
    tokens, fused, table = _inputs(cfg)
    ours = specjax_logits(args.head_dir, cfg, tokens, fused, table)
    worst = 0.0
    runs = [] if args.only == "eagle" else [("specforge", check_specforge, args.specforge_dir)]
    if args.eagle is not None and args.only != "specforge":
        runs.append(("eagle", check_eagle, args.eagle))
    for name, fn, where in runs:
        theirs = fn(where.absolute(), args.head_dir, tokens, fused, table)
        diff = float(np.abs(theirs - ours).max())
        print(f"{name}: draft logits {theirs.shape}, max |{name} - specjax| = {diff:.3g} "
              f"(logits up to {np.abs(ours).max():.3g})")
        worst = max(worst, diff)
    print("OK" if worst <= TOL else f"FAIL: logits differ by {worst:.3g} > {TOL}")
    return 0 if worst <= TOL else 1


if __name__ == "__main__":
    raise SystemExit(main())
