"""Moved to ``specjax.heads.published`` (head files live in ``specjax.heads``). This module
only re-exports it, for code written against the old name; it will be removed."""

from specjax.heads.published import *  # noqa: F401,F403
from specjax.heads.published import __all__  # noqa: F401
