"""The one exception type a user can cause; the CLI prints it as a single line."""


class MespError(Exception):
    """A user-facing error: bad input, bad flag, unreadable file. Message is one line."""
