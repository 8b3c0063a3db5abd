"""Random-weight HF T5 directories in the shapes of public checkpoints.

No T5 weights install offline, so exactness is proven on directories that transformers
builds and saves with random initialization, laid out as the public checkpoints are: the
same ``config.json`` fields (``t5-small`` ties its LM head; v1.1 and Flan keep an untied
``lm_head.weight``). A user with real weights points ``--model`` at their directory instead.
Needs torch and transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

#: HF config fields of the public checkpoints (layer shapes only; weights are random)
HF_SHAPES: dict[str, dict] = {
    "t5-small": dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6,
                     num_heads=8, feed_forward_proj="relu", n_positions=512),
    "t5-v1_1-small": dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=8,
                          num_heads=6, feed_forward_proj="gated-gelu",
                          tie_word_embeddings=False),
    "flan-t5-base": dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=2048, num_layers=12,
                         num_heads=12, feed_forward_proj="gated-gelu",
                         tie_word_embeddings=False),
}


def save_random(path: str | Path, shape: str | dict, seed: int = 0) -> Path:
    """Writes a random-weight ``T5ForConditionalGeneration`` to ``path`` (``config.json`` and
    ``model.safetensors``) in the shape ``HF_SHAPES[shape]`` or the given config fields.

    Untied shapes get an ``lm_head.weight`` of their own, and ``config.json`` says
    ``tie_word_embeddings`` as the public files do (transformers 5 would otherwise save a
    tied head)."""
    from specjax._optional import require

    torch = require("torch", "writing a random T5 checkpoint")
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration

    fields = dict(HF_SHAPES[shape] if isinstance(shape, str) else shape)
    tie = fields.pop("tie_word_embeddings", True)
    path = Path(path)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(T5Config(decoder_start_token_id=0, **fields))
    model.save_pretrained(str(path))
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("scale_decoder_outputs", None)  # not in public files: derived from the tie
    cfg["tie_word_embeddings"] = tie
    cfg_file.write_text(json.dumps(cfg, indent=2))
    if not tie:
        st = path / "model.safetensors"
        tensors = load_file(str(st))
        shared = tensors["shared.weight"]
        tensors["lm_head.weight"] = torch.randn(shared.shape, dtype=shared.dtype) * shared.shape[1] ** -0.5
        save_file(tensors, str(st), metadata={"format": "pt"})
    return path


__all__ = ["HF_SHAPES", "save_random"]
