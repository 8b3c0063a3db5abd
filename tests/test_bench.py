"""The benchmark harness: question selection, summaries, and a tiny end-to-end run."""

import json

import numpy as np
import pytest

from specjax import bench
from specjax.drafters import NGramDrafter


def test_builtin_prompts_cover_all_categories():
    qs = bench.load_questions()
    assert {q.category for q in qs} == set(bench.CATEGORIES)


def test_spec_bench_format_grouping_and_round_robin(tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", "second turn"]}
            for i, c in enumerate(["writing", "coding", "translation", "translation", "rag",
                                   "rag", "rag"])]
    f = tmp_path / "question.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    qs = bench.load_questions(f, limit=4)
    assert [q.category for q in qs] == ["mt_bench", "translation", "rag", "mt_bench"]
    assert qs[0].text == "q0"
    assert [q.qid for q in bench.load_questions(f, categories=["rag"])] == [4, 5, 6]
    with pytest.raises(ValueError, match="no questions in categories"):
        bench.load_questions(f, categories=["math_reasoning"])


def test_summary_ratios():
    q1, q2 = bench.Question(1, "qa", "a"), bench.Question(2, "rag", "b")
    res = {"ar": [(q1, bench.Run([1] * 10, 1.0, 10)), (q2, bench.Run([1] * 10, 2.0, 10))],
           "x": [(q1, bench.Run([1] * 10, 0.5, 4)), (q2, bench.Run([1] * 10, 0.5, 5))]}
    s = bench.summarize(res)
    assert s["ar"]["tokens_per_s"] == pytest.approx(20 / 3) and s["ar"]["tau"] == 1.0
    assert s["x"]["speedup_vs_ar"] == pytest.approx(20 / 1.0 / (20 / 3))
    assert s["x"]["per_category"]["rag"]["speedup_vs_ar"] == pytest.approx(4.0)
    assert s["x"]["tau"] == pytest.approx(20 / 9)


def test_copy_bandwidth_is_positive():
    assert bench.copy_bandwidth(nbytes=8 << 20, repeats=2) > 1e8


def test_cli_bench_end_to_end(monkeypatch, tmp_path, capsys):
    """The CLI's whole bench path (questions, tokenizing, every method kind, the hf peers on
    the same weights, the report) on a 4-layer toy saved as an HF directory."""
    import toys
    from specjax import cli

    toy = toys.loaded_llama(tmp_path / "toy")
    monkeypatch.setattr("specjax.models.load", lambda *a, **k: toy)
    out = tmp_path / "bench.json"
    methods = ["ar", "hf", "hf-pld", "sd-ngram"]
    assert cli.main(["bench", "--methods", ",".join(methods), "--limit", "2",
                     "--max-new-tokens", "8", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    for m in methods:
        s = rep["methods"][m]
        assert s["tokens_per_s"] > 0 and s["n"] == 2 and set(s["per_category"]) <= set(bench.CATEGORIES)
        assert 1.0 <= s["tau"] <= 8 + 1
    assert rep["methods"]["ar"]["speedup_vs_ar"] == 1.0 and rep["methods"]["ar"]["tau"] == 1.0
    acc = rep["methods"]["sd-ngram"]["acceptance_by_position"]
    assert len(acc) == NGramDrafter().depth and all(0 <= a <= 1 for a in acc)
    assert acc == sorted(acc, reverse=True)  # reaching position i+1 implies reaching i
    assert rep["greedy_mismatch_vs_ar"] == []
    assert 0 < rep["bandwidth"]["ar_fraction_of_bound"]
    assert "method" in capsys.readouterr().out


def test_method_list_keeps_eagle_sizes_and_options_together():
    from specjax.methods import split as split_methods

    got = split_methods("ar, eagle2:4,4,8:conf,vocab=4096,hf,hf-pld,sd-early-exit:12,eagle2")
    assert got == ["ar", "eagle2:4,4,8:conf,vocab=4096", "hf", "hf-pld", "sd-early-exit:12",
                   "eagle2"]


def _save_random_llama(path, eos: int | None = None, seed: int = 0):
    """A random 2-layer transformers Llama saved as safetensors + config.json, without
    tokenizer files (as random-weight directories of real shapes are); ``eos`` goes into
    its config and generation config."""
    import torch
    import transformers

    torch.set_num_threads(2)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2 if eos is None else eos)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharp logits: no near-ties between float32 implementations
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.save_pretrained(str(path))
    return path


def test_hf_peer_without_eos_ids_generates_the_whole_budget(tmp_path):
    """A model without EOS ids (an HF directory without tokenizer files): the hf peer runs to
    max_new_tokens, although the directory's generation config names an EOS id that the
    model emits early, and its greedy tokens are specjax ar's."""
    from specjax.models import load

    n, prompt = 12, [5, 9, 17, 33, 4, 60, 7]
    lm = load(str(_save_random_llama(tmp_path / "probe")), tokenizer=False)
    assert lm.tokenizer is None and lm.eos_ids == ()
    ar = bench.ar_method(lm)(prompt, n).tokens
    early = ar[2]  # an id greedy decoding emits third: a config EOS stops HF there
    assert early not in ar[:2]
    lm = load(str(_save_random_llama(tmp_path / "m", eos=early)), tokenizer=False)
    assert lm.eos_ids == ()
    hf = bench.load_hf(lm)
    assert hf.generation_config.eos_token_id == early  # the trap the peer must avoid
    run = bench.hf_method(lm, threads=2, hf=hf)(prompt, n)
    assert len(run.tokens) == n and run.target_forwards == n
    assert run.tokens == ar
    pld = bench.hf_pld_method(lm, threads=2, hf=hf)(prompt, n)
    assert pld.tokens == ar


def test_device_copy_bandwidth_runs_on_the_device():
    """The accelerator probe (a jitted on-device copy loop) gives a CPU number here."""
    assert bench.device_copy_bandwidth(nbytes=8 << 20, repeats=2, steps=2) > 1e8


@pytest.mark.parametrize("platform,kind,probe,tag", [
    ("cpu", "cpu", "host", "cpu"),
    ("gpu", "NVIDIA H100 80GB HBM3", "device", "h100"),
    ("gpu", "NVIDIA H200", "device", "h200"),
    ("tpu", "TPU v5 lite", "device", "v5_lite")])
def test_bandwidth_probe_measures_the_device_that_decodes(monkeypatch, platform, kind, probe,
                                                          tag):
    """On an accelerator the bound is the device's own memory, never host copies; the report
    names the device and the probe."""
    info = {"platform": platform, "device_kind": kind, "count": 1, "backend": platform}
    called = []
    monkeypatch.setattr(bench, "device_info", lambda: info)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda *a, **k: called.append("host") or 20e9)
    monkeypatch.setattr(bench, "device_copy_bandwidth",
                        lambda *a, **k: called.append("device") or 3000e9)
    p = bench.bandwidth_probe()
    assert called == [probe] and p["method"].startswith(probe) and p["device"] == info
    assert p["GBps"] == (20.0 if probe == "host" else 3000.0)
    assert bench.device_tag(info) == tag
    params = {"w": np.zeros((1000, 1000), np.float32)}  # 4 MB per token
    b = bench.bandwidth_bound(params, 100.0, p)
    assert b["weight_bytes"] == 4_000_000 and b["device"] == info
    assert b["bound_tokens_per_s"] == pytest.approx(p["GBps"] * 1e9 / 4e6)
    assert b["ar_fraction_of_bound"] == pytest.approx(100.0 / b["bound_tokens_per_s"])


def test_bandwidth_probe_on_this_cpu_is_the_host_copy():
    p = bench.bandwidth_probe(nbytes=8 << 20, repeats=2)
    assert p["device"]["platform"] == "cpu" and p["method"].startswith("host")
    assert p["GBps"] > 0.1
