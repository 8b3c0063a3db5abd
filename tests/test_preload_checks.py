"""Checks that need only the model's config run before its weights load, and the Python
API refuses what it would otherwise truncate (issue 62, round three).

The CLI cases run on a toy Llama directory that holds only a ``config.json`` (vocab 64,
4 layers, a context of 512): reading its weights fails the test (``weights_guard``), so
each refusal is proven to come from the config alone. Where a case is accepted, the run
reaches the weights, which is what the guard reports.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import toys
from published import write_eagle1_head, write_eagle3_head
from specjax import cli, methods, models

V, LAYERS, CONTEXT = 64, 4, 512
TOY = dict(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
           num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=CONTEXT, tie_word_embeddings=False)
HEAD = dict(hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=V)
WEIGHTS_READ = toys.WEIGHTS_READ


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The config-only toy, and published EAGLE-1/2 and EAGLE-3 heads in its sizes."""
    root = tmp_path_factory.mktemp("preload")
    (root / "toy").mkdir()
    (root / "toy" / "config.json").write_text(json.dumps(TOY))
    (root / "badtok").mkdir()
    (root / "badtok" / "config.json").write_text(json.dumps(TOY))
    (root / "badtok" / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    write_eagle1_head(root / "eagle1", weights="model.safetensors", **HEAD)
    write_eagle1_head(root / "eagle1bin", weights="pytorch_model.bin", **HEAD)
    write_eagle3_head(root / "eagle3", draft_vocab=24, weights="model.safetensors", **HEAD)
    return root


def _run(argv, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("specjax: error: "), err
    return code, err


def _ids(n: int) -> str:
    return ",".join(str(3 + i % 50) for i in range(n))


GENERATE = [  # generate arguments after --model, exit code, a piece of the message
    (["--prompt-ids", "1,2,99"], 2, "--prompt-ids has id 99, outside the vocabulary of 64"),
    (["--prompt-ids", _ids(510), "--max-new-tokens", "8"], 2,
     "a prompt of 510 tokens + --max-new-tokens 8 exceeds"),
    (["--prompt-ids", "1,2", "--method", "sd-early-exit:4"], 2,
     "sd-early-exit:4: the exit layer must lie in [1, 3]; the model has 4 layers"),
    (["--prompt-ids", "1,2", "--method", "sd", "--drafter", "early-exit:9"], 2,
     "the exit layer must lie in [1, 3]"),
    # HSD: the plain exits are --layers' (SmolLM2's defaults): the message says what to pass
    (["--prompt-ids", "1,2", "--method", "hsd:ngram:4,2:3,target"], 2,
     "uses exit layers [2], but no exit heads are given or ship for"),
    (["--prompt-ids", "1,2", "--method", "hsd:ngram:4,2:3,target"], 2, "pass --layers 2"),
    (["--prompt-ids", "1,2", "--method", "hsd:ngram:4,5:3,target", "--layers", "5"], 2,
     "exit layers [5] lie outside [1, 3]; the model has 4 layers"),
    (["--prompt-ids", "1,2", "--method", "redrafter"], 1, "no ReDrafter head ships for"),
    # a published head of the other kind, told by its tensor names
    (["--prompt-ids", "1,2", "--method", "eagle3", "--draft-checkpoint", "{d}/eagle1"], 2,
     "holds a published EAGLE-1/2 head: use --method eagle2"),
    (["--prompt-ids", "1,2", "--method", "eagle3", "--draft-checkpoint", "{d}/eagle1bin"], 2,
     "holds a published EAGLE-1/2 head: use --method eagle2"),
    (["--prompt-ids", "1,2", "--method", "eagle2:3,2,5", "--draft-checkpoint", "{d}/eagle3"],
     2, "holds a published EAGLE-3 head: use --method eagle3"),
    # the method's draft slots count: eagle3's 60 nodes and root
    (["--prompt-ids", _ids(500), "--max-new-tokens", "8", "--method", "eagle3",
      "--draft-checkpoint", "{d}/eagle3"], 2,
     "a prompt of 500 tokens + --max-new-tokens 8 + 61 draft slots of --method eagle3 "
     "exceeds"),
    (["--prompt-ids", _ids(444), "--max-new-tokens", "8", "--method", "eagle3",
      "--draft-checkpoint", "{d}/eagle3"], 2, "+ 61 draft slots"),
    (["--prompt-ids", _ids(500), "--max-new-tokens", "8", "--method", "sd-ngram:7"], 2,
     "+ 8 draft slots"),
    (["--prompt-ids", _ids(500), "--max-new-tokens", "8", "--method", "hsd:ngram:4,2:3,target",
      "--layers", "2"], 2, "draft slots"),
    # --verify-widths: what does not read as widths, then widths the method's draft refuses
    *[(["--prompt-ids", "1,2", "--method", "sd-ngram:7", "--verify-widths", w], 2,
       f"argument --verify-widths: {m}") for w, m in [
        ("0", "verification widths '0' must be positive"),
        ("-1", "verification widths '-1' must be positive"),
        ("abc", "unknown verification widths 'abc'"),
        ("", "unknown verification widths ''"),
        ("padded,3", "unknown verification widths 'padded,3'"),
        ("1,,8", "unknown verification widths '1,,8'")]],
    (["--prompt-ids", "1,2", "--method", "sd-ngram:3", "--verify-widths", "8,4"], 2,
     "--verify-widths 8,4: sd-ngram:3: verification widths 4,8 must lie in [1, 4] and "
     "include 4"),
    (["--prompt-ids", "1,2", "--method", "sd-ngram:7", "--verify-widths", "100000"], 2,
     "--verify-widths 100000: sd-ngram:7: verification widths 100000 must lie in [1, 8]"),
    (["--prompt-ids", "1,2", "--method", "eagle3", "--draft-checkpoint", "{d}/eagle3",
      "--verify-widths", "1,8"], 2, "--verify-widths 1,8: eagle3"),
    (["--prompt-ids", "1,2", "--method", "hsd:ngram:4,2:3,target", "--layers", "2",
      "--verify-widths", "1,5"], 2, "not fixed widths 1,5"),
]


@pytest.mark.parametrize("argv,code,msg", GENERATE,
                         ids=[f"{i}-{' '.join(a[2:4])}" for i, (a, _, _) in enumerate(GENERATE)])
def test_generate_refuses_before_the_weights_load(argv, code, msg, dirs, weights_guard, capsys,
                                                  monkeypatch):
    argv = ["generate", "--model", str(dirs / "toy"),
            *(a.replace("{d}", str(dirs)) for a in argv)]
    got, err = _run(argv, capsys, monkeypatch)
    assert WEIGHTS_READ not in err, err
    assert (got, msg in err) == (code, True), err


@pytest.mark.parametrize("argv", [
    ["--prompt-ids", _ids(504), "--max-new-tokens", "8"],  # ar: exactly the context
    ["--prompt-ids", _ids(443), "--max-new-tokens", "8", "--method", "eagle3",
     "--draft-checkpoint", "{d}/eagle3"],  # 443 + 8 + 61 = 512
    ["--prompt-ids", "1,2", "--method", "sd-early-exit:3"],
    ["--prompt-ids", "1,2", "--method", "hsd:ngram:4,2:3,target", "--layers", "2"],
    ["--prompt-ids", "1,2", "--method", "eagle2:3,2,5", "--draft-checkpoint", "{d}/eagle1"],
    ["--prompt-ids", "1,2", "--method", "sd-ngram:7", "--verify-widths", "8,1,4"],
    ["--prompt-ids", "1,2", "--method", "hsd:ngram:4,2:3,target", "--layers", "2",
     "--verify-widths", "per-width"],
], ids=["ar-full-context", "eagle3-full-context", "early-exit-3", "hsd-layers-2",
        "eagle2-eagle1", "widths-8,1,4", "hsd-per-width"])
def test_what_fits_goes_on_to_the_weights(argv, dirs, weights_guard, capsys, monkeypatch):
    """The edges of each refusal are accepted: the run goes on to read the weights."""
    argv = ["generate", "--model", str(dirs / "toy"),
            *(a.replace("{d}", str(dirs)) for a in argv)]
    got, err = _run(argv, capsys, monkeypatch)
    assert got == 1 and WEIGHTS_READ in err, err


def test_a_corrupt_tokenizer_file_is_named(dirs, weights_guard, capsys, monkeypatch):
    path = dirs / "badtok" / "tokenizer.json"
    got, err = _run(["generate", "--model", str(dirs / "badtok"), "--prompt", "hi"], capsys,
                    monkeypatch)
    assert got == 1 and f"{path}: not a readable JSON file (JSONDecodeError" in err, err


BENCH = [
    (["--methods", "ar,sd-early-exit:7", "--random-prompts", "1"], "sd-early-exit:7: the "
     "exit layer must lie in [1, 3]"),
    (["--methods", "ar,hsd:ngram:4,2:3,target", "--random-prompts", "1"], "pass --layers 2"),
    (["--methods", "ar,eagle3", "--draft-checkpoint", "{d}/eagle1", "--random-prompts", "1"],
     "use --method eagle2"),
    (["--methods", "ar,eagle3", "--draft-checkpoint", "{d}/eagle3", "--random-prompts", "1",
      "--prompt-len", "440", "--max-new-tokens", "16"], "--prompt-len 440 + --max-new-tokens "
     "16 + 61 draft slots exceeds"),
]


@pytest.mark.parametrize("argv,msg", BENCH, ids=[a[1] for a, _ in BENCH])
def test_bench_refuses_before_the_weights_load(argv, msg, dirs, weights_guard, capsys,
                                               monkeypatch):
    argv = ["bench", "--model", str(dirs / "toy"), *(a.replace("{d}", str(dirs)) for a in argv)]
    got, err = _run(argv, capsys, monkeypatch)
    assert got == 2 and msg in err, err


def test_exit_heads_at_other_layers_are_named_before_the_weights_load(dirs, weights_guard,
                                                                      tmp_path, capsys,
                                                                      monkeypatch):
    from specjax.drafters import exit_heads
    from specjax.heads import kinds

    cfg = models.config(str(dirs / "toy"))
    heads = exit_heads.init_heads(cfg, [1], jax.random.key(0), rank=4)
    kinds.save_exit_heads(heads, tmp_path / "exits", layers=[1], rank=4)
    got, err = _run(["generate", "--model", str(dirs / "toy"), "--prompt-ids", "1,2",
                     "--method", "hsd:ngram:4,2:3,target", "--exit-heads",
                     str(tmp_path / "exits")], capsys, monkeypatch)
    assert got == 2 and "the exit heads in" in err and "are at layers [1]" in err, err


# ----------------------------------------------------------------------------- Python API


def test_methods_check_takes_the_config(dirs):
    """``methods.check(spec, options, config)``: the same refusals for a Python caller,
    from ``specjax.models.config`` (no weight read)."""
    cfg = models.config(str(dirs / "toy"))
    assert cfg.num_layers == LAYERS and cfg.vocab_size == V
    assert methods.check("sd-early-exit:3", methods.Options(), cfg) == methods.parse(
        "sd-early-exit:3")
    with pytest.raises(methods.SpecError, match=re.escape("must lie in [1, 3]")):
        methods.check("sd-early-exit:4", methods.Options(), cfg)
    with pytest.raises(methods.SpecError, match="pass --layers 2"):
        methods.check("hsd:ngram:4,2:3,target", methods.Options(), cfg)
    with pytest.raises(TypeError, match="methods.check: config must be a model config"):
        methods.check("ar", methods.Options(), {"num_layers": 4})
    with pytest.raises(FileNotFoundError, match="no ReDrafter head ships for 'toy'"):
        methods.check("redrafter", methods.Options(model_name="toy"))


def test_build_names_the_layers_to_pass():
    """``methods.build`` of an HSD spec whose exits are not among ``Options.layers``."""
    lm = toys.ToyLM(*toys.llama())
    with pytest.raises(methods.SpecError, match=re.escape("pass --layers 1 (Options.layers)")):
        methods.build("hsd:ngram:4,1:3,target", lm, methods.Options())
    built = methods.build("hsd:ngram:4,1:3,target", lm, methods.Options(layers=(1,)))
    assert built.name == "hsd:ngram:4,1:3,target"


SPECS = [s for c in methods.registered() if c.decodes for s in (*c.tiny, *c.device)
         if s != "hsd"] + ["eagle2", "redrafter", "sd-ngram", "sd-early-exit:2"]


@pytest.mark.parametrize("draft_len", [None, 3])
def test_scratch_is_the_built_decoders(draft_len):
    """``Method.scratch`` (what the pre-load context check counts) equals the scratch of
    the decoder each spec builds, defaults and ``--draft-len`` included."""
    llama = toys.ToyLM(*toys.llama())
    opts = methods.Options(layers=(1, 2), draft_len=draft_len)
    for text in SPECS:
        spec = methods.parse(text)
        built = spec.random(toys.lm_for(text, llama), opts, jax.random.key(0))
        assert spec.scratch(opts) == built.decoder.scratch > 0 or text == "ar", text
    assert methods.parse("ar").scratch(opts) == 0
    assert methods.parse("eagle3").scratch(opts) == 61  # EAGLE's own 7,10,60
    assert methods.parse("hsd").scratch(opts) is None  # tuned when built


def _api_calls():
    from specjax import decode, generate

    model, params = toys.llama()
    built = methods.build("sd-ngram:3", toys.ToyLM(model, params))
    return {"generate": lambda p, n: generate(model, params, p, max_new_tokens=n),
            "decode": lambda p, n: decode(built.decoder, built.params, p, max_new_tokens=n),
            "built": lambda p, n: built(p, max_new_tokens=n)}


@pytest.mark.parametrize("prompts,budget,msg", [
    ([[5, 9]], 2.5, "max_new_tokens must be an int (or one int per prompt), got float 2.5"),
    ([[5, 9]], 3.0, "max_new_tokens must be an int"),
    ([[5, 9]], [4.5], "max_new_tokens[0] must be an int, got float 4.5"),
    ([[5.7, 9.2]], 3, "prompts[0] must hold integer token ids, got float64 values such as 5.7"),
    ([[5, 9.0]], 3, "prompts[0] must hold integer token ids"),
    ([[5, 9], np.array([1.0, 2.0])], 3, "prompts[1] must hold integer token ids"),
    ([5, 9], 3, "prompts[0] must be a sequence of integer token ids, got int"),
])
def test_python_api_refuses_floats_naming_the_argument(prompts, budget, msg):
    for name, call in _api_calls().items():
        with pytest.raises(TypeError, match=re.escape(msg)):
            call(prompts, budget)


def test_integer_arrays_are_still_token_ids_and_budgets():
    calls = _api_calls()
    want = calls["generate"]([[5, 9, 2]], 4).to_lists()
    assert calls["generate"](np.array([[5, 9, 2]]), np.int64(4)).to_lists() == want
    assert calls["generate"]([jnp.array([5, 9, 2])], np.array([4])).to_lists() == want
    assert calls["built"]([(5, 9, 2)], (4,)).to_lists() == calls["built"]([[5, 9, 2]],
                                                                         4).to_lists()


# ----------------------------------------------------------------------------- finite weights


def test_check_finite_names_the_first_bad_weight():
    _, params = toys.llama()
    assert models.check_finite(params) is None
    bad = jax.tree.map(lambda x: x, params)
    bad["layers"][1]["o"] = bad["layers"][1]["o"].at[0, 0].set(jnp.nan)
    bad["layers"][2]["o"] = bad["layers"][2]["o"].at[0, :2].set(jnp.inf)
    with pytest.raises(ValueError, match=r"weight 'layers\.1\.o' holds 1 NaN values") as e:
        models.check_finite(bad)
    assert len(str(e.value).splitlines()) == 1
    del bad["layers"][1]
    with pytest.raises(ValueError, match="holds 2 infinite values"):
        models.check_finite(bad)


def test_generate_check_weights_refuses_nan_weights(capsys, monkeypatch):
    model, params = toys.llama()
    params = jax.tree.map(lambda x: x, params)
    params["final_norm"] = params["final_norm"].at[3].set(jnp.nan)
    monkeypatch.setattr("specjax.models.load", lambda *a, **k: toys.ToyLM(model, params))
    got, err = _run(["generate", "--model", "toy", "--prompt-ids", "1,2", "--check-weights"],
                    capsys, monkeypatch)
    assert got == 1 and "weight 'final_norm' holds 1 NaN values" in err, err


def test_the_python_api_checks_fixed_widths_against_the_spec():
    """``methods.check`` refuses widths the build would refuse, before any model exists."""
    from specjax.methods.registry import WidthsError

    with pytest.raises(WidthsError, match=r"sd-ngram:3: verification widths 2,8 must lie in "
                                          r"\[1, 4\] and include 4"):
        methods.check("sd-ngram:3", methods.Options(widths=(8, 2)))
    with pytest.raises(WidthsError, match="must be positive integers"):
        methods.check("sd-ngram:3", methods.Options(widths="0,4"))
    with pytest.raises(WidthsError, match="not fixed widths 1,5"):
        methods.check("hsd:ngram:4,2:3,target", methods.Options(widths="1,5", layers=(2,)))
    methods.check("sd-ngram:3", methods.Options(widths=(4, 1)))
    methods.check("ar", methods.Options(widths=(1, 8)))  # ar verifies nothing
    methods.check("hsd:ngram:4,2:3,target", methods.Options(widths="padded", layers=(2,)))
