"""The errors that are the user's mistake or the machine's state, not titan's bug: the CLI prints their message as
one line and exits with status 2."""


class UserError(Exception):
    """The user's mistake or the machine's state: the CLI prints its message as one line and exits 2."""


class ConfigError(UserError, ValueError):
    """A mistake in the recipe or the command line; the message says what, where and how to fix it. Also a
    ValueError: code that rewords a bad value (`except ValueError`) rewords a ConfigError from below it too."""
