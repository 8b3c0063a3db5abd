"""Training runs that fail lose nothing: every flag and input of ``distill``, ``features``
and ``train eagle|redrafter|exit-heads|onpolicy`` is checked before the target loads (one
line, exit 2 for a usage mistake, 1 for damaged input), the shards a run will replay are
verified first, and an error inside the on-policy loop leaves the last finished round
complete on disk and in ``log.jsonl``, from where a rerun resumes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jax
import ml_dtypes
import numpy as np
import pytest

from specjax import cli
from specjax.drafters import eagle
from specjax.heads import exported
from specjax.train import checkpoint, distill, onpolicy, shards
from toys import LLAMA, loaded_llama

N_PROMPTS = 40
# what the CLI builds from ONPOLICY's flags, so a store written here matches its settings
CFG = onpolicy.OnPolicyConfig(rounds=3, batch=4, max_new_tokens=10, val_prompts=4,
                              batch_tokens=128, draft_vocab=48)
ONPOLICY = ["train", "onpolicy", "--prompts", "{d}/prompts", "--shards", "{d}/store",
            "--run", "{d}/run", "--init", "{d}/head", "--rounds", "3", "--batch", "4",
            "--max-new-tokens", "10", "--val-prompts", "4", "--batch-tokens", "128",
            "--draft-vocab", "48"]
EAGLE = ["train", "eagle", "--data", "{d}/data", "--run", "{d}/run"]
REDRAFTER = ["train", "redrafter", "--data", "{d}/data", "--run", "{d}/run"]
REDRAFTER_STORE = ["train", "redrafter", "--shards", "{d}/store", "--run", "{d}/run"]
EXITS = ["train", "exit-heads", "--data", "{d}/data", "--run", "{d}/run"]


def _store(root, n: int = 3) -> None:
    """A store of ``n`` rounds in CFG's settings (another target's: nothing here loads one)."""
    store = shards.ShardStore(root, {"target": {"name": "other", "hash": "0" * 16},
                                     **onpolicy.store_settings(CFG, "none")}, 128)
    store.append([f"p#{i}" for i in range(4)], [(np.arange(3, 9), 2)] * 4, name="val")
    for r in range(n):
        store.append([f"p#{4 * r + i}" for i in range(4)], [(np.arange(3, 9 + r), 2)] * 4)


def _inputs(d):
    """Every input the table names, under ``d``."""
    (d / "prompts").mkdir()
    (d / "prompts" / "gsm8k_train.jsonl").write_text("".join(
        json.dumps({"question": "word " * (i % 5 + 1) + f"number {i}"}) + "\n"
        for i in range(N_PROMPTS)))
    for name, text in {"few": '{"question": "hi"}\n', "bad": '{"question": "a"}\n{oops\n',
                       "nofield": '{"q": "a"}\n'}.items():
        (d / name).mkdir()
        (d / name / "gsm8k_train.jsonl").write_text(text)
    (d / "noprompts").mkdir()
    (d / "afile").write_text("x")
    (d / "full").mkdir()
    (d / "full" / "notes.txt").write_text("keep me")
    (d / "data").mkdir()
    distill.save_shard(d / "data" / "shard_00000.npz",
                       [(np.arange(3, 9, dtype=np.int32), 2, np.zeros((6, 32), ml_dtypes.bfloat16))])
    exported.export_head(eagle.init_head(LLAMA, jax.random.key(0)), d / "head",
                         {"kind": "eagle", "vocab_ids": list(range(128))})
    for name in ("store", "noshard", "badsha", "settings", "badjson", "alist", "noshards"):
        _store(d / name)
    (d / "noshard" / "shard_00001.npz").unlink()
    with (d / "badsha" / "shard_00002.npz").open("ab") as f:
        f.write(b"x")
    m = json.loads((d / "settings" / "manifest.json").read_text())
    m["prompts"]["batch"] = 8
    (d / "settings" / "manifest.json").write_text(json.dumps(m))
    (d / "badjson" / "manifest.json").write_text('{"shards": [')
    (d / "alist" / "manifest.json").write_text("[1, 2]")
    (d / "noshards" / "manifest.json").write_text('{"target": {}}')
    (d / "nostore").mkdir()
    return d


def _with(argv, *extra):
    """``argv`` with ``extra`` appended: a later flag overrides an earlier one."""
    return [*argv, *extra]


CASES = [  # argv, exit code, a piece of the message
    # on-policy flags: out of range
    (_with(ONPOLICY, "--draft-vocab", "-5"), 2, "--draft-vocab must be >= 1, got -5"),
    (_with(ONPOLICY, "--draft-vocab", "0"), 2, "--draft-vocab must be >= 1"),
    (_with(ONPOLICY, "--draft-vocab", "200"), 2, "--draft-vocab 200 exceeds the 128 ids"),
    (_with(ONPOLICY, "--val-every", "0"), 2, "--val-every must be >= 1, got 0"),
    (_with(ONPOLICY, "--val-prompts", "0"), 2, "--val-prompts must be >= 1, got 0"),
    (_with(ONPOLICY, "--rounds", "0"), 2, "--rounds must be >= 1, got 0"),
    (_with(ONPOLICY, "--passes", "0"), 2, "--passes must be >= 1, got 0"),
    (_with(ONPOLICY, "--ttt", "-1"), 2, "--ttt must be >= 1, got -1"),
    (_with(ONPOLICY, "--ttt", "0"), 2, "--ttt must be >= 1, got 0"),
    (_with(ONPOLICY, "--stop-after", "0"), 2, "--stop-after must be >= 1"),
    (_with(ONPOLICY, "--warmup", "-1"), 2, "--warmup must be >= 0"),
    (_with(ONPOLICY, "--rounds", "30"), 2, "need 124 prompts"),
    (_with(ONPOLICY, "--sources", "gsm8k,wiki"), 2, "--sources: prompt sources ['wiki']"),
    (_with(ONPOLICY, "--sources", "t0"), 2, "need 16 prompts; --prompts {d}/prompts has 0"),
    # on-policy inputs and outputs
    (_with(ONPOLICY, "--export", "{d}/full"), 2, "--export {d}/full is a non-empty directory"),
    (_with(ONPOLICY, "--export", "{d}/afile"), 2, "--export {d}/afile is a file"),
    (_with(ONPOLICY, "--prompts", "{d}/missing"), 2, "--prompts {d}/missing does not exist"),
    (_with(ONPOLICY, "--prompts", "{d}/afile"), 2, "--prompts {d}/afile is a file"),
    (_with(ONPOLICY, "--prompts", "{d}/noprompts"), 2, "holds no prompt files"),
    (_with(ONPOLICY, "--prompts", "{d}/few"), 2, "--prompts {d}/few has 1"),
    (_with(ONPOLICY, "--prompts", "{d}/bad"), 1, "gsm8k_train.jsonl:2: not valid JSON"),
    (_with(ONPOLICY, "--prompts", "{d}/nofield"), 1, "gsm8k_train.jsonl:1: expected a JSON"),
    (_with(ONPOLICY, "--exclude", "{d}/missing.jsonl"), 2, "--exclude {d}/missing.jsonl"),
    (_with(ONPOLICY, "--init", "{d}/noprompts"), 1, "head.json"),
    # the shards a run replays: verified first; a corrupt manifest is named
    (_with(ONPOLICY, "--shards", "{d}/noshard"), 1, "noshard/shard_00001.npz is missing"),
    (_with(ONPOLICY, "--shards", "{d}/badsha"), 1,
     "badsha/shard_00002.npz is missing or does not match its SHA-256"),
    (_with(ONPOLICY, "--shards", "{d}/settings"), 1, "written with other settings"),
    (_with(ONPOLICY, "--shards", "{d}/badjson"), 1, "badjson/manifest.json is not valid JSON"),
    (_with(ONPOLICY, "--shards", "{d}/alist"), 1, "alist/manifest.json is not a shard manifest"),
    (_with(ONPOLICY, "--shards", "{d}/noshards"), 1, "noshards/manifest.json is not a shard"),
    # the other training commands
    (_with(EAGLE, "--draft-vocab", "-1"), 2, "--draft-vocab must be >= 0, got -1"),
    (_with(EAGLE, "--ce-vocab", "-1"), 2, "--ce-vocab must be >= 0"),
    (_with(EAGLE, "--val-examples", "-1"), 2, "--val-examples must be >= 0"),
    (_with(EAGLE, "--export", "{d}/full"), 2, "--export {d}/full is a non-empty directory"),
    (_with(EAGLE, "--data", "{d}/missing"), 2, "--data {d}/missing does not exist"),
    (_with(EAGLE, "--data", "{d}/afile"), 2, "--data {d}/afile is a file"),
    (_with(EAGLE, "--data", "{d}/noprompts"), 1, "no shard_*.npz in"),
    (_with(REDRAFTER, "--draft-vocab", "-1"), 2, "--draft-vocab must be >= 0"),
    (_with(REDRAFTER, "--unroll", "0"), 2, "--unroll must be >= 1"),
    (_with(REDRAFTER, "--blocks", "-1"), 2, "--blocks must be >= 0"),
    (_with(REDRAFTER, "--export", "{d}/full"), 2, "--export {d}/full is a non-empty directory"),
    (_with(REDRAFTER_STORE, "--shards", "{d}/noshard"), 1, "shard_00001.npz is missing"),
    (_with(REDRAFTER_STORE, "--shards", "{d}/alist"), 1, "alist/manifest.json is not a shard"),
    (_with(REDRAFTER_STORE, "--shards", "{d}/nostore"), 1, "holds no shard store"),
    (_with(REDRAFTER_STORE, "--shards", "{d}/missing"), 2, "--shards {d}/missing does not"),
    (_with(EXITS, "--kl-vocab", "-1"), 2, "--kl-vocab must be >= 0"),
    (_with(EXITS, "--layers", "2,x"), 2, "--layers must be comma-separated ints"),
    (_with(EXITS, "--export", "{d}/full"), 2, "--export {d}/full is a non-empty directory"),
    (["distill", "--prompts", "{d}/missing", "--out", "{d}/o"], 2, "--prompts {d}/missing"),
    (["distill", "--prompts", "{d}/noprompts", "--out", "{d}/o"], 2, "holds no prompt files"),
    (["distill", "--prompts", "{d}/bad", "--out", "{d}/o"], 1, "jsonl:2: not valid JSON"),
    (["features", "--prompts", "{d}/afile", "--out", "{d}/o"], 2, "--prompts {d}/afile is a"),
    (["features", "--prompts", "{d}/few", "--out", "{d}/o"], 1,
     "jsonl:1: expected a JSON object with 'question', 'answer'"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return _inputs(tmp_path_factory.mktemp("inputs"))


def _main(argv, d, capsys) -> tuple[int, str]:
    """``specjax argv`` (``{d}`` replaced): its exit code and its stderr."""
    try:
        code = cli.main([a.replace("{d}", str(d)) for a in argv])
    except SystemExit as e:  # argparse's own errors exit from inside parse_args
        code = e.code
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv,code,msg", CASES, ids=[" ".join(c[0][1:2] + c[0][-2:])
                                                     for c in CASES])
def test_a_bad_flag_or_input_is_one_line_before_the_model_loads(argv, code, msg, inputs,
                                                                no_model, capsys, monkeypatch):  # noqa: F811
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    got, err = _main(argv, inputs, capsys)
    assert got == code, err
    assert len(err.splitlines()) == 1 and err.startswith("specjax: error: "), err
    assert msg.replace("{d}", str(inputs)) in err, err
    assert not (inputs / "run").exists() and not (inputs / "o").exists()  # nothing written


@pytest.mark.parametrize("argv", [_with(ONPOLICY, "--draft-vocab", "100"),
                                  _with(EAGLE, "--draft-vocab", "13"),
                                  _with(REDRAFTER, "--draft-vocab", "13")],
                         ids=["onpolicy", "eagle", "redrafter"])
def test_a_draft_vocabulary_past_the_targets_is_refused_from_its_config(argv, inputs, capsys,
                                                                         monkeypatch):
    """The target's vocabulary (LLAMA's 12 ids) comes from its configuration: ``load`` runs
    the check before reading any weight, here before failing the test."""
    def load(name, check=None, **kw):
        if check is not None:
            check(None, LLAMA)
        raise AssertionError("the weights were read before --draft-vocab was checked")

    monkeypatch.setattr("specjax.models.load", load)
    got, err = _main(argv, inputs, capsys)
    assert got == 2 and "exceeds the 12 ids of" in err and len(err.splitlines()) == 1, err


def test_only_the_shards_a_run_will_replay_are_verified(inputs, tmp_path, no_model,  # noqa: F811
                                                        capsys):
    """A run resuming after round 2 replays round 3 only: a damaged round 2 does not stop
    it (it gets as far as loading the model), a damaged round 3 does."""
    (tmp_path / "run" / "ckpt" / "2").mkdir(parents=True)
    argv = [a.replace("{d}/run", str(tmp_path / "run")) for a in ONPOLICY]
    got, err = _main(_with(argv, "--shards", "{d}/noshard"), inputs, capsys)
    assert got == 1 and "the model was loaded" in err, err
    got, err = _main(_with(argv, "--shards", "{d}/badsha"), inputs, capsys)
    assert got == 1 and "shard_00002.npz is missing or does not match" in err, err


def test_a_store_of_another_target_names_both_targets(tmp_path):
    """``store_corpus`` (``train redrafter --shards``) names the store's target and the
    current one, with their hashes."""
    _store(tmp_path / "s")
    lm = SimpleNamespace(model=SimpleNamespace(config=LLAMA), source=tmp_path / "mine",
                         params={"w": np.ones(3, np.float32)})
    mine = shards.target_hash(LLAMA, lm.params)
    with pytest.raises(shards.ShardError, match=f"target 'other' \\(hash 0{{16}}\\), not of "
                                                f"'mine' \\(hash {mine}\\)"):
        onpolicy.store_corpus(lm, tmp_path / "s")


def test_closing_finishes_pending_writes_on_error():
    calls = []

    class Manager:
        def wait_until_finished(self):
            calls.append("wait")

        def close(self):
            calls.append("close")

    with pytest.raises(RuntimeError, match="boom"), checkpoint.closing(Manager()):
        raise RuntimeError("boom")
    assert calls == ["wait", "close"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return loaded_llama(tmp_path_factory.mktemp("toy"), seed=3)


def _rounds(run):
    return [json.loads(r)["round"] for r in (run / "log.jsonl").read_text().splitlines()]


def test_an_error_in_round_3_keeps_round_2_and_a_rerun_finishes(lm, tmp_path, capsys,
                                                                monkeypatch):
    """An error inside the loop after round 2: one line, exit 1, ``ckpt/2`` complete (no
    ``*.orbax-checkpoint-tmp``), ``log.jsonl`` ending at round 2; a rerun resumes there."""
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    d = _inputs(tmp_path)
    monkeypatch.setattr("specjax.models.load", lambda *a, **k: lm)
    exported.export_head(eagle.init_head(lm.model.config, jax.random.key(0)), d / "head",
                         {"kind": "eagle", "vocab_ids": list(range(128))})
    argv = _with(ONPOLICY, "--shards", "{d}/mine", "--ttt", "1")
    real = onpolicy._round_data

    def fail_in_round_3(lm, store, which, *a, **k):
        if which == 2:
            raise RuntimeError("injected failure in round 3")
        return real(lm, store, which, *a, **k)

    monkeypatch.setattr(onpolicy, "_round_data", fail_in_round_3)
    finished, finish = [], checkpoint.finish
    monkeypatch.setattr(checkpoint, "finish", lambda m: (finished.append(m), finish(m)))
    got, err = _main(argv, d, capsys)
    assert got == 1 and "Traceback" not in err, err
    assert len(finished) == 1  # the manager's writes finished and it closed after the error
    assert err.splitlines()[-1].startswith("specjax: error: RuntimeError: injected failure")
    ckpt = d / "run" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["1", "2"]
    assert checkpoint.latest_step(d / "run") == 2 and _rounds(d / "run") == [0, 1, 2]
    monkeypatch.setattr(onpolicy, "_round_data", real)
    assert _main(argv, d, capsys)[0] == 0
    assert _rounds(d / "run") == [0, 1, 2, 3]
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", "3"]
    rows = [json.loads(r) for r in (d / "run" / "log.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] > rows[-2]["step"] and not rows[-1]["replayed"]


def test_a_pool_of_chosen_sources_keeps_their_order_and_turns(tmp_path):
    """``prompt_pool(sources=...)``: only those sources, still in turn, each source's
    prompts in the order the whole pool gives them."""
    (tmp_path / "t0").mkdir()
    (tmp_path / "gsm8k_train.jsonl").write_text(
        "".join(json.dumps({"question": f"g{i}"}) + "\n" for i in range(5)))
    (tmp_path / "self_instruct_a.jsonl").write_text(
        "".join(json.dumps({"instruction": f"s{i}"}) + "\n" for i in range(3)))
    (tmp_path / "t0" / "x.jsonl").write_text(
        "".join(json.dumps({"prompt": f"t{i}"}) + "\n" for i in range(2)))
    full = onpolicy.prompt_pool(tmp_path, seed=3)
    some = onpolicy.prompt_pool(tmp_path, seed=3, sources=("t0", "gsm8k"))
    assert [t[0] for _, t in some[:4]] == ["g", "t", "g", "t"] and len(some) == 7
    for src in ("g", "t"):
        assert [t for _, t in some if t[0] == src] == [t for _, t in full if t[0] == src]
    assert {t[0] for _, t in full} == {"g", "s", "t"}
    for bad in (("gsm8k", "nope"), ()):
        with pytest.raises(ValueError, match="choose from gsm8k, self_instruct, t0"):
            onpolicy.prompt_pool(tmp_path, sources=bad)


# ------------------------------------- damaged files named before the model (round three)

@pytest.fixture
def own_inputs(tmp_path):
    """Inputs of one test's own (these tests damage them)."""
    return _inputs(tmp_path)


def _cli(argv, d, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    return _main(argv, d, capsys)


def test_a_truncated_feature_file_is_refused_before_the_target_loads(own_inputs, no_model,
                                                                     capsys, monkeypatch):
    f = own_inputs / "feats" / ("0" * 16) / "layers-1-2" / "abc.npy"
    f.parent.mkdir(parents=True)
    np.save(f, np.ones((5, 4), np.float32))
    f.with_suffix(".json").write_text(json.dumps({"bytes": f.stat().st_size, "sha256": "0"}))
    f.write_bytes(f.read_bytes()[:-8])
    code, err = _cli([*ONPOLICY, "--feature-cache", "{d}/feats"], own_inputs, capsys, monkeypatch)
    assert code == 1 and len(err.splitlines()) == 1, err
    assert f"{f} holds" in err and "truncated or damaged" in err, err


def test_a_corrupt_run_json_is_named_before_the_target_loads(own_inputs, no_model, capsys,
                                                             monkeypatch):
    """Before: a bare JSON error (``train eagle``: after the target loaded)."""
    (own_inputs / "run").mkdir()
    (own_inputs / "run" / "run.json").write_text('{"kind": "eagle", "st')
    for argv in (EAGLE, ONPOLICY):
        code, err = _cli(argv, own_inputs, capsys, monkeypatch)
        assert code == 1 and len(err.splitlines()) == 1, err
        assert f"{own_inputs / 'run' / 'run.json'} is not readable JSON" in err, err
        assert "use another --run directory" in err, err


def test_a_run_whose_every_step_is_damaged_is_refused_before_the_target_loads(
        own_inputs, no_model, capsys, monkeypatch):
    """Before: refused only once the target had loaded (``train eagle``) or its features
    had been computed (``train dflash``)."""
    ckpt = own_inputs / "run" / "ckpt"
    for s in (3, 4):
        (ckpt / str(s)).mkdir(parents=True)
        (ckpt / str(s) / checkpoint.MANIFEST).write_text("{")
    dflash = ["train", "dflash", "--shards", "{d}/store", "--run", "{d}/run"]
    for argv in (EAGLE, ONPOLICY, REDRAFTER, EXITS, dflash):
        code, err = _cli(argv, own_inputs, capsys, monkeypatch)
        assert code == 1 and len(err.splitlines()) == 1, (argv[1], err)
        assert f"every checkpoint in {ckpt} is corrupt (step 4: its manifest" in err, err
    (ckpt / "3" / checkpoint.MANIFEST).unlink()  # a step without one is taken as whole
    checkpoint.check_steps(own_inputs / "run")


def test_a_damaged_distill_shard_is_named_before_the_target_loads(own_inputs, no_model, capsys,
                                                                  monkeypatch):
    """Before: "BadZipFile: Bad CRC-32 for file 'feats.npy'", naming no shard."""
    shard = own_inputs / "data" / "shard_00000.npz"
    raw = bytearray(shard.read_bytes())
    at = raw.index(b"feats.npy") + 200  # inside the feats array's bytes
    raw[at] ^= 0x01
    shard.write_bytes(bytes(raw))
    code, err = _cli(EAGLE, own_inputs, capsys, monkeypatch)
    assert code == 1 and len(err.splitlines()) == 1, err
    assert f"{shard} is damaged (BadZipFile: Bad CRC-32" in err, err
    assert "delete it and rerun" in err, err
