"""Training options are declared once: every setting of ``train eagle``, ``redrafter``,
``exit-heads``, ``onpolicy`` and ``dflash`` is a field of its config dataclass
(``specjax.train.glue.option``), the command's flags are made from those fields
(``common.config_flags``), and the config's ``__post_init__`` refuses a value out of range
in the flag's words, so the CLI (exit 2, before the model loads) and the Python API refuse
the same values with the same message."""

from __future__ import annotations

import dataclasses

import pytest

from specjax import cli
from specjax.train import dflash, glue, onpolicy, ttt
from specjax.train import eagle as train_eagle
from specjax.train import exit_heads as train_exits
from specjax.train import redrafter as train_rd

BASE = {"eagle": ["--data", "d", "--run", "r"], "redrafter": ["--data", "d", "--run", "r"],
        "exit-heads": ["--data", "d", "--run", "r"],
        "onpolicy": ["--prompts", "p", "--shards", "s", "--run", "r"],
        "dflash": ["--shards", "s", "--run", "r"]}
CONFIGS = {"eagle": [train_eagle.TrainConfig], "redrafter": [train_rd.TrainConfig],
           "exit-heads": [train_exits.ExitConfig],
           "onpolicy": [onpolicy.OnPolicyConfig, ttt.LossConfig],
           "dflash": [dflash.DFlashConfig]}
# the CLI's own defaults, where they are not the Python API's
CLI_DEFAULTS = {("eagle", "save_every"): 100,
                ("eagle", "attn_norm"): None, ("onpolicy", "attn_norm"): None}
# what `glue.from_args` does not read from a flag: the command gives it
GIVEN = {onpolicy.OnPolicyConfig: {"data_file", "loss"}}


def _parser(command):
    sub = next(a for a in cli.build_parser()._actions if a.dest == "cmd").choices["train"]
    return next(a for a in sub._actions if a.dest == "head").choices[command]


def _flags(command) -> dict:
    """The ``train COMMAND`` parser's options, by flag."""
    return {s: a for a in _parser(command)._actions for s in a.option_strings}


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_each_settings_flag_is_made_from_its_config_field(command):
    flags = _flags(command)
    for cls in CONFIGS[command]:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} is not a glue.option"
            if f.name in GIVEN.get(cls, ()):
                assert not f.metadata["cli"] and glue.flag_of(f) not in flags
                continue
            a = flags[glue.flag_of(f)]
            assert a.dest == glue.dest_of(f), (cls.__name__, f.name)
            assert a.help.startswith(f.metadata["help"].replace("%", "%%")), (f.name, a.help)
            want = CLI_DEFAULTS.get((command, f.name), f.default)
            if isinstance(want, tuple):
                want = ",".join(map(str, want))
            if f.metadata.get("parse") is not None and isinstance(f.default, bool):
                want = f.metadata["argparse"]["default"]  # an inverted switch
            assert a.default == want, (command, f.name, a.default, want)


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_the_flags_at_their_defaults_give_the_configs_defaults(command):
    args = cli.build_parser().parse_args(["train", command, *BASE[command]])
    if hasattr(args, "attn_norm"):
        args.attn_norm = True  # what the command resolves it to without --init
    for cls in CONFIGS[command]:
        got = glue.from_args(cls, args)
        over = {n: v for (c, n), v in CLI_DEFAULTS.items() if c == command
                and n != "attn_norm" and n in {f.name for f in dataclasses.fields(cls)}}
        assert got == cls(**over), (cls.__name__, got)


REFUSED = [  # command, extra argv, config, its keywords, the message both give
    ("onpolicy", ["--draft-vocab", "-5"], onpolicy.OnPolicyConfig, {"draft_vocab": -5},
     "--draft-vocab must be >= 1, got -5"),
    ("onpolicy", ["--epochs", "-1"], onpolicy.OnPolicyConfig, {"epochs": -1},
     "--epochs must be >= 0, got -1"),
    ("onpolicy", ["--ttt", "0"], ttt.LossConfig, {"k": 0}, "--ttt must be >= 1, got 0"),
    ("onpolicy", ["--w-ce", "-1"], ttt.LossConfig, {"w_ce": -1.0},
     "--w-ce must be >= 0, got -1.0"),
    ("eagle", ["--ce-vocab", "-1"], train_eagle.TrainConfig, {"ce_vocab": -1},
     "--ce-vocab must be >= 0, got -1"),
    ("eagle", ["--warmup", "-3"], train_eagle.TrainConfig, {"warmup": -3},
     "--warmup must be >= 0, got -3"),
    ("eagle", ["--lr", "0"], train_eagle.TrainConfig, {"lr": 0.0}, "--lr must be > 0, got 0.0"),
    ("redrafter", ["--unroll", "0"], train_rd.TrainConfig, {"unroll": 0},
     "--unroll must be >= 1, got 0"),
    ("redrafter", ["--blocks", "-1"], train_rd.TrainConfig, {"blocks": -1},
     "--blocks must be >= 0, got -1"),
    ("exit-heads", ["--kl-vocab", "-1"], train_exits.ExitConfig, {"kl_vocab": -1},
     "--kl-vocab must be >= 0, got -1"),
    ("exit-heads", ["--weight-decay", "-0.5"], train_exits.ExitConfig,
     {"weight_decay": -0.5}, "--weight-decay must be >= 0, got -0.5"),
    ("dflash", ["--block-size", "1"], dflash.DFlashConfig, {"block_size": 1},
     "--block-size must be >= 2, got 1"),
    ("dflash", ["--gamma", "0"], dflash.DFlashConfig, {"gamma": 0.0},
     "--gamma must be > 0, got 0.0"),
    ("dflash", ["--target-layers", "1,-2"], dflash.DFlashConfig, {"target_layers": (1, -2)},
     "--target-layers must be comma-separated layer ids >= 0, got '1,-2'"),
]


@pytest.mark.parametrize("command,argv,cls,kw,msg", REFUSED,
                         ids=[f"{c[0]} {c[1][0]}" for c in REFUSED])
def test_the_cli_and_the_python_api_refuse_the_same_value_alike(command, argv, cls, kw, msg,
                                                                 no_model, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.delenv("SPECJAX_DEBUG", raising=False)
    with pytest.raises(ValueError) as e:
        cls(**kw)
    assert str(e.value) == msg
    base = [a if a in ("--data", "--run", "--prompts", "--shards") else str(tmp_path / a)
            for a in BASE[command]]
    code = cli.main(["train", command, *base, *(["--init", "none"] if command == "onpolicy"
                                                else []), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"specjax: error: {msg}", err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_shared_setting_is_declared_once():
    """``lr`` (and the other shared settings) carry the same help and range in every
    config, their defaults each trainer's own."""
    for name in ("lr", "warmup", "batch_tokens", "seed", "weight_decay", "clip"):
        metas = {(f.metadata["help"], f.metadata["low"], f.metadata["above"])
                 for cls in (train_eagle.TrainConfig, train_rd.TrainConfig,
                             onpolicy.OnPolicyConfig, train_exits.ExitConfig,
                             dflash.DFlashConfig)
                 for f in dataclasses.fields(cls) if f.name == name}
        assert len(metas) == 1, (name, metas)
