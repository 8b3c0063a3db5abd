"""Nothing lost, round four: every file of a head specjax wrote proves it is whole, and what
is wrong with a head is said in one line before the target's weights load.

- an exported head's ``head.json`` records its own SHA-256 (``head_sha256``) beside that of
  ``params.safetensors``: an edited ``head.json`` is refused (heads from before the field
  still load, unchecked; ``exported.write_meta`` writes an edit on purpose);
- a head ``convert-head`` wrote in the published layout keeps ``model.safetensors``'s
  SHA-256 in ``model.safetensors.sha256``, checked where it is present;
- duplicate ``vocab_ids`` are refused before the target loads;
- a head a killed export or conversion left in ``.NAME.old-PID`` is put back before the
  CLI's existence check;
- ``convert-head`` refuses a ``head.json`` without ``vocab_ids``, and says in one line what
  the EAGLE-1/2 layout cannot hold (a ranked vocabulary).

The CLI cases run on a toy Llama directory holding only a ``config.json``: reading its
weights fails the test's guard, so a refusal is proven to come before the weights; an
accepted head reaches the weights, which is what the guard reports.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import toys
from specjax import _atomic, cli
from specjax.commands.convert import target_config
from specjax.drafters import eagle, eagle3
from specjax.heads import exported, kinds, published

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
V = 64
TOY = dict(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=64,
           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=512, tie_word_embeddings=False)
WEIGHTS_READ = toys.WEIGHTS_READ
DEAD = 2 ** 22 + 1  # no such process: what a killed writer's pid is to the next one


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The config-only toy's directory and configuration."""
    root = tmp_path_factory.mktemp("integrity")
    (root / "toy").mkdir()
    (root / "toy" / "config.json").write_text(json.dumps(TOY))
    return root / "toy", target_config(str(root / "toy"))


def _cli(argv, capsys) -> tuple[int, str, str]:
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def _refused(argv, capsys, code: int, *fragments: str) -> str:
    """``argv`` exits ``code`` with one line ``specjax: error: ...`` holding ``fragments``,
    the weights unread."""
    got, _, err = _cli(argv, capsys)
    assert got == code and len(err.splitlines()) == 1, (got, err)
    assert err.startswith("specjax: error: ") and WEIGHTS_READ not in err, err
    for f in fragments:
        assert f in err, err
    return err


def _generate(model_dir, head, method="eagle2:2,2,3") -> list:
    return ["generate", "--model", model_dir, "--prompt-ids", "1,2", "--method", method,
            "--draft-checkpoint", head]


def _reaches_the_weights(argv, capsys) -> str:
    code, _, err = _cli(argv, capsys)
    assert code == 1 and WEIGHTS_READ in err, (code, err)
    return err


def _eagle(cfg, out, seed=0, **kw) -> Path:
    """An exported EAGLE-1/2 head without attn_norm (so it converts to EAGLE-1/2), its
    vocabulary ranked."""
    kw.setdefault("vocab_ids", np.arange(V)[::-1][:32])
    return kinds.save_eagle(eagle.init_head(cfg, jax.random.key(seed), attn_norm=False), out,
                            **kw)


def _eagle3(cfg, out, ids=None) -> Path:
    ids = np.random.default_rng(0).permutation(V)[:16] if ids is None else ids
    return kinds.save_eagle3(eagle3.init_head(cfg, jax.random.key(1), len(ids)), out,
                             vocab_ids=ids, layers=eagle3.fused_layers(cfg.num_layers))


def _meta(head: Path) -> dict:
    return json.loads((head / exported.HEAD_JSON).read_text())


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ----------------------------------------------------------------- 1. head.json is covered

def test_an_edited_head_json_is_refused_before_the_target_loads(toy, tmp_path, capsys,
                                                                 weights_guard):
    model_dir, cfg = toy
    head = _eagle(cfg, tmp_path / "h", draft_vocab=16)
    meta = _meta(head)
    _reaches_the_weights(_generate(model_dir, head), capsys)
    edited = {**meta, "draft_vocab": 17}
    (head / exported.HEAD_JSON).write_text(json.dumps(edited, indent=1))
    err = _refused(_generate(model_dir, head), capsys, 1, str(head / exported.HEAD_JSON),
                   "was edited or is damaged", "head_sha256", "export the head again")
    assert meta[exported.HEAD_SHA_KEY] == exported.meta_sha256(meta)
    with pytest.raises(exported.CheckpointError) as e:
        kinds.load_eagle(head, cfg)
    assert str(e.value) == err.removeprefix("specjax: error: ")
    _refused(["convert-head", head, tmp_path / "o", "--to", "eagle", "--model", model_dir],
             capsys, 1, "was edited or is damaged")
    assert not (tmp_path / "o").exists()
    # an edit on purpose, written with write_meta: read as edited
    exported.write_meta(head, edited)
    assert exported.read_meta(head, "eagle")["draft_vocab"] == 17
    _reaches_the_weights(_generate(model_dir, head), capsys)
    # a head exported before head_sha256 (params_sha256 only, as the shipped heads): read
    # as before, its parameters still checked
    old = {k: v for k, v in edited.items() if k != exported.HEAD_SHA_KEY}
    (head / exported.HEAD_JSON).write_text(json.dumps(old, indent=1))
    assert kinds.load_eagle(head, cfg)[1]["draft_vocab"] == 17
    _reaches_the_weights(_generate(model_dir, head), capsys)


def test_a_flipped_params_byte_is_refused_before_the_target_loads(toy, tmp_path, capsys,
                                                                  weights_guard):
    """``params.safetensors`` against ``params_sha256`` was checked when the head loaded,
    after the target; it is checked with head.json, before."""
    model_dir, cfg = toy
    head = _eagle(cfg, tmp_path / "h")
    f = head / exported.PARAMS
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10
    f.write_bytes(bytes(data))
    _refused(_generate(model_dir, head), capsys, 1, str(f), "is corrupt or truncated",
             "SHA-256")


def test_every_flipped_byte_of_head_json_is_refused_or_reads_the_same(tmp_path):
    """Each byte of a small head.json flipped in turn: ``read_meta`` refuses it in one line,
    or reads what the whole file holds (a flip in the name ``head_sha256`` itself leaves
    every other field as it was, read as a head from before the field)."""
    head = exported.export_head({"w": np.ones((2,), np.float32)}, tmp_path / "h",
                                {"kind": "eagle", "draft_vocab": 16, "vocab_ids": [3, 1, 2]})
    f = head / exported.HEAD_JSON
    raw = f.read_bytes()
    want = exported.read_meta(head, "eagle")
    digest = want.get("head_sha256")

    def rest(meta):
        return {k: v for k, v in meta.items() if v != digest}

    refused = 0
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        f.write_bytes(bytes(bad))
        try:
            got = exported.read_meta(head, "eagle")
        except exported.CheckpointError as e:
            assert "\n" not in str(e) and str(f.parent) in str(e), (i, str(e))
            refused += 1
            continue
        assert rest(got) == rest(want) and got != want, (i, bytes(bad))
    assert refused >= len(raw) - len("head_sha256"), refused


# ------------------------------------------------- 2. a converted head's weights are covered

def test_a_flipped_byte_in_a_converted_head_is_refused_naming_the_file(toy, tmp_path, capsys,
                                                                       weights_guard):
    model_dir, cfg = toy
    head, out = _eagle(cfg, tmp_path / "h", vocab_ids=None), tmp_path / "pub"
    code, _, err = _cli(["convert-head", head, out, "--to", "eagle", "--model", model_dir],
                        capsys)
    assert code == 0, err
    weights, side = out / "model.safetensors", out / "model.safetensors.sha256"
    published.load(out, cfg)
    _reaches_the_weights(_generate(model_dir, out), capsys)
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x10  # a weight's byte: the file still parses and fits
    weights.write_bytes(bytes(data))
    with pytest.raises(exported.CheckpointError) as e:
        published.load(out, cfg)
    toys.one_line(e, str(weights), "is corrupt or truncated", side.name)
    _refused(_generate(model_dir, out), capsys, 1, str(weights), "is corrupt or truncated",
             side.name)
    assert sorted(p.name for p in out.iterdir()) == sorted(published.SAVED_FILES)
    assert side.read_text() == f"{sha}  model.safetensors\n"  # as sha256sum -c reads it
    side.write_text("not a digest\n")
    _refused(_generate(model_dir, out), capsys, 1, str(side), "not a SHA-256 line")
    # without the sidecar (a head published elsewhere): no checksum, read as it is
    side.unlink()
    published.load(out, cfg)
    # a conversion from before the sidecar is overwritten, and gets one
    code, _, err = _cli(["convert-head", head, out, "--to", "eagle", "--model", model_dir],
                        capsys)
    assert code == 0, err
    assert side.is_file()
    published.load(out, cfg)


def test_published_save_writes_the_digest_and_reads_it_back(toy, tmp_path):
    """The library call writes the sidecar too (``train onpolicy --export-format``), for
    both layouts, and the same head writes the same bytes."""
    _, cfg = toy
    hp3, ids = eagle3.init_head(cfg, jax.random.key(2), 16), np.arange(16)[::-1]
    for i in range(2):
        published.save("eagle3", jax.tree.map(np.asarray, hp3), tmp_path / f"p{i}", cfg,
                       vocab_ids=ids, layers=eagle3.fused_layers(cfg.num_layers))
    assert "model.safetensors.sha256" in _files(tmp_path / "p0")
    assert _files(tmp_path / "p0") == _files(tmp_path / "p1")
    assert published.load(tmp_path / "p0", cfg).kind == "eagle3"


# ------------------------------------------------------------ 3. duplicate vocab_ids, early

def test_duplicate_vocab_ids_are_refused_before_the_target_loads(toy, tmp_path, capsys,
                                                                 weights_guard):
    model_dir, cfg = toy
    head = _eagle(cfg, tmp_path / "h", vocab_ids=np.arange(10), draft_vocab=8)
    meta = _meta(head)
    meta["vocab_ids"][7] = 3
    meta.pop("head_sha256", None)  # a head.json from before the field, or by hand
    (head / exported.HEAD_JSON).write_text(json.dumps(meta))
    _refused(_generate(model_dir, head), capsys, 1, str(head / exported.HEAD_JSON),
             "vocab_ids holds token id 3 twice (at 3 and 7)")
    _refused(["convert-head", head, tmp_path / "o", "--to", "eagle", "--model", model_dir],
             capsys, 1, "vocab_ids holds token id 3 twice")
    exported.write_meta(head, meta)  # as an export would write it: head.json's SHA-256 fits
    _refused(_generate(model_dir, head), capsys, 1, "vocab_ids holds token id 3 twice")
    meta["vocab_ids"][7] = "7"
    exported.write_meta(head, meta)
    _refused(_generate(model_dir, head), capsys, 1, "vocab_ids[7] is '7', not a token id")
    h3 = _eagle3(cfg, tmp_path / "h3", ids=np.array([5, 9, 5, 1]))  # the saver takes them
    _refused(_generate(model_dir, h3, "eagle3:2,2,3"), capsys, 1,
             "vocab_ids holds token id 5 twice (at 0 and 2)")


# ------------------------------------------- 4. a head in its backup is found by the check

EXPORT = """
import sys, jax
import toys
from specjax.drafters import eagle
from specjax.heads import exported
exported.export_head(eagle.init_head(toys.LLAMA, jax.random.key(5)), sys.argv[1], {"kind": "eagle"})
"""


def _env(point: str) -> dict:
    env = toys.toy_process_env({**os.environ})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env[_atomic.KILL_ENV] = point
    return env


def test_a_head_a_killed_export_left_in_its_backup_is_restored_before_the_check(
        toy, tmp_path, capsys, weights_guard):
    """A re-export killed between its renames (``SPECJAX_KILL_AT=old-moved``) leaves the
    old head in ``.h.old-PID`` and no ``h``: ``generate --draft-checkpoint h`` puts it back
    (one line naming it) and goes on, as loading it does; so do ``convert-head h`` and
    ``--draft-checkpoint`` of a conversion left so."""
    model_dir, cfg = toy
    head = _eagle(cfg, tmp_path / "h")
    before = _files(head)
    proc = subprocess.run([sys.executable, "-c", EXPORT, str(head)], cwd=ROOT,
                          env=_env("old-moved"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir())  # the old head and the unplaced new
    assert not head.exists() and [n[:7] for n in left] == [".h.old-", ".h.tmp-"], left
    err = _reaches_the_weights(_generate(model_dir, head), capsys)
    assert f"restored {head} from .h.old-" in err, err
    assert _files(head) == before and [p.name for p in tmp_path.iterdir()] == ["h"]
    # convert-head's HEAD_DIR, then a conversion, each left in its backup by a dead writer
    os.rename(head, _atomic.backup_path(head, DEAD))
    out = tmp_path / "pub"
    code, _, err = _cli(["convert-head", head, out, "--to", "eagle", "--model", model_dir],
                        capsys)
    assert code == 0 and f"restored {head}" in err, err
    os.rename(out, _atomic.backup_path(out, DEAD))
    err = _reaches_the_weights(_generate(model_dir, out), capsys)
    assert f"restored {out}" in err and published.is_published(out), err


# ------------------------------------------------------------ 5. and 6. convert-head's input

def test_convert_head_refuses_a_head_json_without_vocab_ids(toy, tmp_path, capsys,
                                                             weights_guard):
    """Every export writes ``vocab_ids`` (null where no vocabulary is ranked); a head.json
    without it is refused in one line naming the file, exit 1, nothing written: for
    ``--to eagle`` it was written, for ``--to eagle3`` refused as ``vocab_ids is None``."""
    model_dir, cfg = toy
    for kind, head in (("eagle", _eagle(cfg, tmp_path / "h1")),
                       ("eagle3", _eagle3(cfg, tmp_path / "h3"))):
        meta = _meta(head)
        del meta["vocab_ids"]
        meta.pop("head_sha256", None)  # by hand, or from before the field
        (head / exported.HEAD_JSON).write_text(json.dumps(meta))
        out = tmp_path / f"o-{kind}"
        for _ in range(2):
            _refused(["convert-head", head, out, "--to", kind, "--model", model_dir], capsys,
                     1, f"{head / exported.HEAD_JSON} has no vocab_ids", "export the head again")
            assert not out.exists()
            exported.write_meta(head, meta)  # the same, its head_sha256 right


def test_convert_head_to_eagle_says_the_layout_cannot_hold_the_vocabulary(toy, tmp_path,
                                                                          capsys):
    """A head ranking a vocabulary (``vocab_ids``; trained over its first 16, as the shipped
    SmolLM2 head over its first 8,192) converts, with one warning saying the EAGLE-1/2
    layout holds no draft vocabulary and that the converted head drafts over the whole
    target vocabulary; a head ranking none converts silently."""
    model_dir, cfg = toy
    rec = kinds.Record(model="toy", train={"draft_vocab": 16}, steps_done=1)
    ranked = _eagle(cfg, tmp_path / "ranked", record=rec)
    code, out, err = _cli(["convert-head", ranked, tmp_path / "o1", "--to", "eagle",
                           "--model", model_dir], capsys)
    assert code == 0 and len(err.splitlines()) == 1, err
    assert err.startswith("specjax: warning: the EAGLE-1/2 layout holds no draft vocabulary"), err
    assert "(32 token ids ranked by frequency, trained over the first 16) are not written" in err
    assert f"drafts over all {V} of the target's tokens" in err and "vocab=16" in err, err
    assert published.load(tmp_path / "o1", cfg).kind == "eagle"  # written all the same
    bare = _eagle(cfg, tmp_path / "bare", vocab_ids=None)
    code, _, err = _cli(["convert-head", bare, tmp_path / "o2", "--to", "eagle", "--model",
                         model_dir], capsys)
    assert code == 0 and err == "", err
