"""The method registry: every text form parses to a typed spec and formats back, bad specs
fail in one line naming the forms, and every method built through the registry is its old
entry point: ``ar`` and HSD decode token for token as ``generate`` and ``hsd_generate``,
and the speculative methods build the very decoder and parameters ``speculative_generate``
builds from the drafter made by hand."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import toys
import specjax
from specjax import methods
from specjax.core.speculative import Speculative
from specjax.drafters import EarlyExitDrafter, NGramDrafter, eagle, redrafter
from specjax.heads import exported
from specjax.hsd import Exit, Hierarchy, HierarchySpec, NGram, hsd_generate
from specjax.models import Llama
from specjax.models.llama import init_params

CFG = toys.LLAMA
PROMPTS = [[1, 5, 2, 7, 5, 9, 1, 5, 2], [3, 3, 1, 4]]
NEW = 12

FORMS = ["ar", "sd-ngram", "sd-ngram:7", "sd-early-exit:2", "eagle2", "eagle2:3,4,7",
         "eagle2::conf,norerank", "eagle2:3,4,7:vocab=32", "eagle2::fullvocab", "redrafter",
         "redrafter:2,3", "redrafter::nodedup", "hsd", "hsd:ngram:4,2:3,target",
         "hsd:ngram:4,2@0.5:3,target+h2", "hf", "hf-pld"]


@dataclasses.dataclass
class LM:
    """What ``methods.build`` reads of a loaded model."""

    model: Llama
    params: dict
    mesh: None = None
    eos_ids: tuple = ()


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    model = Llama(CFG)
    params = jax.tree.map(lambda x: x * 3.0, init_params(CFG, jax.random.key(1)))
    heads = tmp_path_factory.mktemp("heads")
    exported.export_head(eagle.init_head(CFG, jax.random.key(2)), heads / "eagle",
                         {"kind": "eagle", "model": "toy", "draft_vocab": 0},
                         dtype=np.float32)
    rd = redrafter.init_head(CFG.hidden_size, CFG.vocab_size, jax.random.key(3))
    exported.export_head(redrafter.exportable(rd), heads / "redrafter",
                         {"kind": "redrafter", "model": "toy", "hidden_size": CFG.hidden_size,
                          "blocks": 2, "draft_vocab": CFG.vocab_size, "vocab_ids": None},
                         dtype=np.float32)
    return LM(model, params), heads


def test_every_form_parses_and_formats_back():
    for text in FORMS:
        spec = methods.parse(text)
        assert methods.parse(spec.format()) == spec, text
    assert methods.parse("eagle2:3,4,7").drafter_kwargs() == {
        "by_value": True, "rerank": True, "depth": 3, "topk": 4, "total_tokens": 7}
    assert methods.parse("hsd:ngram:4,2@0.5:3,target+h2").hierarchy == HierarchySpec.parse(
        "ngram:4,2@0.5:3,target+h2")
    assert methods.split(",".join(FORMS)) == FORMS


@pytest.mark.parametrize("text,msg", [
    ("foo", "unknown method 'foo'"), ("sd-ngram:x", "sd-ngram[:depth]"),
    ("sd-early-exit", "sd-early-exit:L"), ("eagle2:3,4", "depth,topk,total"),
    ("eagle2::wide", "unknown EAGLE option"), ("redrafter:0,3", "each >= 1"),
    ("hsd:ngram:4", "bad hierarchy"), ("hsd:ngram:4,x:2,target", "bad level"),
    ("ar:7", "takes no options")])
def test_bad_specs_are_one_clear_error(text, msg):
    with pytest.raises(methods.SpecError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        methods.parse(text)


def _same(built, old):
    new = built(PROMPTS, max_new_tokens=NEW)
    assert isinstance(built.decoder, specjax.Decoder)
    assert new.to_lists() == old.to_lists()
    np.testing.assert_array_equal(new.target_forwards, old.target_forwards)
    return new


def test_registry_equals_the_old_entry_points(toy):
    lm, heads = toy
    opts = methods.Options(model_name="toy", layers=(1, 2, 3),
                           draft_checkpoint=str(heads / "eagle"),
                           redrafter_checkpoint=str(heads / "redrafter"))
    ar = specjax.generate(lm.model, lm.params, PROMPTS, max_new_tokens=NEW)
    _same(methods.build("ar", lm, opts), ar)
    old = {"sd-ngram:5": (NGramDrafter(depth=5), None),
           "sd-early-exit:2": (EarlyExitDrafter(lm.model, 2), None),
           "eagle2:3,2,5": methods.load_drafter("eagle2:3,2,5", lm, "toy", heads / "eagle"),
           "redrafter:2,3": methods.load_drafter("redrafter:2,3", lm, "toy",
                                                 heads / "redrafter")}
    for text, (drafter, dp) in old.items():
        # the decoder speculative_generate builds, and the same parameters: the same pure
        # function of the same inputs (each decodes as ar: tests/test_conformance.py)
        built = methods.build(text, lm, opts)
        assert built.decoder == Speculative(lm.model, drafter), text
        want, got = jax.tree.leaves((lm.params, dp)), jax.tree.leaves(built.params)
        assert len(got) == len(want) and all(
            np.array_equal(a, b) for a, b in zip(got, want)), text
    h = Hierarchy((NGram(), Exit(2), Exit()), (4, 3))
    ref = hsd_generate(lm.model, lm.params, h, PROMPTS, max_new_tokens=NEW)
    built = methods.build("hsd:ngram:4,2:3,target", lm, opts)
    assert built.decoder.hierarchy.levels[:2] == (NGram(), Exit(2, built.decoder.hierarchy
                                                                 .levels[1].head))
    assert _same(built, ref).forwards[-1] < len(PROMPTS) * NEW, "nothing accepted: vacuous"


def test_build_refuses_what_it_cannot_run(toy, tmp_path):
    lm, heads = toy
    with pytest.raises(methods.SpecError, match="peer for benchmarks"):
        methods.build("hf", lm)
    with pytest.raises(methods.SpecError, match="exit layers"):
        methods.build("hsd:5:2,target", lm, methods.Options(layers=(1, 2)))
    with pytest.raises(methods.SpecError, match="needs a calibration"):
        methods.build("hsd", lm)
    with pytest.raises(FileNotFoundError, match="no EAGLE head ships for 'toy'"):
        methods.build("eagle2", lm, methods.Options(model_name="toy"))
    (tmp_path / "c.json").write_text('{"model": "toy",\n x')
    with pytest.raises(methods.SpecError, match="c.json is not a calibration JSON"):
        methods.build("hsd", lm, methods.Options(calibration=str(tmp_path / "c.json")))
