"""The model contract: both families implement it, and nothing outside ``specjax.models``
reads parameters by name or pulls the training package into inference."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax

from specjax.models import Gemma, Llama, Model, ModelConfig
from specjax.models import gemma, llama

ROOT = Path(__file__).resolve().parents[1]
TINY_L = llama.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8)
TINY_G = gemma.GemmaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8,
                           layer_types=("sliding", "full"), sliding_window=4)


def test_both_families_implement_the_contract():
    for model, init in ((Llama(TINY_L), llama.init_params), (Gemma(TINY_G), gemma.init_params)):
        assert isinstance(model, Model) and isinstance(model.config, ModelConfig)
        params = init(model.config, jax.random.key(0))
        toks = jax.numpy.asarray([[1, 2, 3]])
        assert model.embed(params, toks).shape == (1, 3, 32)
        assert model.output_head(params).shape == (16, 32)
        assert model.param_dtype(params) == jax.numpy.float32 == model.compute_dtype
        assert model.init_cache(1, 4).k[0].dtype == jax.numpy.float32
        h = model.final_norm(params, model.embed(params, toks))
        assert model.logits(params, h).shape == (1, 3, 16)


def test_no_module_outside_models_reads_parameters_by_name():
    pattern = re.compile(r"""params\[["'](embed|final_norm|lm_head|layers)["']\]""")
    hits = [f"{f.relative_to(ROOT)}:{i}" for d in ("specjax", "train")
            for f in sorted((ROOT / d).rglob("*.py"))
            for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == [], hits


def test_inference_never_imports_the_training_package():
    code = ("import sys, specjax, specjax.drafters.eagle, specjax.drafters.exit_heads, "
            "specjax.drafters.redrafter, specjax.core.beams, specjax.hsd, "
            "specjax.core.speculative, specjax.hsd.calibrate, specjax.demo, specjax.bench; "
            "print(sorted(m for m in sys.modules if m.startswith('specjax.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
