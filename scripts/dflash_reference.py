"""Writes the DFlash reference fixtures with z-lab's own code (torch, CPU, float32, eager).

Run in the reference environment (not the project's .venv):

    bash scripts/dflash_ref_env.sh && .venv-dflash/bin/python scripts/dflash_reference.py --out tests/data/dflash_ref

It builds a tiny random Qwen3 target (transformers `Qwen3ForCausalLM`) and a z-lab
`DFlashDraftModel`, saves both with `save_pretrained`, and records
  (a) single draft forwards without cache (context features -> block logits), and
  (b) cached multi-round greedy `dflash_generate` runs with their per-round acceptance,
checked against plain greedy target decoding (lossless).
Integers (token ids, positions, acceptance) go to reference.json, floats to reference.npz.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM

try:  # z-lab's reference: only in its own environment (scripts/dflash_ref_env.sh)
    import dflash.model as dm
    from dflash.model import DFlashDraftModel, extract_context_feature
except ModuleNotFoundError:  # importable elsewhere (tests/test_scripts.py); main() needs it
    dm = DFlashDraftModel = extract_context_feature = None

# z-lab/dflash commit 44947fb (dflash/model.py last changed in 7d2ea1e).
DFLASH_COMMIT = "44947fbf71114e241c96de194f4b382b5dd330d0"
MODEL_PY_SHA256 = "6dfb12d0eeebe085d78d23fc816a481a8b25257fd76891e939a41423c29c697b"

SEED = 2
MASK = 511
BLOCK = 4
TARGET_LAYER_IDS = [1, 3]
FAVOURED = 7          # the token made frequent in both target and drafter (see build())
U_EMBED, U_HEAD, U_MASK = 1.0, 3.0, 1.0  # strengths of the shared direction u (see build())
DIMS = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager",
            dtype="float32")
FORWARD_CTX_LENS = [5, 9, 17, 32]
FEATURES_CASE = 1     # the case whose context features are stored
SPEC_PROMPT_LENS = [6, 11, 16]
MAX_NEW_TOKENS = 32
EXPECTED_DRAFT_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{k}" for i in range(2) for k in (
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
CONSTRUCTION = (
    f"torch.manual_seed({SEED}); build Qwen3ForCausalLM(6 layers) then DFlashDraftModel(2 layers); in "
    "named_parameters order (target, then drafter): *norm* weights ~N(1,0.2), embed_tokens ~N(0,0.5), "
    f"other weights ~N(0,0.1); then u = randn(64)/|u|; embed_tokens += {U_EMBED}*u (every row); "
    f"lm_head.weight[{FAVOURED}] = {U_HEAD}*u; lm_head.weight[{MASK}] = 0; embed_tokens[{MASK}] += {U_MASK}*u. The shared "
    f"direction u makes token {FAVOURED} frequent for the target and (through the mask row) for the drafter, so "
    "a random drafter gets some drafts accepted. No training.")

README = """\
# DFlash reference fixtures (z-lab/dflash, torch, CPU, float32, eager attention)

Written by z-lab's own `dflash/model.py` (commit {commit7}, sha256 {model_py_sha256}) with torch {torch},
transformers {transformers}; regenerate (bit-identical) with `{command}`.
- `target/`: a tiny random Qwen3 target (`Qwen3ForCausalLM.save_pretrained`, 6 layers, vocab 512, hidden 64).
- `drafter/`: a random `DFlashDraftModel` in the hub layout (config.json with block_size 4, num_target_layers 6,
  dflash_config {{mask_token_id 511, target_layer_ids [1, 3]}}; model.safetensors without embed/lm_head).
- `reference.json`: versions, how the weights were made, the token ids of the single-forward cases and of the
  greedy `dflash_generate` runs (per-round blocks, positions, acceptance), checked equal to plain greedy decoding.
- `reference.npz` (numpy only): per case, `case{{i}}_logits` [4, 512] and `case{{i}}_hidden` [4, 64] at the 4 block
  slots, and `case1_context_features` [9, 128] = cat(hidden_states[2], hidden_states[4]) of the target.
"""


def build():
    torch.manual_seed(SEED)
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=6, **DIMS)).eval()
    dcfg = Qwen3Config(num_hidden_layers=2, **DIMS)
    dcfg.block_size = BLOCK
    dcfg.num_target_layers = 6
    dcfg.dflash_config = {"mask_token_id": MASK, "target_layer_ids": TARGET_LAYER_IDS}
    draft = DFlashDraftModel(dcfg).eval()
    with torch.no_grad():
        for mod in (target, draft):
            for name, p in mod.named_parameters():
                if "norm" in name:
                    torch.nn.init.normal_(p, 1.0, 0.2)
                elif "embed" in name:
                    torch.nn.init.normal_(p, 0.0, 0.5)
                else:
                    torch.nn.init.normal_(p, 0.0, 0.1)
        u = torch.randn(DIMS["hidden_size"])
        u /= u.norm()
        emb = target.model.embed_tokens.weight
        emb += U_EMBED * u
        target.lm_head.weight[FAVOURED] = U_HEAD * u
        target.lm_head.weight[MASK] = 0.0
        emb[MASK] += U_MASK * u
    assert target.config._attn_implementation == "eager", target.config._attn_implementation
    assert draft.config._attn_implementation == "eager", draft.config._attn_implementation
    return target, draft


@torch.no_grad()
def single_forward(target, draft, ctx):
    """One cacheless draft forward on context `ctx` (list of ids), as in round 1 of dflash_generate."""
    ids = torch.tensor([ctx])
    out = target(ids, output_hidden_states=True)
    feats = extract_context_feature(out.hidden_states, draft.target_layer_ids)  # [1, L, 2H]
    last = int(out.logits[0, -1].argmax())
    block = torch.tensor([[last] + [MASK] * (BLOCK - 1)])
    pos = torch.arange(len(ctx) + BLOCK)[None]
    h = draft(target_hidden=feats, noise_embedding=target.model.embed_tokens(block), position_ids=pos)
    logits = target.lm_head(h)
    return feats[0], block[0].tolist(), pos[0].tolist(), h[0], logits[0]


@torch.no_grad()
def greedy(target, prompt, n):
    ids = list(prompt)
    for _ in range(n):  # full recompute each step: independent of any cache
        ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def spec_run(target, draft, prompt):
    """dflash_generate (greedy) with hooks recording each round's draft call and verify block."""
    draft_calls, target_calls, margins = [], [], []

    def gap(logits):  # smallest top-1 minus top-2 logit over the rows (robustness of an argmax)
        top = logits.float().topk(2, dim=-1).values
        return float((top[..., 0] - top[..., 1]).min())

    def on_draft(_mod, _args, kwargs):
        pos = kwargs["position_ids"][0]
        draft_calls.append(dict(pos_first=int(pos[0]), pos_len=int(pos.shape[0]),
                                ctx_rows=int(kwargs["target_hidden"].shape[1])))

    def on_draft_out(_mod, _args, h):
        margins.append(("draft", gap(target.lm_head(h[:, 1:]))))

    def on_target(_mod, args, kwargs, output):
        target_calls.append(dict(input_ids=args[0][0].tolist(),
                                 pos_first=int(kwargs["position_ids"][0, 0]),
                                 argmax=output.logits[0].argmax(-1).tolist()))
        margins.append(("target", gap(output.logits)))

    hd = draft.register_forward_pre_hook(on_draft, with_kwargs=True)
    ht = target.register_forward_hook(on_target, with_kwargs=True)
    hdo = draft.register_forward_hook(on_draft_out)
    try:
        r = dm.dflash_generate(draft, target, torch.tensor([prompt]), MAX_NEW_TOKENS, None, 0.0,
                               return_stats=True)
    finally:
        hd.remove()
        ht.remove()
        hdo.remove()
    out = r.output_ids[0, len(prompt):].tolist()
    verify = target_calls[1:]  # [0] is the prefill
    assert len(verify) == len(draft_calls) == len(r.acceptance_lengths)
    rounds = []
    for d, v, a in zip(draft_calls, verify, r.acceptance_lengths):
        assert d["pos_first"] + d["pos_len"] == v["pos_first"] + BLOCK
        rounds.append(dict(start=v["pos_first"], draft_ctx_rows=d["ctx_rows"],
                           draft_pos_first=d["pos_first"], block=v["input_ids"],
                           target_argmax=v["argmax"], accepted=int(a)))
    return out, rounds, target_calls[0]["argmax"][-1], margins


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/data/dflash_ref", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dm._cuda_time = time.perf_counter  # return_stats calls torch.cuda.synchronize otherwise

    model_py = Path(dm.__file__).read_bytes()
    sha = hashlib.sha256(model_py).hexdigest()
    if sha != MODEL_PY_SHA256:
        raise SystemExit(f"dflash/model.py sha256 {sha} is not z-lab/dflash@{DFLASH_COMMIT[:7]}'s; "
                         "run scripts/dflash_ref_env.sh")
    versions = dict(torch=torch.__version__, transformers=transformers.__version__,
                    dflash=md.version("dflash"), dflash_commit=DFLASH_COMMIT, model_py_sha256=sha)

    target, draft = build()
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    target.save_pretrained(out / "target")
    draft.save_pretrained(out / "drafter")

    # The saved drafter: hub layout, keys as in docs/notes/dflash_references.md section 1.
    with safe_open(out / "drafter" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert keys == EXPECTED_DRAFT_KEYS, (sorted(keys - EXPECTED_DRAFT_KEYS), sorted(EXPECTED_DRAFT_KEYS - keys))
    dconf = json.loads((out / "drafter" / "config.json").read_text())
    for k in ("block_size", "num_target_layers", "dflash_config"):
        assert k in dconf, k
    # Reload both from disk (eager) and use the reloaded models from here on.
    target = Qwen3ForCausalLM.from_pretrained(out / "target", attn_implementation="eager").eval()
    draft = DFlashDraftModel.from_pretrained(out / "drafter", attn_implementation="eager").eval()
    assert draft.block_size == BLOCK and draft.mask_token_id == MASK
    assert draft.target_layer_ids == TARGET_LAYER_IDS

    g = torch.Generator().manual_seed(123)
    spec_prompts = [torch.randint(0, MASK, (n,), generator=g).tolist() for n in SPEC_PROMPT_LENS]
    g = torch.Generator().manual_seed(456)
    contexts = [torch.randint(0, MASK, (n,), generator=g).tolist() for n in FORWARD_CTX_LENS]

    arrays, cases = {}, []
    for i, ctx in enumerate(contexts):
        feats, block, pos, h, logits = single_forward(target, draft, ctx)
        arrays[f"case{i}_logits"] = logits.numpy().astype(np.float32)
        arrays[f"case{i}_hidden"] = h.numpy().astype(np.float32)
        if i == FEATURES_CASE:
            arrays[f"case{i}_context_features"] = feats.numpy().astype(np.float32)
        top = logits[1:].topk(2, dim=-1).values
        cases.append(dict(context=ctx, ctx_len=len(ctx), block=block, start=len(ctx), position_ids=pos,
                          draft_tokens=logits[1:].argmax(-1).tolist(),
                          min_top2_margin=float((top[:, 0] - top[:, 1]).min())))

    runs = []
    for prompt in spec_prompts:
        tokens, rounds, first, margins = spec_run(target, draft, prompt)
        via_method = draft.spec_generate(target, torch.tensor([prompt]), MAX_NEW_TOKENS, None, 0.0)
        assert via_method[0, len(prompt):].tolist() == tokens
        ref = greedy(target, prompt, MAX_NEW_TOKENS)
        assert tokens == ref, ("not lossless", tokens, ref)
        assert MASK not in tokens and first == tokens[0]
        runs.append(dict(prompt=prompt, max_new_tokens=MAX_NEW_TOKENS, output=tokens, greedy=ref,
                         acceptance_lengths=[r["accepted"] for r in rounds], rounds=rounds,
                         min_top2_margin=dict(draft=min(m for w, m in margins if w == "draft"),
                                              target=min(m for w, m in margins if w == "target"))))

    for k, v in arrays.items():
        assert np.isfinite(v).all(), k
    for i in range(len(contexts)):
        lg = arrays[f"case{i}_logits"]
        assert lg.std() > 0.1 and np.ptp(lg, axis=-1).min() > 0.1, i

    meta = dict(
        description="DFlash reference fixtures written by z-lab/dflash dflash/model.py on CPU, float32, eager.",
        command="bash scripts/dflash_ref_env.sh && .venv-dflash/bin/python scripts/dflash_reference.py "
                "--out tests/data/dflash_ref",
        versions=versions, seed=SEED, construction=CONSTRUCTION,
        target_dir="target", drafter_dir="drafter", mask_token_id=MASK, block_size=BLOCK,
        target_layer_ids=TARGET_LAYER_IDS,
        feature_hidden_state_indices=[lid + 1 for lid in TARGET_LAYER_IDS],
        forward_cases=cases, features_case=FEATURES_CASE, spec_runs=runs,
    )
    (out / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    np.savez(out / "reference.npz", **arrays)
    (out / "README.md").write_text(README.format(**versions, commit7=DFLASH_COMMIT[:7], command=meta["command"]))

    print("versions:", json.dumps(versions))
    for i, c in enumerate(cases):
        lg = arrays[f"case{i}_logits"]
        print(f"case{i}: ctx_len={c['ctx_len']} block={c['block']} max|logit|={np.abs(lg).max():.3f} "
              f"std={lg.std():.3f} draft={c['draft_tokens']} top2_margin={c['min_top2_margin']:.4f}")
    for j, r in enumerate(runs):
        acc = r["acceptance_lengths"]
        print(f"spec{j}: prompt_len={len(r['prompt'])} rounds={len(acc)} mean_accepted={np.mean(acc):.2f} "
              f"acceptance={acc} distinct_out={len(set(r['output']))} top2_margin={r['min_top2_margin']}")
    allacc = [a for r in runs for a in r["acceptance_lengths"]]
    print(f"all runs: mean acceptance length {np.mean(allacc):.3f} (incl. bonus), "
          f"draft tokens accepted per round {np.mean(allacc) - 1:.3f}; lossless vs greedy: yes")


if __name__ == "__main__":
    main()
