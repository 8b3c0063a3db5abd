"""EAGLE-3 head layouts checked end to end: SafeAILab/EAGLE's (as ``published.save`` writes
it), tails-mpt/SpecJAX's (thoughtworks' heads on the hub: ``save_eagle3_checkpoint`` at
``TAILS_COMMIT``) and EAGLE 3.1's (vLLM's ``fc_norm`` and ``norm_output``). In each, a head
that is perfect by construction on a toy target drafts the target's own greedy
continuation: loaded through ``methods`` it decodes exactly as ``ar`` with every round
accepting the whole depth (tau maximal), and a head with a wrong field is refused in one
line naming it.

The toy target's next token is a permutation ``PI`` of the current one (attention and MLP
outputs zeroed, a one-hot embedding of magnitude ``EPS_T`` and an LM head mapping it to
``PI``), so its hidden states are the embedding at every layer. The head represents "the
next token is s" as ``R[s]`` (its layer output) and feeds back ``I[s]`` (``R[s]``, or its
final norm ``norm(R[s])`` with EAGLE 3.1's post-norm feedback); attention is zeroed, and
one SwiGLU unit per token maps ``I[s]`` to ``R[PI[s]]``. ``fc`` (after EAGLE 3.1's per-stream
norms) maps the fused target states of token ``a`` to ``I[PI[a]]``. Signs are chosen so
that dropping either EAGLE 3.1 change breaks the drafts (the negative controls)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import toys
from specjax import methods
from specjax.core.decoding import generate
from specjax.drafters import blocks, eagle3
from specjax.heads import CheckpointError, published
from specjax.models.llama import Llama
from specjax.models.llama import init_params as llama_init

#: tails-mpt/SpecJAX commit its layout was read from (specjax/models/draft/eagle3.py:
#: save_eagle3_checkpoint, validate_eagle3_checkpoint; specjax/train.py; target llama.py)
TAILS_COMMIT = "d047ed49c71fb13c470f9953674dba5863a005a4"

CFG = toys.LLAMA_UNTIED  # 3 layers (fused: entering 2, 1, 0), 12 tokens, hidden 32
V, D = CFG.vocab_size, CFG.hidden_size
CYCLE = [1, 6, 3, 10, 4, 11, 7, 9]  # the tokens the prompts and outputs stay in
PI = np.zeros(V, np.int64)
for _cyc in (CYCLE, [0, 2, 5, 8]):
    for _i, _a in enumerate(_cyc):
        PI[_a] = _cyc[(_i + 1) % len(_cyc)]
IDS = np.array(sorted(CYCLE))  # the draft vocabulary: d2t = IDS - arange, not zero
EPS_T = 200.0  # the target's hidden-state magnitude (large: fc_norm must matter)
RHO = 20.0  # the head's output representation R[s] = RHO * e_s
FC_NORM_W = (-0.5, -1.0, -2.0)  # EAGLE 3.1's per-stream norm gains (negative: see above)
SPEC = "eagle3:3,2,5"  # depth 3: a maximal round emits 4 tokens
DEPTH = 3
PROMPTS = [[1, 6], [3, 10, 4, 9, 7], [11]]
BUDGETS = [13, 9, 20]


@pytest.fixture(scope="module")
def lm():
    """The permutation target: next(a) = PI[a] whatever came before."""
    p = jax.tree.map(np.asarray, llama_init(CFG, jax.random.key(0)))
    for layer in p["layers"]:
        layer["o"] = np.zeros_like(layer["o"])
        layer["down"] = np.zeros_like(layer["down"])
    p["embed"] = EPS_T * np.eye(V, D, dtype=np.float32)
    head = np.zeros((V, D), np.float32)
    head[PI, np.arange(V)] = 1.0  # logits of token a: one-hot at PI[a]
    p["lm_head"] = head
    return toys.ToyLM(Llama(CFG), jax.tree.map(jnp.asarray, p), eos_ids=())


def perfect_head(post_norm: bool = False, fc_norm: bool = False) -> dict:
    """``eagle3.apply_head``'s pytree of a head that drafts ``PI``'s chain exactly."""
    eps = 1e-6
    w_n = -0.25 if post_norm else 1.0  # the final norm's gain
    sign = -1.0 if post_norm else 1.0  # the sign of the feedback I[s]
    eye = np.eye(V, D, dtype=np.float64)
    R = RHO * eye
    I = (w_n * RHO / math.sqrt(RHO * RHO / D + eps)) * eye if post_norm else R
    f = CFG.intermediate_size
    gate, up, down = np.zeros((f, D)), np.zeros((f, D)), np.zeros((D, f))
    gate[:V, :V] = sign * np.eye(V)  # unit j fires for I[j] only (mlp_norm(I[j]) = sign √D e_j)
    up[:V, :V] = sign * np.eye(V)
    c = math.sqrt(D) * (math.sqrt(D) / (1 + math.exp(-math.sqrt(D))))  # up * silu(gate)
    down[:, :V] = ((R[PI] - I) / c).T  # I[j] + down[:, j] * c = R[PI[j]]
    spec = eagle3.layer_spec(CFG)
    n_qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    layer = {"qkv": np.zeros((n_qkv, 2 * D)), "o": np.zeros((D, spec.num_heads * spec.head_dim)),
             "mlp_norm": np.ones(D), "gate_up": np.concatenate([gate, up]), "down": down}
    fc = np.zeros((D, 3 * D))
    for k in range(3):  # every fused stream of token a is EPS_T e_a
        scale = 3 * (math.sqrt(D) * FC_NORM_W[k] if fc_norm else EPS_T)
        fc[:, k * D:k * D + V] = I[PI].T / scale
    beta = 1.0 if not post_norm else 4.0
    hp = {"fc": fc, "embed_norm": np.ones(D), "hidden_norm": np.ones(D), "layer": layer,
          "norm": np.full(D, w_n), "lm_head": sign * beta * np.eye(V, D)[IDS]}
    if fc_norm:
        hp["fc_norm"] = np.stack([np.full(D, w) for w in FC_NORM_W])
    return jax.tree.map(lambda x: np.asarray(x, np.float32), hp)


def _tensors(hp: dict) -> dict[str, np.ndarray]:
    """The head's EAGLE-3 tensors by hand (SafeAILab's names), floats as stored: float32."""
    spec = eagle3.layer_spec(CFG)
    nq, nk = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    f, lp = CFG.intermediate_size, hp["layer"]
    t = {"fc.weight": hp["fc"], "midlayer.input_layernorm.weight": hp["embed_norm"],
         "midlayer.hidden_norm.weight": hp["hidden_norm"],
         "midlayer.self_attn.q_proj.weight": lp["qkv"][:nq],
         "midlayer.self_attn.k_proj.weight": lp["qkv"][nq:nq + nk],
         "midlayer.self_attn.v_proj.weight": lp["qkv"][nq + nk:],
         "midlayer.self_attn.o_proj.weight": lp["o"],
         "midlayer.post_attention_layernorm.weight": lp["mlp_norm"],
         "midlayer.mlp.gate_proj.weight": lp["gate_up"][:f],
         "midlayer.mlp.up_proj.weight": lp["gate_up"][f:],
         "midlayer.mlp.down_proj.weight": lp["down"], "norm.weight": hp["norm"],
         "lm_head.weight": hp["lm_head"]}
    for i, w in enumerate(hp.get("fc_norm", ())):
        t[f"fc_norm.{i}.weight"] = w
    return t


def _vocab(d2t_dtype=np.int64) -> dict[str, np.ndarray]:
    t2d = np.zeros(V, np.bool_)
    t2d[IDS] = True
    return {"d2t": (IDS - np.arange(len(IDS))).astype(d2t_dtype), "t2d": t2d}


def _write(path, tensors: dict, cfg: dict, metadata=None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(path / "model.safetensors"), metadata=metadata)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def write_safeailab(path, hp: dict) -> None:
    """SafeAILab/EAGLE's EAGLE-3 layout, as ``published.save`` writes it (float32)."""
    published.save("eagle3", hp, path, CFG, vocab_ids=IDS, layers=eagle3.fused_layers(3),
                   dtype="float32")


def tails_config() -> dict:
    """``save_eagle3_checkpoint``'s config.json (no source config): SpecJAX's fields."""
    spec = eagle3.layer_spec(CFG)
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
            "intermediate_size": spec.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim, "vocab_size": V, "draft_vocab_size": len(IDS),
            "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False}


def write_tails(path, hp: dict, cfg: dict | None = None, d2t=None) -> None:
    """tails-mpt/SpecJAX's head as ``save_eagle3_checkpoint`` writes it: bfloat16 weights,
    ``d2t`` offsets as int32 (``jnp.int64`` without x64), ``t2d`` bool, no metadata."""
    t = {k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors(hp).items()}
    t.update(_vocab(np.int32))
    if d2t is not None:
        t["d2t"] = d2t
    _write(path, t, tails_config() if cfg is None else cfg)


def eagle31_config(fc_norm: bool = True, norm_output: bool = True) -> dict:
    """An EAGLE 3.1 head's config.json, as SpecForge/vLLM's LlamaForCausalLMEagle3 reads it."""
    spec = eagle3.layer_spec(CFG)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": len(IDS),
           "hidden_act": "silu", "hidden_size": D, "intermediate_size": spec.intermediate_size,
           "max_position_embeddings": 256, "model_type": "llama",
           "num_attention_heads": spec.num_heads, "num_hidden_layers": 1,
           "num_key_value_heads": spec.num_kv_heads, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": V}
    if fc_norm:
        cfg["fc_norm"] = True
    if norm_output:
        cfg["norm_output"] = True
    return cfg


def write_eagle31(path, hp: dict, cfg: dict | None = None) -> None:
    _write(path, {**_tensors(hp), **_vocab()}, eagle31_config() if cfg is None else cfg,
           {"format": "pt"})


def decode(lm, path, spec: str = SPEC):
    built = methods.build(spec, lm, methods.Options(draft_checkpoint=str(path)))
    return built(PROMPTS, max_new_tokens=BUDGETS)


def assert_maximal(lm, out) -> None:
    """Output equal to ``ar``'s, and every round accepted the whole depth."""
    ar = generate(lm.model, lm.params, PROMPTS, max_new_tokens=BUDGETS).to_lists()
    assert out.to_lists() == ar
    assert all(set(row) <= set(CYCLE) for row in ar)  # the draft vocabulary covers them
    np.testing.assert_array_equal(out.acceptance_by_position(), np.ones(DEPTH))
    rounds = [1 + math.ceil((n - 1) / (DEPTH + 1)) for n in BUDGETS]  # prefill + rounds
    np.testing.assert_array_equal(np.asarray(out.target_forwards), rounds)


def _edit_config(path, **changes) -> None:
    f = path / "config.json"
    cfg = json.loads(f.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    f.write_text(json.dumps(cfg))


def _edit_tensors(path, fn) -> None:
    f = path / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


def _refused(path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as e:
        published.load(path, CFG)
    return toys.one_line(e, *fragments)


# --- the target ------------------------------------------------------------------------

def test_the_toy_target_is_the_permutation(lm):
    out = generate(lm.model, lm.params, [[1], [0]], max_new_tokens=9).to_lists()
    for first, row in zip((1, 0), out):
        want, tok = [], first
        for _ in range(9):
            tok = int(PI[tok])
            want.append(tok)
        assert row == want


# --- SafeAILab/EAGLE's EAGLE-3 ---------------------------------------------------------

def test_eagle3_perfect_head_reaches_the_maximal_tau(lm, tmp_path):
    write_safeailab(tmp_path, perfect_head())
    head = published.load(tmp_path, CFG)
    assert head.kind == "eagle3" and not head.post_norm and "fc_norm" not in head.params
    np.testing.assert_array_equal(head.vocab_ids, IDS)
    assert_maximal(lm, decode(lm, tmp_path))


@pytest.mark.parametrize("edit,fragments", [
    ("rename", ("missing tensors ['midlayer.hidden_norm.weight']",
                "unexpected tensors ['midlayer.hiden_norm.weight']")),
    ("norm_before_fc", ("'norm_before_fc' is true", "does not compute")),
    ("eagle_config", ("'eagle_config.norm_before_residual' is true",)),
    ("aux", ("'eagle_config.use_aux_hidden_state' is false",)),
    ("num_aux", ("'num_aux_hidden_states' is 4", "fuses 3 layers")),
    ("layers", ("'num_hidden_layers' is 2",))])
def test_eagle3_wrong_fields_are_refused(tmp_path, edit, fragments):
    write_safeailab(tmp_path, perfect_head())
    if edit == "rename":
        _edit_tensors(tmp_path, lambda t: t.__setitem__("midlayer.hiden_norm.weight",
                                                       t.pop("midlayer.hidden_norm.weight")))
    elif edit == "norm_before_fc":
        _edit_config(tmp_path, norm_before_fc=True)
    elif edit == "eagle_config":
        _edit_config(tmp_path, eagle_config={"norm_before_residual": True})
    elif edit == "aux":
        _edit_config(tmp_path, eagle_config={"use_aux_hidden_state": False})
    elif edit == "num_aux":
        _edit_config(tmp_path, num_aux_hidden_states=4)
    else:
        _edit_config(tmp_path, num_hidden_layers=2)
    msg = _refused(tmp_path, *fragments)
    assert str(tmp_path) in msg


# --- tails-mpt/SpecJAX (thoughtworks) ----------------------------------------------------

def test_tails_mpt_head_reaches_the_maximal_tau(lm, tmp_path):
    """SpecJAX's own files, unconverted: its config (``LlamaForCausalLM``, ``head_dim``, no
    ``target_hidden_size`` or ``eagle_config``), bfloat16 weights and int32 ``d2t``; its
    target fuses the outputs of layers {1, L//2 - 1, L - 4}, the states entering EAGLE's
    2, L//2 and L - 3, which a config without ``eagle_config`` reads as."""
    write_tails(tmp_path, perfect_head())
    t = load_file(str(tmp_path / "model.safetensors"))
    assert t["d2t"].dtype == np.int32 and t["fc.weight"].dtype == ml_dtypes.bfloat16
    head = published.load(tmp_path, CFG)
    assert head.kind == "eagle3" and head.layers == eagle3.fused_layers(CFG.num_layers)
    np.testing.assert_array_equal(head.vocab_ids, IDS)
    assert_maximal(lm, decode(lm, tmp_path))


def test_tails_mpt_wrong_fields_are_refused(tmp_path):
    hp = perfect_head()
    write_tails(tmp_path / "vocab", hp, dict(tails_config(), draft_vocab_size=9))
    _refused(tmp_path / "vocab", "lm_head.weight has shape (8, 32); expected (9, 32)")
    write_tails(tmp_path / "head_dim", hp, dict(tails_config(), head_dim=16))
    _refused(tmp_path / "head_dim", "midlayer.self_attn.q_proj.weight has shape (32, 64); "
             "expected (64, 64)")
    write_tails(tmp_path / "eps", hp, dict(tails_config(), rms_norm_eps="1e-6"))
    _refused(tmp_path / "eps", "'rms_norm_eps' must be a positive number")
    # SpecJAX fine-tuned from a checkpoint (--draft-init-path) keeps the file's d2t offsets
    # as its buffer and subtracts arange again when saving: its t2d is still right
    twice = (IDS - 2 * np.arange(len(IDS))).astype(np.int32)
    write_tails(tmp_path / "d2t", hp, d2t=twice)
    _refused(tmp_path / "d2t", "d2t does not map")


# --- EAGLE 3.1 ------------------------------------------------------------------------------

def test_eagle31_perfect_head_reaches_the_maximal_tau(lm, tmp_path):
    write_eagle31(tmp_path, perfect_head(post_norm=True, fc_norm=True))
    head = published.load(tmp_path, CFG)
    assert head.kind == "eagle3" and head.post_norm
    np.testing.assert_array_equal(head.params["fc_norm"], np.stack(
        [np.full(D, w, np.float32) for w in FC_NORM_W]))
    built = methods.build(SPEC, lm, methods.Options(draft_checkpoint=str(tmp_path)))
    assert built.decoder.drafter.post_norm
    assert_maximal(lm, built(PROMPTS, max_new_tokens=BUDGETS))
    assert_maximal(lm, decode(lm, tmp_path, "eagle3:3,1,3"))  # the controls' chain, too


@pytest.mark.parametrize("drop,accepted", [("fc_norm", [0, 0, 0]), ("norm_output", [1, 0, 0])])
def test_eagle31_without_either_change_drafts_wrongly(lm, tmp_path, drop, accepted):
    """The negative controls: the same weights read without one of EAGLE 3.1's changes still
    decode as ``ar`` (lossless), with the drafts the construction predicts wrong: without
    ``fc_norm`` the root's guess repeats the last token, without post-norm feedback every
    guess below the root repeats its parent. A chain (topk 1), as the right token is then
    the runner-up, which a tree of topk 2 would draft too."""
    hp = perfect_head(post_norm=True, fc_norm=True)
    if drop == "fc_norm":
        hp = {k: v for k, v in hp.items() if k != "fc_norm"}
    write_eagle31(tmp_path, hp, eagle31_config(fc_norm=drop != "fc_norm",
                                               norm_output=drop != "norm_output"))
    out = decode(lm, tmp_path, "eagle3:3,1,3")
    ar = generate(lm.model, lm.params, PROMPTS, max_new_tokens=BUDGETS).to_lists()
    assert out.to_lists() == ar
    np.testing.assert_array_equal(out.acceptance_by_position(), accepted)


@pytest.mark.parametrize("edit,fragments", [
    ("shape", ("fc_norm.1.weight has shape (16,); expected (32,)",)),
    ("missing", ("missing tensors ['fc_norm.2.weight']",)),
    ("flag", ("'fc_norm' is not true", "fc_norm.0.weight")),
    ("fc_norm_type", ("'fc_norm' must be true or false, got 'true'",)),
    ("norm_output_type", ("'norm_output' must be true or false, got 1",))])
def test_eagle31_wrong_fields_are_refused(tmp_path, edit, fragments):
    write_eagle31(tmp_path, perfect_head(post_norm=True, fc_norm=True))
    if edit == "shape":
        _edit_tensors(tmp_path, lambda t: t.__setitem__("fc_norm.1.weight",
                                                       np.ones(16, np.float32)))
    elif edit == "missing":
        _edit_tensors(tmp_path, lambda t: t.pop("fc_norm.2.weight"))
    elif edit == "flag":
        _edit_config(tmp_path, fc_norm=None)
    elif edit == "fc_norm_type":
        _edit_config(tmp_path, fc_norm="true")
    else:
        _edit_config(tmp_path, norm_output=1)
    _refused(tmp_path, *fragments)


def test_eagle31_surfaces_through_methods_in_one_line(lm, tmp_path):
    write_eagle31(tmp_path, perfect_head(post_norm=True, fc_norm=True))
    _edit_tensors(tmp_path, lambda t: t.pop("fc_norm.0.weight"))
    with pytest.raises(CheckpointError) as e:
        methods.build(SPEC, lm, methods.Options(draft_checkpoint=str(tmp_path)))
    toys.one_line(e, "missing tensors ['fc_norm.0.weight']")


def test_eagle31_saves_back_to_its_layout(tmp_path):
    """``published.save`` of a loaded EAGLE 3.1 head writes the same tensors (SafeAILab's
    names plus ``fc_norm.{i}.weight``) and flags, which load back to the same head."""
    write_eagle31(tmp_path / "src", perfect_head(post_norm=True, fc_norm=True))
    head = published.load(tmp_path / "src", CFG)
    published.save("eagle3", head.params, tmp_path / "out", CFG, spec=head.spec,
                   vocab_ids=head.vocab_ids, layers=head.layers, dtype="float32",
                   post_norm=head.post_norm)
    src, out = load_file(str(tmp_path / "src/model.safetensors")), load_file(
        str(tmp_path / "out/model.safetensors"))
    assert set(src) == set(out)
    for k in src:
        np.testing.assert_array_equal(src[k], out[k], err_msg=k)
    cfg = json.loads((tmp_path / "out/config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    back = published.load(tmp_path / "out", CFG)
    assert back.post_norm and np.array_equal(back.params["fc_norm"], head.params["fc_norm"])
    bad = dict(head.params, fc_norm=head.params["fc_norm"][:2])
    with pytest.raises(published.NoPublishedLayout, match=r"fc_norm has shape \(2, 32\)"):
        published.to_published("eagle3", bad, CFG, spec=head.spec, vocab_ids=head.vocab_ids)
    with pytest.raises(published.NoPublishedLayout, match="EAGLE 3.1's"):
        published.to_published("eagle", {}, CFG, post_norm=True)


def test_eagle31_forward_equals_the_pytorch_reference(tmp_path):
    """A random SpecForge EAGLE 3.1 head (``fc_norm``, ``"norm_output": true``): specjax's
    root step is the reference's over the per-stream-normed fused states, its feedback the
    reference's output after the final norm, and the next step the reference's over that
    feedback (``fc`` skipped), each within 1e-4."""
    import torch
    from published import (_rms_norm, torch_eagle3_logits, torch_specforge_eagle3_logits,
                           write_specforge_eagle3_head)

    target = toys.LLAMA_6
    h, b, t = target.hidden_size, 2, 7
    sd, cfg = write_specforge_eagle3_head(tmp_path, hidden=h, heads=4, kv_heads=2,
                                          intermediate=2 * h, vocab=target.vocab_size,
                                          draft_vocab=24, fc_norm=True, seed=5)
    _edit_config(tmp_path, norm_output=True)
    head = published.load(tmp_path, target)
    assert head.post_norm and head.params["fc_norm"].shape == (3, h)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, target.vocab_size, (b, t), generator=g)
    fused = torch.randn(b, t, 3 * h, generator=g) * 3.0
    hp = jax.tree.map(jnp.asarray, head.params)
    emb = jnp.asarray(sd["embed_tokens.weight"][tokens].numpy())

    def run(x):
        k, v = blocks.empty_kv(head.spec, b, t, jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        out, _, _ = eagle3.apply_head(head.spec, hp, emb, jnp.asarray(x), pos, k, v,
                                      jnp.zeros((b,), jnp.int32), blocks.causal(b, t),
                                      post_norm=True)
        return out, np.asarray(eagle3.draft_logits(head.spec, hp, out, post_norm=True))

    out1, logits1 = run(fused.numpy())
    ref1, x1 = torch_specforge_eagle3_logits(sd, cfg, tokens, fused)  # lm_head(norm(x))
    feedback = _rms_norm(x1, sd["norm.weight"], float(cfg["rms_norm_eps"]))
    assert np.abs(logits1 - ref1.numpy()).max() < 1e-4
    assert np.abs(np.asarray(out1) - feedback.numpy()).max() < 1e-4
    out2, logits2 = run(np.asarray(out1))
    ref2, _ = torch_eagle3_logits(sd, cfg, None, tokens, feedback)
    assert np.abs(logits2 - ref2.numpy()).max() < 1e-4
    plain, _ = torch_eagle3_logits(sd, cfg, None, tokens, x1)  # pre-norm feedback instead
    assert np.abs(logits2 - plain.numpy()).max() > 1e-2
    unnormed, _ = torch_specforge_eagle3_logits(sd, dict(cfg, fc_norm=False), tokens, fused)
    assert np.abs(logits1 - unnormed.numpy()).max() > 1e-2
