"""The error every layer may raise for a mistake in a command's arguments."""


class UsageError(Exception):
    """A mistake in the command's arguments: reported in one line, exit code 2."""
