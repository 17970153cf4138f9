"""User-facing error type shared by every subcommand."""


class UserError(Exception):
    """A user mistake (bad input file, missing data, impossible request).

    The CLI prints the message as one line, with no traceback, and exits with code 2.
    The message should name the problem and the fix.
    """
