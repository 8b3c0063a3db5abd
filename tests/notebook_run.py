"""How the tests run a notebook headless: its test-size parameters (``SMALL``), the results
each one establishes (``CHECKS``), and ``execute``, which runs the code cells top to bottom
in one namespace (IPython magics and shell escapes made no-ops, ``SMALL`` applied right after
the parameters cell). ``STANDINS`` writes the inputs of a notebook about weights this
machine cannot download: random stand-ins in the same layouts. Used by
tests/test_notebooks.py and, for the notebook that needs 8 simulated devices,
tests/test_sharding.py."""

import json
import re
import warnings
from pathlib import Path
from typing import Callable

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# Notebooks that need a process of their own, and the test that executes them there.
ELSEWHERE = {"06_sharding.ipynb": "tests/test_sharding.py (8 simulated CPU devices)"}

# Test-size overrides of each notebook's parameters cell (its defaults are the real run).
# Widths, capacities and output sizes are chosen so that notebooks share compiled code:
# one prompt of under 64 tokens and 16 new tokens decode in a cache of 128 entries, as in
# 01_quickstart, so `generate` compiles once for the whole module.
SMALL: dict[str, dict] = {
    "01_quickstart.ipynb": {"MAX_NEW_TOKENS": 16, "CATEGORIES": ("math_reasoning",)},
    "02_verify_your_logits.ipynb": {"ROWS": 20_000},
    "03_eagle2.ipynb": {"N_TRAIN_PROMPTS": 2, "DISTILL_NEW_TOKENS": 16, "TRAIN_STEPS": 3,
                        "BATCH_TOKENS": 128, "VAL_EXAMPLES": 0, "N_PROMPTS": 1,
                        "MAX_NEW_TOKENS": 16},
    "04_redrafter.ipynb": {"N_TRAIN_PROMPTS": 2, "DISTILL_NEW_TOKENS": 16, "TRAIN_STEPS": 3,
                           "BATCH_TOKENS": 128, "DRAFT_VOCAB": 1024, "BEAMS": 2, "BEAM_LEN": 2,
                           "VERIFY_WIDTHS": (5,), "N_PROMPTS": 1, "MAX_NEW_TOKENS": 16},
    "05_hsd.ipynb": {"N_CALIB_PROMPTS": 1, "CALIB_NEW_TOKENS": 8, "EXIT_LAYERS": (4,),
                     "WIDTHS": (1,), "REPEATS": 1, "T_MAX": 4, "MAX_LEVELS": 3,
                     "N_PROMPTS": 1, "MAX_NEW_TOKENS": 16, "N_COMPARE": 1},
    "06_sharding.ipynb": {"N_PROMPTS": 2, "MAX_NEW_TOKENS": 16},
    # with STANDINS' TARGET_DIR and HEAD_DIR
    "07_published_heads.ipynb": {"N_PROMPTS": 2, "MAX_NEW_TOKENS": 16, "TREE": (3, 3, 8)},
}

STANDIN_DRAFT_VOCAB = 64  # the draft vocabulary of 07_published_heads' stand-in head

# What each notebook establishes, as expressions over its namespace after the last cell.
CHECKS: dict[str, list[str]] = {
    "01_quickstart.ipynb": ["len(out.to_lists()[0]) >= 1", "same_key_same_sample is True",
                            "greedy_equal is True", "tau[EAGLE] > 1.0",
                            "set(speedup) == {'ar', f'sd-ngram:{NGRAM_DEPTH}', EAGLE}"],
    "02_verify_your_logits.ipynb": ["greedy_exact is True", "p_value > 1e-3",
                                    "p_wrong_q < 1e-6", "p_typical < 1e-6"],
    "03_eagle2.ipynb": ["greedy_equal is True", "loss_decreased",
                        "len(train_log) == TRAIN_STEPS", "shipped_tau > 1.0"],
    "04_redrafter.ipynb": ["greedy_equal is True", "loss_decreased",
                           "len(train_log) == TRAIN_STEPS", "1.0 <= tau <= BEAM_LEN + 1"],
    "05_hsd.ipynb": ["greedy_equal is True", "len(sigma) >= 2",
                     "all(r['measured_ms'] > 0 for r in compare)"],
    "06_sharding.ipynb": ["greedy_equal is True"],
    # random weights: drafts are hardly ever accepted, so nothing about tau beyond >= 1
    "07_published_heads.ipynb": ["greedy_equal is True", "len(ar_tokens) == N_PROMPTS == 2",
                                 "all(1 <= len(t) <= MAX_NEW_TOKENS for t in ar_tokens)",
                                 "drafted > 0", "tau >= 1.0", "set(built) == {'ar', EAGLE}",
                                 f"dparams['vocab_ids'].shape == ({STANDIN_DRAFT_VOCAB},)"],
}


# Stand-ins of 07_published_heads' downloads, in the layouts of the real ones: a random
# Llama-3.1-layout HF target directory (llama3 RoPE scaling, untied embeddings, bfloat16
# safetensors, a byte-level tokenizer with a Llama-3-style chat template) and a random
# EAGLE-3 head for it, written by tests/published.py in SafeAILab's layout (bfloat16
# pytorch_model.bin, as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B is published).
_SPECIALS = ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>")
_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
         "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
         "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
         "{% endif %}")


def write_standin_target(path: Path, layers: int = 6, seed: int = 0) -> int:
    """A tiny random Llama-3.1-layout HF directory at ``path`` with its tokenizer (256 byte
    tokens and Llama 3's four chat specials; the vocabulary is exactly the tokenizer's, so
    every id decodes); returns the vocabulary size."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(byte_level.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer, tok.decoder = byte_level, decoders.ByteLevel()
    tok.add_special_tokens(list(_SPECIALS))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=_SPECIALS[0],
                                                     eos_token=_SPECIALS[1])
    tokenizer.chat_template = _CHAT
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharp logits: the greedy comparison is not decided by near-ties
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return cfg.vocab_size


def published_standins(root: Path) -> dict:
    """Writes 07_published_heads' target and head stand-ins under ``root``; returns the
    parameters naming them."""
    import torch
    from published import write_eagle3_head

    root = Path(root)
    vocab = write_standin_target(root / "target")
    write_eagle3_head(root / "head", hidden=64, heads=4, kv_heads=2, intermediate=128,
                      vocab=vocab, draft_vocab=STANDIN_DRAFT_VOCAB, dtype=torch.bfloat16, seed=1)
    return {"TARGET_DIR": str(root / "target"), "HEAD_DIR": str(root / "head")}


# Notebooks whose inputs the test writes first: a function of an empty directory that writes
# them there and returns parameters naming them, applied with SMALL.
STANDINS: dict[str, Callable[[Path], dict]] = {"07_published_heads.ipynb": published_standins}

_MAGIC = re.compile(r"^(\s*)[%!].*$", re.M)


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    src = cell["source"]
    return src if isinstance(src, str) else "".join(src)


def headless(src: str) -> str:
    """The cell with IPython magic and shell lines (``%pip``, ``!ls``) made no-ops."""
    return _MAGIC.sub(r"\1pass  # IPython magic: skipped headless", src)


def is_parameters(cell: dict) -> bool:
    return "parameters" in cell.get("metadata", {}).get("tags", [])




def execute(path: Path, extra: dict | None = None) -> dict:
    """Runs ``path``'s code cells headless with ``SMALL[path.name]`` and ``extra`` (a
    ``STANDINS`` function's parameters) applied; returns the namespace after the last
    cell."""
    small = {**SMALL.get(path.name, {}), **(extra or {})}
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "FigureCanvasAgg is non-interactive")
        for i, cell in enumerate(c for c in cells(path) if c["cell_type"] == "code"):
            exec(compile(headless(source(cell)), f"{path.name}[cell {i}]", "exec"), ns)  # noqa: S102
            if is_parameters(cell):
                unknown = set(small) - set(ns)
                assert not unknown, f"{path.name}: no parameters {sorted(unknown)}"
                ns.update(small)
    return ns


def check(path: Path, ns: dict) -> None:
    """Asserts each of ``CHECKS[path.name]`` over the notebook's final namespace."""
    for expr in CHECKS.get(path.name, []):
        assert eval(expr, ns), f"{path.name}: {expr}"  # noqa: S307
