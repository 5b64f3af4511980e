"""Errors meant for the user: the CLI prints their message (no traceback) and exits with 2."""


class UserError(Exception):
    """Bad input, a missing file or dataset, a mismatched vocabulary: the message says what and
    where (file, line, value) and, where it can, how to fix it."""


class DataError(UserError, ValueError):
    """A corpus or vocabulary file that cannot be used as it is."""
