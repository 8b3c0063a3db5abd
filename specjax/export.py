"""Moved to ``specjax.heads.exported`` (``specjax.heads`` re-exports its API). This module
only re-exports it, for code written against the old name; it will be removed."""

from specjax.heads.exported import *  # noqa: F401,F403
from specjax.heads.exported import __all__  # noqa: F401
