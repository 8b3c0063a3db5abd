"""``specjax.heads.kinds``: one save and one load function per kind of exported head, the one
place decoding (``specjax.methods``) and training (``specjax.train.glue``: exports, warm
starts, ``--init``) read and write heads. Each kind round-trips bit for bit, both sides read
through the same function, a directory of another kind is refused in one line, and the
training commands' configurations come from their flags field by field as before."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import cli, methods
from specjax.drafters import eagle, eagle3, exit_heads, redrafter
from specjax.heads import exported, kinds, shipped_head
from specjax.train import eagle as train_eagle
from specjax.train import exit_heads as train_exits
from specjax.train import glue, onpolicy, ttt
from specjax.train import redrafter as train_rd
from toys import LLAMA, ToyLM, llama

REC = kinds.Record(model="toy", train={"steps": 3, "lr": 0.5}, steps_done=3,
                   data={"kind": "text", "tokens": 7}, tokens_seen=40, init="base")
EXIT_LAYERS = (2, 1)  # in this order, not sorted


def _bits(tree) -> dict:
    """``{name: (dtype, shape, bytes)}`` of every leaf: equal iff bit-identical."""
    return {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in exported.flatten(
        jax.tree.map(np.asarray, tree)).items()}


def _heads() -> dict:
    """A tiny random head of each kind, in the tree its trainer holds."""
    key = jax.random.key(4)
    return {"eagle": eagle.init_head(LLAMA, key),
            "eagle3": eagle3.init_head(LLAMA, key, 6),
            "redrafter": redrafter.init_head(LLAMA.hidden_size, 5, key, blocks=2),
            "exit-heads": exit_heads.init_heads(LLAMA, EXIT_LAYERS, key, rank=4)}


def _save(kind: str, params, out, dtype=jnp.float32):
    """``params`` saved as ``kind`` with ``REC`` and the kind's own fields."""
    if kind == "eagle":
        return kinds.save_eagle(params, out, REC, vocab_ids=np.arange(10, 0, -1),
                                draft_vocab=4, dtype=dtype)
    if kind == "eagle3":
        return kinds.save_eagle3(params, out, REC, vocab_ids=[3, 1, 4, 5, 9, 2],
                                 layers=(2, 1, 0), dtype=dtype)
    if kind == "redrafter":
        return kinds.save_redrafter(params, out, REC, vocab_ids=np.asarray([7, 0, 3, 1, 2]),
                                    dtype=dtype)
    return kinds.save_exit_heads(params, out, REC, layers=EXIT_LAYERS, rank=4,
                                 vocab_ids=[1, 2, 3, 4, 5], dtype=dtype)


def _load(kind: str, path, dtype=jnp.float32):
    """``(params, meta)`` read back by the kind's own loader, in the tree it was saved in
    (exit heads: cast to ``dtype``, as ``load_exit_heads`` returns them)."""
    if kind == "eagle":
        return kinds.load_eagle(path, LLAMA)
    if kind == "eagle3":
        return kinds.load_eagle3(path, LLAMA)
    if kind == "redrafter":
        return kinds.load_redrafter(path, LLAMA.hidden_size)
    heads, meta = kinds.load_exit_heads(path, llama()[0], dtype)
    return {str(l): {k: v for k, v in hp.items() if k != "vocab_ids"}
            for l, hp in heads.items()}, meta


EXPECTED = {  # what each kind writes into head.json besides the record, shapes and dtypes
    "eagle": {"draft_vocab": 4, "vocab_ids": list(range(10, 0, -1))},
    "eagle3": {"draft_vocab": 0, "vocab_ids": [3, 1, 4, 5, 9, 2], "layers": [2, 1, 0]},
    "redrafter": {"hidden_size": LLAMA.hidden_size, "blocks": 2, "draft_vocab": 5,
                  "vocab_ids": [7, 0, 3, 1, 2]},
    "exit-heads": {"layers": [2, 1], "rank": 4, "vocab_ids": [1, 2, 3, 4, 5]},
}
KINDS = sorted(EXPECTED)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_kind_round_trips_bit_for_bit(kind, dtype, tmp_path):
    params = _heads()[kind]
    if kind == "redrafter":
        params = redrafter.exportable(params)  # stored and read back with str block keys
    out = _save(kind, params, tmp_path / kind, dtype)
    back, meta = _load(kind, out, dtype)
    cast = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    assert _bits(back) == _bits(cast)
    saved = json.loads((out / exported.HEAD_JSON).read_text())
    assert meta == saved and meta["kind"] == kind
    assert {k: meta[k] for k in EXPECTED[kind]} == EXPECTED[kind]
    assert {k: meta[k] for k in ("model", "train", "steps_done", "data", "tokens_seen",
                                 "init")} == dataclasses.asdict(REC)
    assert list(meta)[:2] == ["kind", "model"] and meta["dtypes"] == {
        "float": jnp.dtype(dtype).name}
    again = _save(kind, back, tmp_path / f"{kind}2", dtype)  # a loaded head saves the same
    back2, meta2 = _load(kind, again, dtype)
    assert _bits(back2) == _bits(back) and meta2 == meta


def test_a_record_writes_only_what_it_knows(tmp_path):
    out = kinds.save_eagle(_heads()["eagle"], tmp_path / "h",
                           kinds.Record(model="m", train={}, steps_done=0))
    meta = exported.read_meta(out, "eagle")
    assert [k for k in meta if k not in ("shapes", "dtypes", "params_sha256",
                                         "head_sha256")] == [
        "kind", "model", "draft_vocab", "train", "steps_done", "data", "vocab_ids"]
    assert list(meta)[-2:] == ["params_sha256", "head_sha256"]  # the digests come last
    bare = kinds.save_eagle(_heads()["eagle"], tmp_path / "b")
    assert exported.read_meta(bare, "eagle")["vocab_ids"] is None


def test_savers_refuse_inconsistent_fields(tmp_path):
    heads = _heads()
    with pytest.raises(ValueError, match="drafts over 5 tokens, but 3 vocab_ids"):
        kinds.save_redrafter(heads["redrafter"], tmp_path / "r", vocab_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="do not name the exit heads"):
        kinds.save_exit_heads(heads["exit-heads"], tmp_path / "x", layers=(1,), rank=4)
    assert not (tmp_path / "r").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_a_directory_of_another_kind_is_refused_in_one_line(kind, tmp_path):
    heads = _heads()
    other = "redrafter" if kind == "eagle" else "eagle"
    params = heads[other] if other == "eagle" else redrafter.exportable(heads[other])
    out = _save(other, params, tmp_path / "other")
    with pytest.raises(exported.CheckpointError) as e:
        _load(kind, out)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and f"holds a '{other}' head, not '{kind}'" in msg
    with pytest.raises(exported.CheckpointError, match="not an exported head"):
        _load(kind, tmp_path)


def test_a_head_for_other_sizes_is_refused(tmp_path):
    out = _save("eagle", _heads()["eagle"], tmp_path / "e")
    with pytest.raises(exported.CheckpointError, match="exported for another model"):
        kinds.load_eagle(out, dataclasses.replace(LLAMA, hidden_size=48))
    rd = _save("redrafter", redrafter.exportable(_heads()["redrafter"]), tmp_path / "r")
    with pytest.raises(ValueError, match="hidden size 32, but toy has 48"):
        kinds.load_redrafter(rd, 48, target="toy")
    meta = json.loads((rd / exported.HEAD_JSON).read_text())
    del meta["blocks"]
    exported.write_meta(rd, meta)  # an edit on purpose: head.json's own SHA-256 rewritten
    with pytest.raises(exported.CheckpointError, match="does not describe a 'redrafter' head"):
        kinds.load_redrafter(rd)


def test_the_shipped_heads_load_as_before():
    """Every head shipped in the package loads through its kind's function exactly as
    ``exported.load_head`` reads the directory."""
    from specjax.models import GEMMA3_270M, SMOLLM2_135M

    configs = {"smollm2-135m": SMOLLM2_135M, "gemma3-270m": GEMMA3_270M}
    for model, cfg in configs.items():
        path = shipped_head("eagle", model)
        if path is None:  # not installed with this copy of the package
            continue
        head, meta = kinds.load_eagle(path, cfg)
        raw, raw_meta = exported.load_head(path, "eagle")
        assert _bits(head) == _bits(raw) and meta == raw_meta
    path = shipped_head("exit-heads", "smollm2-135m")
    if path is None:
        return
    heads, meta = kinds.load_exit_heads(path, _Target(SMOLLM2_135M))
    raw, _ = exported.load_head(path, "exit-heads")
    assert sorted(heads) == sorted(int(k) for k in raw) == meta["layers"]
    for l, hp in heads.items():
        assert _bits({k: hp[k] for k in raw[str(l)]}) == _bits(
            jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), raw[str(l)]))


@dataclasses.dataclass
class _Target:
    config: object


class _Spy:
    """Wraps a function, keeping each call's first argument and result."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *a, **k):
        out = self.fn(*a, **k)
        self.calls.append((str(a[0]), out))
        return out


def _spy(monkeypatch, name: str) -> _Spy:
    spy = _Spy(getattr(kinds, name))
    monkeypatch.setattr(kinds, name, spy)
    return spy


def test_decoding_and_warm_starts_read_through_the_same_functions(tmp_path, monkeypatch):
    """``methods.build`` (decoding) and ``glue``'s warm starts (``train eagle|redrafter
    --init``, ``train onpolicy --init``) call the same ``heads.kinds`` loader and get the same
    parameters."""
    lm = ToyLM(*llama())
    heads = _heads()
    paths = {k: _save(k, heads[k] if k != "redrafter" else redrafter.exportable(heads[k]),
                      tmp_path / k) for k in KINDS}
    spies = {k: _spy(monkeypatch, n) for k, n in [
        ("eagle", "load_eagle"), ("eagle3", "load_eagle3"), ("redrafter", "load_redrafter"),
        ("exit-heads", "load_exit_heads")]}

    methods.build("eagle2:2,2,3", lm, methods.Options(draft_checkpoint=str(paths["eagle"])))
    warm = glue.eagle_init(paths["eagle"], LLAMA)
    start = glue.onpolicy_start(str(paths["eagle"]), None, ttt.EAGLE2)
    online = glue.onpolicy_head(start, LLAMA, ttt.EAGLE2)
    (_, (decoded, _)), (_, (w, _)), (_, (o, _)) = spies["eagle"].calls
    assert _bits(decoded) == _bits(warm) == _bits(w) == _bits(online) == _bits(o)

    methods.build("redrafter:2,2", lm,
                  methods.Options(redrafter_checkpoint=str(paths["redrafter"])))
    head, ids = glue.redrafter_init(paths["redrafter"])
    (_, (decoded, meta)), (_, (w, _)) = spies["redrafter"].calls
    assert _bits(decoded) == _bits(head) == _bits(w)
    assert ids.tolist() == meta["vocab_ids"] and ids.dtype == np.int32

    start = glue.onpolicy_start(str(paths["eagle3"]), None, ttt.EAGLE3)
    assert start.order == EXPECTED["eagle3"]["vocab_ids"] and start.name == "eagle3"
    online = glue.onpolicy_head(start, LLAMA, ttt.EAGLE3)
    assert len(spies["eagle3"].calls) == 1 and _bits(online) == _bits(heads["eagle3"])

    _, layers, _ = methods.exit_heads(lm, methods.Options(exit_heads=str(paths["exit-heads"])))
    assert layers == [1, 2] and len(spies["exit-heads"].calls) == 1
    assert all(spy.calls[0][0] == str(paths[k]) for k, spy in spies.items())


def test_an_eagle2_head_gives_an_eagle3_run_its_vocabulary_only(tmp_path):
    path = _save("eagle", _heads()["eagle"], tmp_path / "e")
    start = glue.onpolicy_start(str(path), None, ttt.EAGLE3)
    assert start == glue.Start(None, EXPECTED["eagle"]["vocab_ids"], "e")
    assert glue.onpolicy_head(start, LLAMA, ttt.EAGLE3) is None
    assert glue.onpolicy_start("none", path, ttt.EAGLE3) == glue.Start(
        None, EXPECTED["eagle"]["vocab_ids"], "none")
    assert glue.onpolicy_start("shipped", path, ttt.EAGLE2).path == path
    assert glue.onpolicy_start("shipped", path, ttt.EAGLE2).draft_vocab == 4  # its export's


def _args(argv: list[str]):
    return cli.build_parser().parse_args(argv)


def test_training_configs_come_from_their_flags_as_before():
    """``glue.from_args`` gives each command the configuration its field-by-field copy
    gave, at the defaults and with every flag set."""
    base = ["--data", "d", "--run", "r"]
    for a in (_args(["train", "eagle", *base]),
              _args(["train", "eagle", *base, "--steps", "7", "--lr", "0.2", "--w-ce", "0.5",
                     "--all-positions", "--save-every", "3", "--ce-vocab", "0", "--warmup",
                     "2", "--no-attn-norm"])):
        assert glue.from_args(train_eagle.TrainConfig, a) == train_eagle.TrainConfig(
            steps=a.steps, batch_tokens=a.batch_tokens, max_len=a.max_len, lr=a.lr,
            seed=a.seed, save_every=a.save_every, ce_vocab=a.ce_vocab,
            val_examples=a.val_examples, warmup=a.warmup, w_reg=a.w_reg, w_ce=a.w_ce,
            noise=a.noise, all_positions=a.all_positions, attn_norm=a.attn_norm)
    assert a.attn_norm is False
    for a in (_args(["train", "redrafter", *base]),
              _args(["train", "redrafter", *base, "--loss", "ce", "--answers-only",
                     "--blocks", "1", "--unroll", "2", "--draft-vocab", "0"])):
        got = glue.from_args(train_rd.TrainConfig, a, all_positions=not a.answers_only)
        assert got == train_rd.TrainConfig(
            steps=a.steps, batch_tokens=a.batch_tokens, max_len=a.max_len, unroll=a.unroll,
            blocks=a.blocks, draft_vocab=a.draft_vocab, loss=a.loss, lr=a.lr,
            warmup=a.warmup, seed=a.seed, save_every=a.save_every,
            val_examples=a.val_examples, all_positions=not a.answers_only)
    for a in (_args(["train", "exit-heads", *base]),
              _args(["train", "exit-heads", *base, "--rank", "8", "--kl-vocab", "0"])):
        layers = tuple(int(x) for x in a.layers.split(","))
        assert glue.from_args(train_exits.ExitConfig, a, layers=layers) == \
            train_exits.ExitConfig(layers=layers, rank=a.rank, steps=a.steps,
                                   batch_tokens=a.batch_tokens, max_len=a.max_len, lr=a.lr,
                                   seed=a.seed, save_every=a.save_every, kl_vocab=a.kl_vocab)
    on = ["train", "onpolicy", "--prompts", "p", "--shards", "s", "--run", "r"]
    for a in (_args(on), _args([*on, "--ttt", "3", "--noise", "0.2", "--batch", "4",
                                "--no-attn-norm", "--max-prompt-tokens", "1024"])):
        got = glue.from_args(onpolicy.OnPolicyConfig, a,
                             loss=glue.from_args(ttt.LossConfig, a, k=a.ttt))
        assert got == onpolicy.OnPolicyConfig(
            rounds=a.rounds, batch=a.batch, max_new_tokens=a.max_new_tokens,
            max_prompt_tokens=a.max_prompt_tokens, passes=a.passes, batch_tokens=a.batch_tokens, lr=a.lr, warmup=a.warmup,
            draft_vocab=a.draft_vocab, val_prompts=a.val_prompts, val_every=a.val_every,
            seed=a.seed, loss=ttt.LossConfig(k=a.ttt, noise=a.noise),
            attn_norm=a.attn_norm)
    assert a.attn_norm is False and a.max_prompt_tokens == 1024
    with pytest.raises(TypeError, match="has no field nope"):
        glue.from_args(train_eagle.TrainConfig, a, nope=1)


# --- EAGLE-1/2 heads without the layer's attention-input norm (--no-attn-norm) --------------

def test_an_eagle_head_without_attn_norm_round_trips_as_its_head_json_says(tmp_path):
    """``save_eagle`` of a head without ``layer/attn_norm`` writes ``attn_norm: false``;
    ``load_eagle`` reads it back bit for bit because head.json says so: the same files
    with head.json claiming the norm, or a non-boolean, are refused in one line."""
    hp = eagle.init_head(LLAMA, jax.random.key(4), attn_norm=False)
    assert "attn_norm" not in hp["layer"] and "mlp_norm" in hp["layer"]
    out = kinds.save_eagle(hp, tmp_path / "h", REC, dtype=jnp.float32)
    meta = exported.read_meta(out, "eagle")
    assert meta["attn_norm"] is False and kinds.eagle_attn_norm(meta) is False
    back, _ = kinds.load_eagle(out, LLAMA)
    assert _bits(back) == _bits(hp)
    assert glue.eagle_attn_norm(out) is False
    assert glue.eagle_attn_norm(kinds.save_eagle(_heads()["eagle"], tmp_path / "n")) is True
    assert glue.eagle_attn_norm(tmp_path / "missing") is None
    for value, msg in ((True, "shapes differ"), ("no", "does not describe")):
        exported.write_meta(out, {**meta, "attn_norm": value})
        with pytest.raises(exported.CheckpointError, match=msg) as e:
            kinds.load_eagle(out, LLAMA)
        assert len(str(e.value).splitlines()) == 1


def test_a_two_layer_eagle_head_round_trips_as_its_head_json_says(tmp_path):
    """``save_eagle`` of a head with ``extra_layers`` writes ``layers: 2`` (a one-layer
    head's head.json has no such key); ``load_eagle`` reads it back bit for bit, and the
    same files with head.json claiming one layer, or a non-integer, are refused in one
    line; EAGLE-3 runs refuse extra layers."""
    hp = eagle.init_head(LLAMA, jax.random.key(4), layers=2)
    out = kinds.save_eagle(hp, tmp_path / "h", REC, dtype=jnp.float32)
    meta = exported.read_meta(out, "eagle")
    assert meta["layers"] == 2 and kinds.eagle_layers(meta) == 2
    assert "layers" not in exported.read_meta(kinds.save_eagle(_heads()["eagle"],
                                                               tmp_path / "one"), "eagle")
    back, _ = kinds.load_eagle(out, LLAMA)
    assert _bits(back) == _bits(hp)
    for value, msg in ((1, "shapes differ|tensors"), ("two", "does not describe"),
                       (0, "does not describe")):
        exported.write_meta(out, {**meta, "layers": value})
        with pytest.raises(exported.CheckpointError, match=msg) as e:
            kinds.load_eagle(out, LLAMA)
        assert len(str(e.value).splitlines()) == 1
    with pytest.raises(ValueError, match="EAGLE-2 options"):
        onpolicy.init_params(ttt.EAGLE3, LLAMA, onpolicy.OnPolicyConfig(draft_vocab=6,
                                                                         head_layers=2))


def test_trainers_build_and_guard_the_layout_they_are_asked_for(tmp_path):
    """``attn_norm=False`` gives EAGLE-2 trainers a head without the norm; a warm start of
    the other layout, EAGLE-3 without the norm, and resuming a run of the other layout
    are refused (``ValueError`` / ``CheckpointError``) instead of mis-shaping the tree."""
    cfg = onpolicy.OnPolicyConfig(draft_vocab=6, attn_norm=False)
    fresh = onpolicy.init_params(ttt.EAGLE2, LLAMA, cfg)
    assert "attn_norm" not in fresh["layer"]
    assert "attn_norm" in onpolicy.init_params(ttt.EAGLE2, LLAMA, dataclasses.replace(
        cfg, attn_norm=True))["layer"]
    with pytest.raises(ValueError, match="normalizes its attention input"):
        onpolicy.init_params(ttt.EAGLE2, LLAMA, cfg, init=_heads()["eagle"])
    with pytest.raises(ValueError, match="EAGLE-2 option"):
        onpolicy.init_params(ttt.EAGLE3, LLAMA, cfg)
    run_fields = train_eagle.run_fields
    assert "attn_norm" not in run_fields(train_eagle.TrainConfig())  # old runs resume
    assert run_fields(train_eagle.TrainConfig(attn_norm=False))["attn_norm"] is False
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"attn_norm": False}))
    train_eagle.check_run_layout(run, False)
    with pytest.raises(exported.CheckpointError, match="without attn_norm; pass --no-attn-norm"):
        train_eagle.check_run_layout(run, True)
    (run / "run.json").write_text(json.dumps({"steps": 3}))  # written before the option
    train_eagle.check_run_layout(run, True)
    with pytest.raises(exported.CheckpointError, match="with attn_norm; drop --no-attn-norm"):
        train_eagle.check_run_layout(run, False)


def test_a_folded_norm_keeps_the_attention_input_where_the_fc_output_has_its_scale():
    """``fold_attn_norm`` drops the layer's attention-input norm and scales ``qkv``'s
    columns by ``g / scale``: q, k and v of an ``fc`` output whose RMS is ``scale`` equal
    the normed head's (to float32 rounding and the norm's eps), and differ off that scale;
    the folded head is the layout a ``--no-attn-norm`` run warm-starts from. ``fc_rms`` is
    the mean RMS of the ``fc`` output over EAGLE's head entries; a head without the norm
    and a scale <= 0 are refused, and ``run.json`` records the flag only when set."""
    from specjax.drafters import blocks

    hp = eagle.init_head(LLAMA, jax.random.key(7))
    g = 1.0 + 0.3 * jax.random.normal(jax.random.key(8), hp["layer"]["attn_norm"].shape)
    hp = {**hp, "layer": {**hp["layer"], "attn_norm": g}}
    spec, scale = blocks.LayerSpec.of(LLAMA), 2.5
    x = jax.random.normal(jax.random.key(9), (LLAMA.hidden_size, 2, 5))  # [D, B, T]
    x = x * scale / jnp.sqrt(jnp.mean(x ** 2, axis=0, keepdims=True))
    folded = train_eagle.fold_attn_norm(hp, scale)
    assert "attn_norm" not in folded["layer"] and folded["fc"] is hp["fc"]
    want = blocks.qkv_heads(spec, hp["layer"], blocks.rms_norm(x, g, spec.rms_norm_eps, axis=0))
    for got, ref in zip(blocks.qkv_heads(spec, folded["layer"], x), want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5)
    off = blocks.qkv_heads(spec, folded["layer"], 2 * x)[0]
    assert np.abs(np.asarray(off) - np.asarray(want[0])).max() > 1e-2
    cfg = onpolicy.OnPolicyConfig(draft_vocab=6, attn_norm=False, fold_attn_norm=True)
    assert "attn_norm" not in onpolicy.init_params(ttt.EAGLE2, LLAMA, cfg, folded)["layer"]
    assert train_eagle.run_fields(cfg)["fold_attn_norm"] is True
    assert "fold_attn_norm" not in train_eagle.run_fields(onpolicy.OnPolicyConfig())
    model, tparams = llama()
    rng = np.random.default_rng(0)
    ex = [(rng.integers(0, LLAMA.vocab_size, n), 2,
           rng.standard_normal((n, LLAMA.hidden_size)).astype(np.float32)) for n in (4, 7)]
    rows = [np.concatenate([np.asarray(model.embed(tparams, jnp.asarray(t[None, 1:])))[0],
                            f[:-1]], -1) @ np.asarray(hp["fc"]) + np.asarray(hp["fc_b"])
            for t, _, f in ex]
    rms = np.sqrt(np.mean(np.concatenate(rows) ** 2, -1))
    assert len(rms) == 3 + 6
    assert train_eagle.fc_rms(model, hp, tparams, ex) == pytest.approx(rms.mean(), rel=1e-5)
    with pytest.raises(ValueError, match="no attention-input norm"):
        train_eagle.fold_attn_norm(folded, scale)
    with pytest.raises(ValueError, match="must be > 0"):
        train_eagle.fold_attn_norm(hp, 0.0)


def test_export_format_eagle_writes_the_published_eagle1_layout(tmp_path):
    """What ``--export-format eagle`` does after the export (``glue.export_published``):
    ``DIR-eagle`` holds the exported head, read back by ``published.load`` to the same
    parameters; a head with ``attn_norm`` has no such layout and writes nothing."""
    from specjax.heads import published

    hp = jax.tree.map(lambda x: x + 0.01, eagle.init_head(LLAMA, jax.random.key(5),
                                                           attn_norm=False))
    head_dir = kinds.save_eagle(hp, tmp_path / "h", REC)
    out = glue.export_published(head_dir, LLAMA)
    assert out == tmp_path / "h-eagle" == glue.published_dir(head_dir, "eagle")
    got = published.load(out, LLAMA)
    assert got.kind == "eagle" and "attn_norm" not in got.params["layer"]
    want, _ = kinds.load_eagle(head_dir, LLAMA)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b, np.float32)),
                 got.params, want)
    normed = kinds.save_eagle(_heads()["eagle"], tmp_path / "n")
    with pytest.raises(published.NoPublishedLayout, match="no input_layernorm"):
        glue.export_published(normed, LLAMA)
    assert not (tmp_path / "n-eagle").exists()
