"""Published EAGLE-1/2 and EAGLE-3 heads: loaded from SafeAILab/EAGLE's exact layouts
(``tests/published.py`` writes them with random weights), their forwards equal to an
independent PyTorch implementation, EAGLE-3 drafting over a real target's fused hidden
states, lossless at temperature 0 and 1, and every misfit refused in one line."""

from __future__ import annotations

import dataclasses

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import toys
from published import (d2t_absolute, d2t_target_ids, edit_state_dict, torch_eagle1_logits,
                       torch_eagle3_logits, write_eagle1_head, write_eagle3_head)
from specjax import methods
from specjax.core import sampling
from specjax.core.decoding import generate, prefill
from specjax.drafters import Context, blocks, eagle, eagle3
from specjax.heads import CheckpointError, published
from specjax.models.llama import Llama

H, NQ, NKV, F, V, DV = 32, 4, 2, 64, 64, 24
TARGET = toys.LLAMA_6
SIZES = dict(hidden=H, heads=NQ, kv_heads=NKV, intermediate=F, vocab=V)
B, T = 2, 7


def _inputs(seed: int, width: int):
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(V, H, generator=g) * 0.5, torch.randn(V, H, generator=g) * 0.5
    tokens = torch.randint(0, V, (B, T), generator=g)
    feats = torch.randn(B, T, width, generator=g)
    return embed, head, tokens, feats


def _run(fn, spec, hp, emb, x):
    """A head's ``apply_head`` over a causal sequence from an empty cache."""
    k, v = blocks.empty_kv(spec, B, T, jnp.float32, 1 + len(hp.get("extra_layers", ())))
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    out, _, _ = fn(spec, hp, jnp.asarray(emb), jnp.asarray(x), pos, k, v,
                   jnp.zeros((B,), jnp.int32), blocks.causal(B, T))
    return out


def _hp(head):
    return jax.tree.map(jnp.asarray, head.params)


@pytest.mark.parametrize("style,weights,dtype,layers", [
    ("vicuna", "pytorch_model.bin", torch.bfloat16, 1),
    ("llama3", "model.safetensors", torch.float32, 1),
    ("qwen2", "pytorch_model.bin", torch.float16, 1),
    ("llama3", "model.safetensors", torch.float32, 2)])
def test_eagle1_head_equals_the_pytorch_reference(tmp_path, style, weights, dtype, layers):
    sd, cfg = write_eagle1_head(tmp_path, **SIZES, style=style, weights=weights, dtype=dtype,
                                layers=layers)
    head = published.load(tmp_path, TARGET)
    assert head.kind == "eagle" and ("fc.bias" in sd) == (style != "llama3")
    assert "attn_norm" not in head.params["layer"]  # layer 0 has no input_layernorm
    assert len(head.params.get("extra_layers", ())) == layers - 1
    assert head.spec.rope_theta == cfg.get("rope_theta", 10000.0)
    embed, lm_head, tokens, feats = _inputs(1, H)
    out = _run(eagle.apply_head, head.spec, _hp(head), embed[tokens].numpy(), feats.numpy())
    ours = np.asarray(out @ jnp.asarray(lm_head.numpy()).T)
    ref = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats).detach().numpy()
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    for wrong in ("swap_concat", "input_norm"):  # a head built that way would fail the check
        bad = torch_eagle1_logits(sd, cfg, embed, lm_head, tokens, feats, wrong=wrong)
        assert np.abs(ours - bad.detach().numpy()).max() > 1e-2, wrong


@pytest.mark.parametrize("own_embedding,weights", [(False, "pytorch_model.bin"),
                                                   (True, "model.safetensors")])
def test_eagle3_head_equals_the_pytorch_reference(tmp_path, own_embedding, weights):
    sd, cfg = write_eagle3_head(tmp_path, **SIZES, draft_vocab=DV, own_embedding=own_embedding,
                                weights=weights)
    head = published.load(tmp_path, TARGET)
    assert head.kind == "eagle3" and head.layers == (2, 3, 3)
    assert ("embed" in head.params) == own_embedding
    embed, _, tokens, fused = _inputs(2, 3 * H)
    table = sd["embed_tokens.weight"] if own_embedding else embed
    spec, hp = head.spec, _hp(head)
    out = _run(eagle3.apply_head, spec, hp, table[tokens].numpy(), fused.numpy())
    ref_logits, ref_x = torch_eagle3_logits(sd, cfg, embed, tokens, fused)
    ours = np.asarray(eagle3.draft_logits(spec, hp, out))
    assert np.abs(ours - ref_logits.numpy()).max() < 1e-4
    # a later draft step: the head's own output replaces the fused feature, fc skipped
    out2 = _run(eagle3.apply_head, spec, hp, table[tokens].numpy(), ref_x.numpy())
    ref2, _ = torch_eagle3_logits(sd, cfg, embed, tokens, ref_x)
    assert np.abs(np.asarray(eagle3.draft_logits(spec, hp, out2)) - ref2.numpy()).max() < 1e-4
    bad, _ = torch_eagle3_logits(sd, cfg, embed, tokens, fused, wrong="swap_concat")
    assert np.abs(ours - bad.numpy()).max() > 1e-2
    draft_ids = torch.arange(DV)
    np.testing.assert_array_equal(head.vocab_ids, d2t_target_ids(sd["d2t"], draft_ids).numpy())
    assert (head.vocab_ids != d2t_absolute(sd["d2t"], draft_ids).numpy()).any()


# --- EAGLE-3 drafting over a real target ---------------------------------------------------

@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 6-layer transformers Llama saved as an HF directory (loaded by specjax) and
    an EAGLE-3 head for it in the published layout."""
    root = tmp_path_factory.mktemp("eagle3")
    lm = toys.loaded_llama(root / "toy", layers=6)
    c = lm.model.config
    sd, cfg = write_eagle3_head(root / "head", hidden=c.hidden_size, heads=c.num_heads,
                                kv_heads=c.num_kv_heads, intermediate=c.intermediate_size,
                                vocab=c.vocab_size, draft_vocab=48, seed=3)
    return lm, root, sd, cfg


def test_eagle3_drafts_the_reference_heads_top_tokens(target):
    """Level 1 of the tree is the reference head's top-k over the target's fused hidden
    states entering layers 2, 3 and 3 (HF ``hidden_states``); level 2 feeds the head its
    own output for the first child. Both mapped to target ids through d2t's offsets."""
    import transformers

    lm, root, sd, cfg = target
    built = methods.build("eagle3:2,3,12", lm, methods.Options(draft_checkpoint=str(root / "head")))
    drafter, dp = built.decoder.drafter, built.params[1]
    model, tp = lm.model, lm.params
    prompt, cap = [5, 9, 17, 3, 44, 2, 60, 7], 64
    p = len(prompt)
    buf = jnp.zeros((1, cap), jnp.int32).at[0, :p].set(jnp.asarray(prompt))
    h_last, cache, h_all = prefill(model, tp, buf, jnp.asarray([p]), model.init_cache(1, cap), 4,
                                   drafter.feature_layers)
    first = int(jnp.argmax(model.logits(tp, h_last)[0]))
    ctx = Context(tokens=buf.at[0, p].set(first), length=jnp.asarray([p + 1]),
                  prompt_len=jnp.asarray([p]), cache=cache, params=tp, hidden=h_all)
    draft, _, _ = drafter.propose(dp, drafter.init(dp, ctx, 4), ctx, jax.random.key(0),
                                  sampling.Greedy())

    hf = transformers.LlamaForCausalLM.from_pretrained(str(root / "toy")).eval()
    seq = torch.tensor([prompt + [first]])
    with torch.no_grad():
        hs = hf(seq, output_hidden_states=True).hidden_states
    fused = torch.cat([hs[2], hs[3], hs[3]], dim=-1)
    embed = hf.model.embed_tokens.weight.detach()
    logits, x = torch_eagle3_logits(sd, cfg, embed, seq[:, 1:], fused[:, :-1])
    top = torch.topk(logits[0, -1], 3).indices
    ids = d2t_target_ids(sd["d2t"], top).numpy()
    np.testing.assert_array_equal(np.asarray(draft.tokens[0, :3]), ids)
    assert (d2t_absolute(sd["d2t"], top).numpy() != ids).any()  # absolute ids would differ
    # the first child: the prefix reads the fused states, the child its parent's output
    seq2 = torch.cat([seq[:, 1:], torch.tensor([[int(ids[0])]])], 1)
    mixed_logits = _mixed_reference(sd, cfg, embed, seq2, fused[:, :-1], x[:, -1:])
    top2 = d2t_target_ids(sd["d2t"], torch.topk(mixed_logits[0, -1], 3).indices).numpy()
    np.testing.assert_array_equal(np.asarray(draft.tokens[0, 3:6]), top2)


def _mixed_reference(sd, cfg, embed, tokens, fused, own):
    """The reference head over ``tokens`` whose last position reads the head's own output
    ``own`` (fc skipped) and the others the fused states: ``fc`` applied to the fused part
    first, then one pass over ``h``-wide inputs (where ``fc`` is skipped)."""
    from published import _linear_apply

    x = torch.cat([_linear_apply(fused, sd, "fc"), own], dim=1)
    logits, _ = torch_eagle3_logits(sd, cfg, embed, tokens, x)
    return logits


@pytest.mark.parametrize("batch", [4, 1])
def test_eagle3_greedy_equals_ar(target, batch):
    lm, root, _, _ = target
    built = methods.build("eagle3:3,3,8", lm, methods.Options(draft_checkpoint=str(root / "head")))
    prompts = [[5, 9, 17, 3, 44], [1, 2], [7] * 11, [100, 3, 8]][:batch]
    budgets = [24, 9, 17, 20][:batch]
    ar = generate(lm.model, lm.params, prompts, max_new_tokens=budgets).to_lists()
    out = built(prompts, max_new_tokens=budgets)
    assert out.to_lists() == ar
    assert out.drafted.sum() > 0  # the tree was drafted and verified, not skipped


def test_published_eagle1_head_decodes_as_ar(target, tmp_path):
    lm, _, _, _ = target
    c = lm.model.config
    write_eagle1_head(tmp_path, hidden=c.hidden_size, heads=c.num_heads,
                      kv_heads=c.num_kv_heads, intermediate=c.intermediate_size,
                      vocab=c.vocab_size, style="llama3")
    built = methods.build("eagle2:3,3,8", lm, methods.Options(draft_checkpoint=str(tmp_path)))
    assert built.decoder.drafter.layer_spec.rope_theta == 500000.0
    prompts = [[5, 9, 17, 3, 44], [7] * 11]
    ar = generate(lm.model, lm.params, prompts, max_new_tokens=[20, 13]).to_lists()
    assert built(prompts, max_new_tokens=[20, 13]).to_lists() == ar


@pytest.mark.extended  # opt-in (the suite's time): the same head decodes through
# methods.build, which bench calls, in test_eagle3_greedy_equals_ar, and bench's CLI runs by
# default in tests/test_bench.py
def test_cli_bench_with_a_published_eagle3_head(target, monkeypatch, tmp_path):
    from specjax import cli

    lm, root, _, _ = target
    monkeypatch.setattr("specjax.models.load", lambda *a, **k: lm)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--methods", "ar,eagle3:2,3,6", "--draft-checkpoint",
                     str(root / "head"), "--limit", "2", "--max-new-tokens", "8",
                     "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["greedy_mismatch_vs_ar"] == [] and rep["methods"]["eagle3:2,3,6"]["n"] == 2


# --- temperature 1 -------------------------------------------------------------------------

def _pairs(drafter, dp, rule, batch: int, calls: int):
    from laws import PROMPT, exact_pair, pvalue
    from specjax.core.speculative import speculative_generate

    model, tparams = toys.llama(seed=1)
    sampler = sampling.Sample(1.0)
    counts, acc = np.zeros((toys.V, toys.V)), []
    for i in range(calls):
        out = speculative_generate(model, tparams, drafter, dp, [PROMPT] * batch,
                                   max_new_tokens=2, sampler=sampler, key=jax.random.key(i),
                                   rule=rule)
        y = np.asarray(out.tokens)[:, :2]
        np.add.at(counts, (y[:, 0], y[:, 1]), 1)
        acc.append(np.asarray(out.accepted_at)[:, 0])
    return pvalue(counts, exact_pair(model, tparams, sampler)), float(np.mean(acc))


@pytest.fixture(scope="module")
def toy_eagle3():
    from laws import exact_pair

    model, tparams = toys.llama(seed=1)
    head = eagle3.init_head(toys.LLAMA, jax.random.key(4), 6)
    # a draft vocabulary of the target's likeliest second tokens, so drafts are often accepted
    likely = np.argsort(-exact_pair(model, tparams, sampling.Sample(1.0)).sum(0))[:6]
    dp = eagle3.draft_params(head, model, np.sort(likely))
    return eagle3.Eagle3Drafter(model, depth=2, topk=3, total_tokens=6), dp


def test_eagle3_sampling_keeps_the_target_law(toy_eagle3):
    """2,000 sampled pairs (y0, y1): 4 calls of 500 rows, each row on its own key."""
    from specjax.core.verify import Rejection

    drafter, dp = toy_eagle3
    batch, calls = 500, 4
    p, acc = _pairs(drafter, dp, Rejection(), batch, calls)
    assert p > 1e-4, f"eagle3 at temperature 1, batch {batch}: differs from the target (p={p:.2e})"
    assert acc > 0.1, f"drafts were accepted {acc:.0%} of rounds: the test would be vacuous"


def test_eagle3_sampling_negative_control(toy_eagle3):
    """The same chi-square rejects a lossy acceptance rule (Typical) on the same drafts."""
    from specjax.core.verify import Typical

    drafter, dp = toy_eagle3
    p, _ = _pairs(drafter, dp, Typical(epsilon=0.05, delta=0.05), 256, 8)
    assert p < 1e-4, f"the lossy rule passed the chi-square (p={p:.2e}): the test is blind"


# --- misfits: one clear line each --------------------------------------------------------

@pytest.mark.parametrize("case,match", [
    ("hidden", "hidden size 48"), ("vocab", "vocabulary of 80"),
    ("missing", r"missing tensors \['layers.0.mlp.down_proj.weight'\]"),
    ("input_norm", r"unexpected tensors \['layers.0.input_layernorm.weight'\]"),
    ("shape", "fc.weight has shape"), ("truncated", "corrupt or truncated")])
def test_eagle1_misfits_are_refused(tmp_path, case, match):
    sizes = dict(SIZES, hidden=48) if case == "hidden" else dict(SIZES, vocab=80) \
        if case == "vocab" else SIZES
    write_eagle1_head(tmp_path, **sizes, style="vicuna")
    if case == "missing":
        edit_state_dict(tmp_path, lambda sd: sd.pop("layers.0.mlp.down_proj.weight"))
    elif case == "input_norm":
        edit_state_dict(tmp_path, lambda sd: sd.__setitem__("layers.0.input_layernorm.weight",
                                                     torch.ones(H)))
    elif case == "shape":
        edit_state_dict(tmp_path, lambda sd: sd.__setitem__("fc.weight", torch.ones(H, 3 * H)))
    elif case == "truncated":
        f = tmp_path / "pytorch_model.bin"
        f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=match):
        published.load(tmp_path, TARGET)


def test_eagle3_misfits_are_refused(tmp_path):
    write_eagle3_head(tmp_path, **SIZES, draft_vocab=DV)
    shallow = dataclasses.replace(TARGET, num_layers=2)
    with pytest.raises(CheckpointError, match="a 2-layer target does not have"):
        published.load(tmp_path, shallow)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}  # SGLang: outputs
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"entering layers \[2, 4, 6\]\), which a 6-layer"):
        published.load(tmp_path, TARGET)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert published.load(tmp_path, TARGET).layers == (1, 3, 5)
    del cfg["eagle_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    edit_state_dict(tmp_path, lambda sd: sd.__setitem__("d2t", torch.full((DV,), V,
                                                                        dtype=torch.int64)))
    with pytest.raises(CheckpointError, match="d2t does not map"):
        published.load(tmp_path, TARGET)


def test_method_and_head_kind_must_agree(target, tmp_path):
    lm, root, _, _ = target
    with pytest.raises(methods.SpecError, match="EAGLE-3 head: use --method eagle3"):
        methods.build("eagle2", lm, methods.Options(draft_checkpoint=str(root / "head")))
    with pytest.raises(methods.SpecError, match="needs|pass --draft-checkpoint"):
        methods.build("eagle3", lm, methods.Options())
    with pytest.raises(methods.SpecError, match="unknown EAGLE option 'vocab=8' for eagle3"):
        methods.parse("eagle3:2,2,4:vocab=8")
    assert methods.parse("eagle3:7,10,60:conf").format() == "eagle3:7,10,60:conf"
    assert methods.parse("eagle3").drafter_kwargs()["total_tokens"] == 60


def test_eagle3_refuses_a_misplaced_layer_count():
    model = Llama(TARGET)
    with pytest.raises(ValueError, match=r"\[9\] do not exist"):
        eagle3.Eagle3Drafter(model, depth=2, topk=2, total_tokens=4, layers=(2, 3, 9)).check(model)
    with pytest.raises(ValueError, match="which a 2-layer target does not have"):
        eagle3.fused_layers(2)


def test_a_narrower_eagle3_head_reads_the_targets_width(tmp_path):
    """A head narrower than its target (``target_hidden_size``) carries its own embedding;
    its fc reads the target's 3 x 32 fused features into 16."""
    sd, cfg = write_eagle3_head(tmp_path, hidden=16, heads=2, kv_heads=1, intermediate=32,
                                vocab=V, draft_vocab=DV, target_hidden=H, own_embedding=True)
    head = published.load(tmp_path, TARGET)
    assert head.spec.width == 16 and head.params["fc"].shape == (16, 3 * H)
    _, _, tokens, fused = _inputs(3, 3 * H)
    out = _run(eagle3.apply_head, head.spec, _hp(head),
               sd["embed_tokens.weight"][tokens].numpy(), fused.numpy())
    ref, _ = torch_eagle3_logits(sd, cfg, None, tokens, fused)
    assert np.abs(np.asarray(eagle3.draft_logits(head.spec, _hp(head), out)) - ref.numpy()).max() < 1e-4
    edit_state_dict(tmp_path, lambda sd: sd.pop("embed_tokens.weight"))
    with pytest.raises(CheckpointError, match="missing tensors.*embed_tokens"):
        published.load(tmp_path, TARGET)
