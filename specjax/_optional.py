"""Optional dependencies: imported where a feature needs them, with a one-line error that
names the extra to install when they are missing.

The core install (``pip install specjax``) decodes, trains and loads GGUF/safetensors
weights. Two features need more:

- ``torch`` (``pip install 'specjax[torch]'``): published heads stored as PyTorch
  ``.bin`` files, the transformers peers ``hf`` and ``hf-pld`` of ``specjax bench``, and
  ``specjax.models.t5_random`` (writing random T5 checkpoints).
- ``scipy`` (``pip install 'specjax[scipy]'``): the LP solver of the HSD hierarchy search
  (``method="lp"``; the default ``"dp"`` needs nothing).
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"torch": "torch", "scipy": "scipy"}
"""The distribution each optional top-level module comes from is installed by the extra
of the same name (``pyproject.toml`` ``[project.optional-dependencies]``)."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra installs it."""


def require(module: str, purpose: str) -> ModuleType:
    """Imports and returns ``module`` (e.g. ``"scipy.optimize"``). When its top-level
    package cannot be imported, raises ``MissingExtra`` whose one-line message names
    ``purpose`` and the command that installs the extra, e.g. ``pip install
    'specjax[scipy]'``. Errors inside an installed package are not masked."""
    top = module.partition(".")[0]
    extra = EXTRAS[top]
    try:
        importlib.import_module(top)
    except ImportError:
        raise MissingExtra(f"{purpose} needs {top}, which is not installed: "
                           f"pip install 'specjax[{extra}]'") from None
    return importlib.import_module(module)
