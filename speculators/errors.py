"""Exceptions with messages meant for the user (the CLI prints them as one line, exit code 2)."""


class SpeculatorsError(Exception):
    """A user-facing error: bad recipe, bad input file, incompatible checkpoint, ...

    The message names the offending field, file or value and what is allowed. The CLI prints
    ``error: <message>`` and exits with status 2 instead of a traceback.
    """
