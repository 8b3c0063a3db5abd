"""The main job's recorded choice: the fastest candidate that reproduced ``ar`` wins, a lossy
one never does, and a record for another candidate list is ignored."""

import pytest

from specjax import demo


def _run(tps, lossless=True):
    return {"tokens_per_s": tps, "lossless": lossless, "tau": 2.0, "ar_tokens_per_s": 10.0}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    return tmp_path


def test_fastest_lossless_candidate_is_recorded_and_read_back():
    cands = demo.CANDIDATES
    assert demo.read_choice("smollm2-135m", cands) is None
    results = {c.format(): _run(10.0 + i) for i, c in enumerate(cands)}
    results[cands[-1].format()] = _run(99.0, lossless=False)  # fastest, but not equal to ar
    best = demo.write_choice("smollm2-135m", results, cands)
    assert best == cands[-2]
    assert demo.read_choice("smollm2-135m", cands) == cands[-2]
    assert demo.cache_file("smollm2-135m").name.startswith("demo_smollm2-135m_cpu")


def test_a_record_for_other_candidates_is_ignored():
    cands = demo.CANDIDATES
    demo.write_choice("smollm2-135m", {c.format(): _run(1.0) for c in cands}, cands)
    assert demo.read_choice("smollm2-135m", cands[:2]) is None


def test_no_lossless_candidate_is_an_error():
    with pytest.raises(RuntimeError, match="reproduced ar"):
        demo.write_choice("smollm2-135m", {"x": _run(5.0, lossless=False)})


def test_candidate_names_are_bench_method_names():
    from specjax import methods

    names = [c.format() for c in demo.CANDIDATES]
    assert methods.split(",".join(names)) == names
    assert [methods.parse(n) for n in names] == list(demo.CANDIDATES)
    assert [c.format() for c in demo.available("smollm2-135m")] == [
        n for n in names if not n.startswith("redrafter")]  # no ReDrafter head ships
