"""Errors meant for the user: the CLI prints their message (no traceback) and exits with 2.

Any other exception reaching the command line is a bug: it keeps its traceback, and the CLI
exits with 1 and asks for a report (:func:`aiayn.cli.main`). So an error caused by what the
user gave (a file, an option, a config value) is raised as a :class:`UserError` or one of its
kinds, never as a bare ``ValueError``.
"""


class UserError(Exception):
    """Bad input, a missing file or dataset, a mismatched vocabulary: the message says what and
    where (file, line, value) and, where it can, how to fix it."""


class DataError(UserError, ValueError):
    """A corpus or vocabulary file that cannot be used as it is."""


class ConfigError(UserError, ValueError):
    """A config value, preset, ``--set`` override or command-line option out of range or of
    the wrong kind (the message names the field or option and the value)."""
