"""A method is one class: a spec class defined here and registered with
``methods.register`` runs through ``specjax bench``, ``specjax generate`` and the device
check's per-method path with no other file touched, its greedy output equal to ``ar``'s;
unregistered, the registry is as before."""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

import pytest

import toys

from specjax import methods


@dataclasses.dataclass(frozen=True)
class Chain(methods.Method):
    """``sd-chain:N``: prompt lookup proposing a chain of ``N`` tokens per round."""

    depth: int = 3

    kind: ClassVar[str] = "sd-chain"
    prefixes: ClassVar[tuple[str, ...]] = ("sd-chain",)
    forms: ClassVar[tuple[str, ...]] = ("sd-chain:N",)
    usage: ClassVar[str] = "sd-chain:N (an n-gram chain of N tokens)"
    example: ClassVar[str | None] = "sd-chain:3"

    @classmethod
    def parse(cls, text: str) -> Chain:
        _, _, n = text.partition(":")
        if not n.isdigit() or int(n) < 1:
            raise methods.SpecError(f"bad method {text!r}: use sd-chain:N (N >= 1)")
        return cls(int(n))

    def format(self) -> str:
        return f"sd-chain:{self.depth}"

    def build(self, lm, options: methods.Options) -> methods.Built:
        from specjax.drafters import NGramDrafter

        return methods.speculative(self, lm, options, NGramDrafter(depth=self.depth), None)


@pytest.fixture
def chain():
    """``Chain`` registered for one test, then removed."""
    before = methods.registered()
    methods.register(Chain)
    yield Chain
    methods.unregister(Chain)
    assert methods.registered() == before


def test_registered_class_parses_splits_and_lists(chain):
    assert methods.parse("sd-chain:4") == Chain(4)  # the longest prefix wins over sd-
    assert methods.parse("sd-ngram:4") == methods.SD("ngram", 4)
    assert methods.split("ar,sd-chain:2,hf") == ["ar", "sd-chain:2", "hf"]
    assert methods.FORMS[-1] == "sd-chain:N"
    with pytest.raises(methods.SpecError, match="use sd-chain:N"):
        methods.parse("sd-chain:0")
    with pytest.raises(ValueError, match="'sd-chain' is Chain's"):
        methods.register(type("Other", (Chain,), {}))


def test_unregistered_registry_is_the_builtins():
    assert methods.registered() == methods.BUILTINS
    assert {"ar", "sd", "eagle2", "eagle3", "redrafter", "hsd", "peer"} <= {
        c.kind for c in methods.BUILTINS}
    with pytest.raises(methods.SpecError, match="use sd-ngram"):  # SD's sd- prefix again
        methods.parse("sd-chain:3")
    assert "sd-chain:N" not in methods.FORMS


def test_bench_and_generate_run_it_equal_to_ar(chain, monkeypatch, tmp_path, capsys):
    import toys

    from specjax import cli

    toy = toys.loaded_llama(tmp_path / "toy")
    monkeypatch.setattr("specjax.models.load", lambda *a, **k: toy)
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--methods", "ar,sd-chain:3", "--limit", "2",
                     "--max-new-tokens", "8", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["greedy_mismatch_vs_ar"] == [] and rep["methods"]["sd-chain:3"]["n"] == 2
    capsys.readouterr()
    runs = {}
    for m in ("ar", "sd-chain:3"):
        assert cli.main(["generate", "--prompt-ids", "5,9,17,5,9,17,5,9", "--method", m,
                         "--max-new-tokens", "10", "--json"]) == 0
        runs[m] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert runs["sd-chain:3"]["spec"] == "sd-chain:3"
    assert runs["sd-chain:3"]["token_ids"] == runs["ar"]["token_ids"]


def test_cli_help_lists_it(chain, capsys):
    from specjax import cli

    with pytest.raises(SystemExit):
        cli.main(["bench", "-h"])
    # argparse may wrap the help after a hyphen: "sd-" ending one line, "chain:N" the next
    assert "sd-chain:N" in " ".join(capsys.readouterr().out.split()).replace("- ", "-")


def test_device_check_runs_it_equal_to_ar(chain):
    from specjax import bench

    device_check = toys.device_check()
    shape = device_check._shapes(True)["tiny-llama"]
    lm = device_check.random_model("tiny-llama", shape, scale=3.0)
    settings, layers = device_check.method_settings(lm, 8), device_check.exit_layer(shape)
    questions = bench.random_questions(2, 12, shape["cfg"].vocab_size)
    out: dict = {}
    device_check.run_methods(lm, questions, settings, layers, ["ar", "sd-chain:3"],
                             device_check.Budget(300.0), out, {}, lambda: None)
    assert "error" not in out["sd-chain:3"], out["sd-chain:3"]
    assert out["sd-chain:3"]["equal_to_ar"] and out["sd-chain:3"]["spec"] == "sd-chain:3"


def test_the_readme_method_table_is_the_registry():
    """README.md's method table and the registry name the same methods: every row's spec
    form is a registered method's, and every registered class has a row."""
    import re
    from pathlib import Path

    from specjax.methods import registry

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = text[text.index("| method | spec form |"):].split("\n\n")[0]
    forms = [f for row in table.splitlines()[2:] for f in re.findall(r"`([^`]+)`",
                                                                     row.split("|")[2])]
    names = [re.split(r"[\[:]", f)[0] for f in forms]
    classes = {registry._class_of(n) for n in names}
    assert None not in classes, [n for n in names if registry._class_of(n) is None]
    assert classes == set(methods.registered()), set(methods.registered()) - classes


def test_the_method_lists_in_the_docs_name_every_registered_method():
    """The two hand-written method lists (``specjax.methods``' docstring, ``docs/cli.md``'s
    bench section) name every registered form (cli.md once lacked ``redrafter``)."""
    import re
    from pathlib import Path

    import specjax.methods as pkg

    cli_md = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    lists = {"specjax.methods": pkg.__doc__.split("Text forms")[1].split("Where dispatch")[0],
             "docs/cli.md": cli_md[cli_md.index("Methods: "):].split("Every greedy")[0]}
    names = [re.split(r"[\[:]", f)[0] for f in methods.FORMS]
    for where, text in lists.items():
        missing = [n for n in names if not re.search(rf"`{re.escape(n)}[`\[:]", text)]
        assert not missing, (where, missing)
