"""Outputs that replace earlier ones are swapped in whole (``specjax._atomic``): a process
killed (SIGKILL, at each injected point) during ``export_head``, ``convert-head`` or the
device check's publishing leaves the previous result intact or the new one complete, never
a mix, and the next write names and removes what it left. Exported heads carry the SHA-256
of their parameters; ``convert-head`` reads heads through the validating loader; the
device check and the compilation cache refuse unclear settings in one line (issue 62)."""

from __future__ import annotations

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
from specjax.drafters import eagle, eagle3
from specjax.heads import exported, kinds, published, shipped

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def _env(point: str | None) -> dict:
    env = toys.toy_process_env({**os.environ})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env.pop(_atomic.KILL_ENV, None)
    if point:
        env[_atomic.KILL_ENV] = point
    return env


def _killed(code: str, point: str, *args) -> subprocess.CompletedProcess:
    """``python -c code args`` with ``SPECJAX_KILL_AT=point``; it must die of SIGKILL."""
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                          env=_env(point), capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr[-2000:])
    return proc


def _siblings(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def _head(seed: int) -> dict:
    return jax.tree.map(np.asarray, eagle.init_head(toys.LLAMA, jax.random.key(seed)))


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ----------------------------------------------------------------------------- the helper

def test_replace_dir_swaps_whole_and_keeps_the_old_on_an_error(tmp_path):
    out = tmp_path / "o"
    with _atomic.replace_dir(out) as t:
        (t / "a").write_text("1")
    assert _files(out) == {"a": b"1"} and _siblings(tmp_path) == ["o"]
    with pytest.raises(RuntimeError):
        with _atomic.replace_dir(out) as t:
            (t / "b").write_text("2")
            raise RuntimeError("mid-write")
    assert _files(out) == {"a": b"1"} and _siblings(tmp_path) == ["o"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(_atomic.OutputError, match="afile is a file, not a directory"):
        with _atomic.replace_dir(tmp_path / "afile" / "o"):
            pass


def test_recover_restores_a_backup_and_removes_dead_temporaries(tmp_path, capsys):
    """A dead writer (pid 2**22 + 1: no such process) left its backup without ``out``: the
    old directory comes back; its temporary directory is removed; each said in a line."""
    out, dead = tmp_path / "o", 2 ** 22 + 1
    _atomic.backup_path(out, dead).mkdir()
    (_atomic.backup_path(out, dead) / "a").write_text("old")
    _atomic.temp_path(out, dead).mkdir()
    said = _atomic.recover(out)
    assert _files(out) == {"a": b"old"} and _siblings(tmp_path) == ["o"]
    assert len(said) == 2 and "restored" in said[0] and f".o.tmp-{dead}" in said[1]
    assert capsys.readouterr().err.count("specjax: ") == 2


# ----------------------------------------------------------------------------- export_head

EXPORT = """
import sys, jax, numpy as np
import toys
from specjax.drafters import eagle
from specjax.heads import exported
exported.export_head(eagle.init_head(toys.LLAMA, jax.random.key(5)), sys.argv[1], {"kind": "eagle"})
"""


@pytest.mark.parametrize("point", ["written", "old-moved", "new-placed"])
def test_a_killed_export_keeps_the_previous_head(tmp_path, point, capsys):
    out = tmp_path / "h"
    exported.export_head(_head(0), out, {"kind": "eagle"})
    before = _files(out)
    _killed(EXPORT, point, out)
    assert len(_siblings(tmp_path)) == 2  # the head (or its backup) and one leftover
    back, _ = exported.load_head(out, "eagle")  # a backup alone is restored on reading
    got = _files(out)
    if point == "new-placed":  # the new head was whole and in place
        assert got != before
        np.testing.assert_array_equal(np.asarray(back["fc"], np.float32),
                                      np.asarray(jax.numpy.asarray(_head(5)["fc"],
                                                                   "bfloat16"), np.float32))
    else:
        assert got == before
    exported.export_head(_head(7), out, {"kind": "eagle"})  # the next export cleans up
    assert _siblings(tmp_path) == ["h"]
    assert ".h." in capsys.readouterr().err  # the leftover was named


def test_a_flipped_byte_in_an_exported_head_is_refused_naming_the_file(tmp_path):
    out = exported.export_head(_head(0), tmp_path / "h", {"kind": "eagle"})
    meta = json.loads((out / exported.HEAD_JSON).read_text())
    assert meta[exported.SHA_KEY] == exported.file_sha256(out / exported.PARAMS)
    f = out / exported.PARAMS
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10  # a weight's byte: the file still parses
    f.write_bytes(bytes(data))
    with pytest.raises(exported.CheckpointError) as e:
        exported.load_head(out, "eagle")
    assert str(f) in str(e.value) and "SHA-256" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
    del meta[exported.SHA_KEY], meta[exported.HEAD_SHA_KEY]  # exported before the fields:
    (out / exported.HEAD_JSON).write_text(json.dumps(meta))  # loads unchecked
    assert exported.load_head(out, "eagle")[0]["fc"].shape == _head(0)["fc"].shape


def test_the_same_head_exports_the_same_bytes(tmp_path):
    """The safetensors header's metadata is written sorted: equal heads, equal files and
    equal ``params_sha256``."""
    a = exported.export_head(_head(3), tmp_path / "a", {"kind": "eagle"})
    b = exported.export_head(_head(3), tmp_path / "b", {"kind": "eagle"})
    assert _files(a) == _files(b)


def test_exported_and_converted_weights_are_readable_as_the_umask_allows(tmp_path):
    """safetensors creates its files 0600; an exported head's ``params.safetensors`` and a
    converted head's ``model.safetensors`` get the mode ``open(..., "w")`` gives (0666
    less the umask), as ``head.json`` and ``config.json`` have, so a head directory is
    readable by whoever may read the others."""
    old = os.umask(0o022)
    try:
        out = exported.export_head(_head(3), tmp_path / "a", {"kind": "eagle"})
        hp = jax.tree.map(lambda x: x + 0.01, eagle.init_head(toys.LLAMA, jax.random.key(5),
                                                               attn_norm=False))
        pub = published.save("eagle", hp, tmp_path / "p", toys.LLAMA)
    finally:
        os.umask(old)
    for f in (out / exported.PARAMS, out / exported.HEAD_JSON, pub / "model.safetensors",
              pub / "config.json"):
        assert f.stat().st_mode & 0o777 == 0o644, (f, oct(f.stat().st_mode))


@pytest.mark.parametrize("name", ["smollm2-135m-eagle", "gemma3-270m-eagle",
                                  "smollm2-135m-exits"])
def test_shipped_heads_record_the_sha256_of_their_parameters(name):
    d = shipped.shipped_dir(name)
    meta = json.loads(d.joinpath(exported.HEAD_JSON).read_text())
    assert meta[exported.SHA_KEY] == exported.file_sha256(Path(str(d.joinpath(exported.PARAMS))))


# ----------------------------------------------------------------------------- convert-head

@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A random 6-layer Llama as an HF directory, and two exported EAGLE-3 heads for it."""
    root = tmp_path_factory.mktemp("atomic")
    lm = toys.loaded_llama(root / "toy", layers=6)
    cfg = lm.model.config
    for name, seed in (("a", 1), ("b", 2)):
        hp = eagle3.init_head(cfg, jax.random.key(seed), 16)
        ids = np.random.default_rng(seed).permutation(cfg.vocab_size)[:16]
        kinds.save_eagle3(hp, root / name, vocab_ids=ids,
                          layers=eagle3.fused_layers(cfg.num_layers))
    return lm, root


def _convert(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip()


CONVERT = """
import sys
from specjax import cli
sys.exit(cli.main(["convert-head", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("point", ["written", "old-moved", "new-placed"])
def test_a_killed_conversion_leaves_the_old_or_the_new_directory(toy, tmp_path, point, capsys):
    lm, root = toy
    out = tmp_path / "pub"
    m = ["--to", "eagle3", "--model", str(root / "toy")]
    assert _convert(["convert-head", str(root / "a"), str(out), *m], capsys)[0] == 0
    old = _files(out)
    assert _convert(["convert-head", str(root / "b"), str(tmp_path / "ref"), *m], capsys)[0] == 0
    new = _files(tmp_path / "ref")
    _killed(CONVERT, point, root / "b", out, *m)
    _atomic.recover(out)  # what the next conversion (or this call) does first
    assert _files(out) == (new if point == "new-placed" else old)  # whole: never mixed
    published.load(out, lm.model.config)
    assert _convert(["convert-head", str(root / "b"), str(out), *m], capsys)[0] == 0
    assert _files(out) == new and _siblings(tmp_path) == ["pub", "ref"]


def _edited(root: Path, tmp: Path, name: str, edit) -> Path:
    d = tmp / name
    d.mkdir()
    (d / exported.PARAMS).write_bytes((root / "a" / exported.PARAMS).read_bytes())
    meta = json.loads((root / "a" / exported.HEAD_JSON).read_text())
    del meta[exported.HEAD_SHA_KEY]  # as a head.json from before the field, or by hand
    (d / exported.HEAD_JSON).write_text(json.dumps(edit(meta)))
    return d


def test_convert_head_reads_the_head_as_decoding_does(toy, tmp_path, capsys):
    """head.json with ``vocab_ids`` null, ``layers`` a string, no ``kind``, or a JSON list
    is refused in one line naming the field; nothing is written."""
    _, root = toy
    m = ["--to", "eagle3", "--model", str(root / "toy")]
    cases = [
        (lambda d: {**d, "vocab_ids": None}, 1, "vocab_ids is None, not a list of token ids"),
        (lambda d: {**d, "layers": "2,3,3"}, 1, "layers is '2,3,3', not a list of layer"),
        (lambda d: {k: v for k, v in d.items() if k != "kind"}, 2, "head.json names no kind"),
        (lambda d: [d], 2, "head.json holds a JSON list, not an object"),
    ]
    for i, (edit, want, msg) in enumerate(cases):
        head = _edited(root, tmp_path, f"h{i}", edit)
        code, err = _convert(["convert-head", str(head), str(tmp_path / f"o{i}"), *m], capsys)
        assert code == want and msg in err and len(err.splitlines()) == 1, (i, code, err)
        assert not (tmp_path / f"o{i}").exists()


def test_convert_head_out_dir_below_a_file_or_unwritable(toy, tmp_path, capsys):
    _, root = toy
    m = ["--to", "eagle3", "--model", str(root / "toy")]
    (tmp_path / "afile").write_text("x")
    code, err = _convert(["convert-head", str(root / "a"), str(tmp_path / "afile" / "o"), *m],
                         capsys)
    assert code == 2 and "afile is a file, not a directory" in err, err
    assert ".o.tmp" not in err and len(err.splitlines()) == 1
    if os.geteuid() == 0:  # root writes anywhere: the permission case cannot be made
        return
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        code, err = _convert(["convert-head", str(root / "a"), str(locked / "o"), *m], capsys)
    finally:
        locked.chmod(0o700)
    assert code == 2 and "locked is not writable" in err, err


# ----------------------------------------------------------- train --init H --export H

@pytest.mark.parametrize("command", [["train", "onpolicy", "--prompts", "{d}/p", "--shards",
                                      "{d}/s"], ["train", "eagle", "--data", "{d}/data"]],
                         ids=["onpolicy", "eagle"])
def test_export_equal_to_init_is_refused_before_anything_loads(tmp_path, command, capsys,
                                                               monkeypatch):
    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("specjax.models.load", load)
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    head = exported.export_head(_head(0), tmp_path / "H", {"kind": "eagle"})
    before = _files(head)
    argv = [a.replace("{d}", str(tmp_path)) for a in command] + [
        "--run", str(tmp_path / "run"), "--init", str(head),
        "--export", str(tmp_path / "x" / ".." / "H")]  # the same directory, spelled otherwise
    code, err = _convert(argv, capsys)
    assert code == 2 and "is the head --init" in err and len(err.splitlines()) == 1, err
    assert _files(head) == before


# ----------------------------------------------------------------------------- device check

PUBLISH = """
import sys
from pathlib import Path
import toys
toys.device_check().publish(Path(sys.argv[1]), Path(sys.argv[2]), "device_check_cpu")
"""


@pytest.mark.parametrize("point", ["old-moved", "half-placed", "new-placed"])
def test_a_killed_publish_leaves_the_previous_or_the_new_pair(tmp_path, point):
    out, staging = tmp_path / "out", tmp_path / "out" / ".device_check_cpu.tmp-1"
    staging.mkdir(parents=True)
    names = ["device_check_cpu.json", "device_check_cpu.png"]
    for n in names:
        (out / n).write_text(f"old {n}")
        (staging / n).write_text(f"new {n}")
    (out / "notes.md").write_text("not ours")
    _killed(PUBLISH, point, staging, out)
    _atomic.recover_files(out, "device_check_cpu")
    want = "new" if point == "new-placed" else "old"
    assert {n: (out / n).read_text() for n in names} == {n: f"{want} {n}" for n in names}
    assert (out / "notes.md").read_text() == "not ours"
    assert not [p for p in _siblings(out) if ".old-" in p or ".done-" in p]


DEVICE_CHECK = """
import sys
import toys
sys.exit(toys.device_check().main(sys.argv[1:]))
"""


def test_a_device_check_killed_mid_run_keeps_the_previous_results(tmp_path, capsys):
    """Killed after its first measurement: the previous JSON and plot are as they were; the
    next run names and removes the staging directory and replaces both."""
    dc = toys.device_check()
    argv = ["--small", "--budget", "0.3", "--law-rows", "0", "--no-hf", "--shapes",
            "tiny-llama", "--out", str(tmp_path)]
    for n in ("device_check_cpu.json", "device_check_cpu.png"):
        (tmp_path / n).write_text("previous")
    _killed(DEVICE_CHECK, "device-check-saved", *argv)
    assert (tmp_path / "device_check_cpu.json").read_text() == "previous"
    assert (tmp_path / "device_check_cpu.png").read_text() == "previous"
    staged = [p for p in _siblings(tmp_path) if p.startswith(".device_check_cpu.tmp-")]
    assert len(staged) == 1
    assert dc.main(argv) == 0
    assert f"removed {tmp_path / staged[0]}" in capsys.readouterr().err
    rep = json.loads((tmp_path / "device_check_cpu.json").read_text())
    assert rep["small"] is True and rep["complete"] is False
    assert _siblings(tmp_path) == ["device_check_cpu.json", "device_check_cpu.png"]


@pytest.mark.parametrize("argv,msg", [
    (["--budget", "-5"], "--budget must be a positive number of seconds, got -5.0"),
    (["--batch", "0"], "--batch must be >= 1 (1 skips the batched phase), got 0"),
    (["--prompts", "0"], "--prompts must be >= 1, got 0"),
    (["--widths", "1,x"], "--widths must be comma-separated positive ints"),
    (["--out", "{d}/afile"], "--out {d}/afile is a file; give a directory path"),
    (["--methods", "bogus"], "--methods bogus: unknown method 'bogus'"),
    (["--methods", "ar,eagle3:3,4,7"], "--methods names eagle3:3,4,7, which no shape run here"
                                       " (tiny-llama) lists"),
], ids=["budget", "batch", "prompts", "widths", "out-file", "unknown", "unlisted"])
def test_device_check_settings_are_refused_in_one_line_before_any_weight(tmp_path, argv, msg,
                                                                         capsys, monkeypatch):
    dc = toys.device_check()
    monkeypatch.setattr(dc, "random_model", lambda *a, **k: pytest.fail("weights were made"))
    (tmp_path / "afile").write_text("x")
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as e:
        dc.main(["--small", "--shapes", "tiny-llama", "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and msg.replace("{d}", str(tmp_path)) in err[-1], err
    assert not (tmp_path / "o").exists()


def test_a_method_some_shapes_do_not_list_is_skipped_and_incomplete():
    """``--methods`` naming a method that one chosen shape lists and another does not: the
    other records it as skipped, and the run is not complete."""
    dc = toys.device_check()
    opts = dc.settings(small=True, methods="ar,eagle3:2,2,3")
    shape = {"methods": "ar,sd-ngram:7"}
    assert dc.not_listed(shape, opts) == ["eagle3:2,2,3"]
    res = {"phases": [], "shapes": {"s": {"not_listed": ["eagle3:2,2,3"]}}}
    skipped, failed = dc.incomplete(res, 8)
    assert skipped == ["s: eagle3:2,2,3 (named by --methods, not listed for this shape)"]
    assert failed == []


# ----------------------------------------------------------------- compilation cache

CACHE = "import specjax._cache as c; c.configure(); print(c.enabled(), c.directory())"


def _cache(tmp_path: Path, switch: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in _env(None).items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "SPECJAX_CACHE")}
    env.update(SPECJAX_COMPILATION_CACHE=switch, SPECJAX_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-c", CACHE], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("switch", ["disable", "DISABLED", "none", "off"])
def test_a_cache_switched_off_by_a_word_creates_no_directory(tmp_path, switch):
    proc = _cache(tmp_path, switch)
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "None"], proc.stderr
    assert _siblings(tmp_path) == []  # no ./disable/ (nor the default directory)


def test_a_cache_pointed_at_a_file_is_off_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    for target in ("afile", "afile/sub"):
        proc = _cache(tmp_path, str(tmp_path / target))
        assert proc.returncode == 0 and proc.stdout.split() == ["False", "None"]
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("specjax: warning: compilation cache off: "
                               f"SPECJAX_COMPILATION_CACHE={tmp_path / target}: ")
        assert f"{tmp_path / 'afile'} is a file, not a directory" in line


def test_an_unwritable_cache_directory_is_named(tmp_path, monkeypatch):
    from specjax import _cache

    assert _cache.unusable(tmp_path / "new" / "jax") is None  # JAX creates it
    monkeypatch.setattr(_cache.os, "access", lambda *a: False)  # root writes anywhere
    assert _cache.unusable(tmp_path / "new" / "jax") == f"{tmp_path} is not writable"
