"""Gemma 4's MTP assistants (``mtp``), against transformers' own classes and loop.

A tiny random Gemma 4 (per-layer embeddings, KV sharing, K as V, double-wide MLPs) and two
assistants are built by transformers (``Gemma4ForCausalLM``, ``Gemma4AssistantForCausalLM``)
and saved with ``save_pretrained``: one near-copying assistant (its drafts are often
accepted, so rounds differ from plain decoding) and one with ordered embeddings (centroid
masking) and a window of 4 (its sliding layers' window is crossed).

* one assistant step equals transformers' (logits and fed-back state within 1e-4), with
  centroid masking and windows, after prompts shorter and longer than the window;
* ``mtp:4`` built through ``methods.build`` equals ``ar`` and transformers' assisted
  generation token for token, with target forwards within 1 of transformers' prompt by
  prompt, and equal to them where the drafter reads the cache as transformers does
  (``reads_rejected``); the tree ``mtp:4,3,8`` equals ``ar`` with no more target forwards
  in all than the chain;
* a perfect-by-construction assistant reaches the most tau possible at its depth (a chain);
* the assistant reads the target's cache in place (its K/V only enter products);
* bad inputs are one line before the target's weights load.

Greedy equality and the sampling law at batch 1 and ragged batches: tests/test_conformance.py
(``Method.tiny``), on the Gemma 4 toy of tests/toys.py.
"""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
import toys
from specjax import methods
from specjax.drafters import mtp
from specjax.heads import mtp as heads
from specjax.models import gemma4

V, W = 64, 64
TARGET = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
              num_global_key_value_heads=1, attention_k_eq_v=True,
              layer_types=["sliding_attention", "full_attention", "sliding_attention",
                           "sliding_attention", "full_attention"],
              sliding_window=W, hidden_size_per_layer_input=8, vocab_size_per_layer_input=V,
              num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0)


def _assistant_config(hidden: int, window: int, ordered: bool):
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig

    return Gemma4AssistantConfig(
        backbone_hidden_size=32, use_ordered_embeddings=ordered, num_centroids=8,
        centroid_intermediate_top_k=3,
        text_config=dict(vocab_size=V, hidden_size=hidden, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
                         attention_k_eq_v=True, layer_types=["sliding_attention",
                                                             "full_attention"],
                         sliding_window=window, hidden_size_per_layer_input=0,
                         vocab_size_per_layer_input=0))


def _randomize(model, scale: float) -> None:
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "scale" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * scale)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """``(root, target, copying, ordered)``: the transformers models, saved under ``root``
    as ``target``, ``copying`` and ``ordered``."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    root = tmp_path_factory.mktemp("mtp")
    torch.manual_seed(0)
    target = Gemma4ForCausalLM(Gemma4TextConfig(**TARGET)).eval()
    _randomize(target, 0.5)
    with torch.no_grad():  # blocks outweigh the embedding: tokens depend on the context
        for layer in target.model.layers:
            layer.post_attention_layernorm.weight.mul_(3.0)
            layer.post_feedforward_layernorm.weight.mul_(3.0)
    target.save_pretrained(str(root / "target"))
    copying = Gemma4AssistantForCausalLM(_assistant_config(32, W, False)).eval()
    _randomize(copying, 0.2)
    with torch.no_grad():  # drafts near the current token's own: often accepted, not always
        copying.pre_projection.weight[:, :32].add_(5.0 * torch.eye(32))
        copying.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    copying.generation_config.num_assistant_tokens = 4
    copying.save_pretrained(str(root / "copying"))
    ordered = Gemma4AssistantForCausalLM(_assistant_config(16, 4, True)).eval()
    _randomize(ordered, 0.5)
    with torch.no_grad():
        ordered.masked_embedding.token_ordering.copy_(torch.randperm(V))
    ordered.save_pretrained(str(root / "ordered"))
    return root, target, copying, ordered


@pytest.fixture(scope="module")
def lm(hf):
    return specjax.models.load(str(hf[0] / "target"), tokenizer=False)


PROMPTS = [list(np.random.default_rng(s).integers(2, V, 4 + 4 * s)) for s in range(4)]
NEW = 28


def _hf_generate(target, prompt, assistant=None):
    """transformers' greedy output of ``prompt`` and its count of target forwards."""
    import torch

    ids = torch.tensor([prompt])
    calls = [0]
    hook = target.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=NEW, assistant_model=assistant)
    finally:
        hook.remove()
    return [int(t) for t in out[0, len(prompt):]], calls[0]


# --------------------------------------------------------------------------- one step

def _prefill(lm, prompt):
    """The target's cache after ``prompt``, its first token and final-normed last state."""
    model, p = lm.model, lm.params
    n = len(prompt)
    logits, hidden, cache = model.forward(p, jnp.asarray([prompt]), jnp.arange(n)[None],
                                          model.init_cache(1, 64),
                                          return_layers=(model.config.num_layers,))
    h = model.final_norm(p, hidden[model.config.num_layers][:, -1])
    return cache.advance(n), int(jnp.argmax(logits[0, -1])), h


@pytest.mark.parametrize("n", [3, 12])
def test_one_assistant_step_equals_transformers(hf, lm, n):
    """Three chained steps after a prompt of ``n`` tokens (the ordered assistant's window
    of 4 crossed at 12): logits and fed-back states within 1e-4, the same drafts."""
    import torch

    root, target, _, ordered = hf
    spec, ap = heads.load(root / "ordered", lm.model.config)
    ap = jax.tree.map(jnp.asarray, ap)
    prompt = PROMPTS[3][:n]
    cache, tok, h = _prefill(lm, prompt)
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True,
                     return_shared_kv_states=True)
        kv, th = out.shared_kv_states, out.hidden_states[-1][:, -1:]
    pos = jnp.asarray([n])
    vis = {k: mtp.visible_slots(k, spec.text.sliding_window, pos, cache.capacity)
           for k in ("sliding", "full")}
    h = h[:, None]
    for _ in range(3):
        logits, h = mtp.step(spec, ap, lm.model, lm.params, cache, lm.model.config.kv_layers,
                             jnp.asarray([[tok]]), h, pos, vis)
        with torch.no_grad():
            e = target.get_input_embeddings()(torch.tensor([[tok]]))
            ref = ordered(inputs_embeds=torch.cat([e, th], -1), position_ids=torch.tensor([[n]]),
                          shared_kv_states=kv, attention_mask=torch.ones(1, n + 1))
        want = ref.logits[0, 0].numpy()
        np.testing.assert_allclose(np.asarray(logits[0, 0]), want, atol=1e-4)
        np.testing.assert_allclose(np.asarray(h[0, 0]), ref.last_hidden_state[0, 0].numpy(),
                                   atol=1e-4)
        assert np.ptp(want) > 1.0  # masked tokens sit at the minimum: the scale is real
        tok, th = int(np.argmax(want)), ref.last_hidden_state
        assert int(jnp.argmax(logits[0, 0])) == tok


# --------------------------------------------------------------------------- rounds

@pytest.fixture(scope="module")
def runs(hf, lm):
    """transformers' plain and assisted greedy runs of every prompt, and ours."""
    root, target, copying, _ = hf
    chain = methods.build("mtp:4", lm, methods.Options(draft_checkpoint=str(root / "copying")))
    tree = methods.build("mtp:4,3,8", lm, methods.Options(draft_checkpoint=str(root / "copying")))
    reading = mtp.MTPDrafter(lm.model, chain.decoder.drafter.spec, depth=4,
                             reads_rejected=True)
    as_hf = methods.speculative(chain.spec, lm, methods.Options(), reading, chain.params[1])
    ours = {name: [b([p], max_new_tokens=NEW, eos_ids=(1,)) for p in PROMPTS]
            for name, b in (("chain", chain), ("tree", tree), ("as_hf", as_hf))}
    ar = [specjax.generate(lm.model, lm.params, [p], max_new_tokens=NEW,
                           eos_ids=(1,)).to_lists()[0] for p in PROMPTS]
    theirs = [_hf_generate(target, p, copying) for p in PROMPTS]
    return ar, ours, theirs, [_hf_generate(target, p)[0] for p in PROMPTS]


def test_mtp_chain_equals_ar_and_transformers_round_for_round(runs):
    ar, ours, theirs, plain = runs
    assert ar == plain  # the port's greedy is transformers'
    fwd = lambda o: int(np.asarray(o.target_forwards)[0])  # noqa: E731
    for i, (a, c, h, (toks, calls)) in enumerate(zip(ar, ours["chain"], ours["as_hf"], theirs)):
        assert c.to_lists()[0] == a == toks == h.to_lists()[0], f"prompt {i}"
        assert abs(fwd(c) - calls) <= 1, f"prompt {i}: {fwd(c)} target forwards, hf {calls}"
        assert fwd(h) == calls, f"prompt {i}: {fwd(h)} target forwards as hf reads, hf {calls}"
    total = sum(fwd(c) for c in ours["chain"])
    assert total < 0.6 * NEW * len(PROMPTS), "drafts were rarely accepted: the test is vacuous"


def test_mtp_tree_equals_ar_with_no_more_target_forwards_than_the_chain(runs):
    ar, ours, _, _ = runs
    fwd = lambda outs: sum(int(np.asarray(o.target_forwards)[0]) for o in outs)  # noqa: E731
    assert [o.to_lists()[0] for o in ours["tree"]] == ar
    assert fwd(ours["tree"]) <= fwd(ours["chain"])


# --------------------------------------------------------------------------- by construction

def test_a_perfect_assistant_reaches_the_most_tau_at_its_depth():
    """A target whose blocks add nothing (its next token a function of the current one)
    and an assistant that computes that function (its input projection keeps the token's
    embedding, its head is the target's): every draft is accepted, tau = depth + 1."""
    cfg = toys.GEMMA4
    model, tp = toys.gemma4_toy()
    for lp in tp["layers"]:
        lp.update(o=lp["o"] * 0, down=lp["down"] * 0, ple_proj=lp["ple_proj"] * 0,
                  layer_scalar=jnp.ones_like(lp["layer_scalar"]))
    tp["final_norm"] = jnp.ones_like(tp["final_norm"])
    spec = mtp.MTPSpec.of(cfg, cfg.hidden_size, 16, 2, layers=2)
    ap = mtp.init_params(spec, jax.random.key(0))
    d = cfg.hidden_size
    ap.update(pre_proj=jnp.eye(d, 2 * d), embed=tp["embed"], final_norm=jnp.ones((d,)))
    for lp in ap["layers"]:
        lp.update(o=lp["o"] * 0, down=lp["down"] * 0, layer_scalar=jnp.ones((1,)))
    lm = toys.ToyLM(model, tp, eos_ids=())
    prompts, new = [[1, 5, 2, 7], [3, 9]], 21
    ar = specjax.generate(model, tp, prompts, max_new_tokens=new).to_lists()
    depth = 4
    drafter = mtp.MTPDrafter(model, spec, depth=depth)
    built = methods.speculative(methods.parse("mtp"), lm, methods.Options(), drafter, ap)
    out = built(prompts, max_new_tokens=new)
    assert out.to_lists() == ar
    # the prefill's token, then rounds of depth + 1: (new - 1) / (depth + 1) rounds
    assert np.asarray(out.target_forwards).tolist() == [1 + (new - 1) // (depth + 1)] * 2


# --------------------------------------------------------------------------- in place

def _uses(jaxpr, tracked: set) -> list[str]:
    """The primitives that consume the variables ``tracked`` (by id), looking inside the
    sub-programs (``jit``, ``pjit``, ``closed_call``) they are passed into."""
    out = []
    for e in jaxpr.eqns:
        hits = [i for i, v in enumerate(e.invars) if id(v) in tracked]
        if not hits:
            continue
        inner = e.params.get("jaxpr") or e.params.get("call_jaxpr")
        if inner is not None:
            inner = getattr(inner, "jaxpr", inner)
            out += _uses(inner, {id(inner.invars[i]) for i in hits})
        else:
            out.append(e.primitive.name)
    return out


def test_the_assistant_reads_the_target_cache_in_place(hf, lm):
    """In a traced drafting round (a tree: three batched steps), the target cache's K/V
    arrays enter only products (no copy, slice, pad or gather of them), and the cache the
    round returns is the one it was given."""
    from specjax.core.drafter import Context
    from specjax.core.sampling import Greedy

    built = methods.build("mtp:3,2,5", lm,
                          methods.Options(draft_checkpoint=str(hf[0] / "ordered")))
    drafter, ap = built.decoder.drafter, built.params[1]
    cache = lm.model.init_cache(1, 32).advance(5)
    ctx = Context(tokens=jnp.zeros((1, 32), jnp.int32).at[0, :6].set(jnp.arange(2, 8)),
                  length=jnp.asarray([6]), prompt_len=jnp.asarray([5]), cache=cache,
                  params=lm.params)
    state = mtp.MTPState(h=jnp.zeros((1, 32)), stale=jnp.zeros((1,), jnp.int32))

    def propose(cache):
        return drafter.propose(ap, state, ctx.replace(cache=cache), jax.random.key(0),
                               Greedy())[2]
    jaxpr = jax.make_jaxpr(propose)(cache).jaxpr
    n = len(cache.k) + len(cache.v)
    kv = {id(v) for v in jaxpr.invars[:n]}
    uses = _uses(jaxpr, kv)
    assert uses and set(uses) == {"dot_general"}, uses
    assert [id(v) for v in jaxpr.outvars[:n]] == [id(v) for v in jaxpr.invars[:n]]


# --------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("how, fragments", [
    ("backbone", ("backbone_hidden_size 32", "hidden size 48", "another Gemma 4 size")),
    ("vocab", ("vocabulary of 64", "65")),
    ("geometry", ("sliding layers attend to", "(2, 8)", "(2, 16)")),
    ("llama", ("Gemma 4 target", "Llama")),
])
def test_an_assistant_for_another_target_is_refused_before_the_weights(hf, how, fragments,
                                                                      weights_guard):
    """The assistant against the config of another target (what ``--model`` names, read
    without its weights): a wider one, another vocabulary, other sliding heads, a Llama."""
    import dataclasses

    from specjax.models import registry

    cfg = registry.config(str(hf[0] / "target"))
    cfg = {"backbone": dataclasses.replace(cfg, hidden_size=48),
           "vocab": dataclasses.replace(cfg, vocab_size=65),
           "geometry": dataclasses.replace(cfg, head_dim=16),
           "llama": toys.LLAMA}[how]
    with pytest.raises(methods.SpecError) as e:
        methods.check("mtp:4", methods.Options(draft_checkpoint=str(hf[0] / "copying")), cfg)
    toys.one_line(e, *fragments)


def test_a_missing_token_ordering_is_refused_before_the_weights(hf, tmp_path, weights_guard):
    from safetensors.numpy import load_file, save_file

    adir = tmp_path / "a"
    shutil.copytree(hf[0] / "ordered", adir)
    t = load_file(str(adir / "model.safetensors"))
    del t["masked_embedding.token_ordering"]
    save_file(t, str(adir / "model.safetensors"))
    with pytest.raises(methods.SpecError) as e:
        methods.check("mtp:4", methods.Options(draft_checkpoint=str(adir)))
    toys.one_line(e, "missing", "masked_embedding.token_ordering", "use_ordered_embeddings")


def test_a_token_ordering_that_is_no_permutation_is_refused(hf, lm, tmp_path):
    from safetensors.numpy import load_file, save_file

    adir = tmp_path / "a"
    shutil.copytree(hf[0] / "ordered", adir)
    t = load_file(str(adir / "model.safetensors"))
    t["masked_embedding.token_ordering"] = np.zeros(V, np.int64)  # transformers' init
    save_file(t, str(adir / "model.safetensors"))
    with pytest.raises(heads.CheckpointError) as e:
        methods.build("mtp:4", lm, methods.Options(draft_checkpoint=str(adir)))
    toys.one_line(e, "token_ordering", "permutation")


@pytest.mark.parametrize("bad", ["none", "not_assistant"])
def test_a_directory_that_is_no_assistant_is_one_line(hf, tmp_path, bad):
    opts = methods.Options(draft_checkpoint=None if bad == "none" else str(hf[0] / "target"))
    with pytest.raises(methods.SpecError) as e:
        methods.check("mtp:4", opts)
    toys.one_line(e, "--draft-checkpoint" if bad == "none" else "gemma4_assistant")


# --------------------------------------------------------------------------- the bench peer

def test_hf_mtp_peer_runs_transformers_assisted_generation(hf, lm, runs):
    """``hf-mtp`` in ``specjax bench``: transformers' assisted generation with the same
    assistant, its tokens and target forwards those of the loop above."""
    from specjax import bench

    root, target, _, _ = hf
    run = bench.hf_mtp_method(dataclasses.replace(lm, eos_ids=(1,)), 1, str(root / "copying"),
                              4, target)
    _, _, theirs, _ = runs
    for prompt, (toks, calls) in list(zip(PROMPTS, theirs))[:2]:
        r = run([int(t) for t in prompt], NEW)
        assert (r.tokens, r.target_forwards) == (toks, calls)
    assert methods.parse("hf-mtp:3").format() == "hf-mtp:3"
    with pytest.raises(methods.SpecError) as e:
        methods.check("hf-mtp", methods.Options())
    toys.one_line(e, "--draft-checkpoint")
