"""The errors that are the user's mistake or the machine's state, not titan's bug: the CLI prints their message as
one line and exits with status 2."""


class UserError(Exception):
    """The user's mistake or the machine's state: the CLI prints its message as one line and exits 2."""


class ConfigError(UserError, ValueError):
    """A mistake in the recipe or the command line; the message says what, where and how to fix it. Also a
    ValueError: code that rewords a bad value (`except ValueError`) rewords a ConfigError from below it too."""


def require(ok: bool, message: str) -> None:
    """Raise a ConfigError with `message` unless `ok`."""
    if not ok:
        raise ConfigError(message)


DISTRIBUTION = "titan-pretrain"  # titan's name on the package index (the command is `titan`)


def missing_extra(module: str, extra: str, feature: str) -> str:
    """The one line for a feature whose optional package is not installed: what needs it, and what to install."""
    return f"{feature} needs {module}, which is not installed: pip install '{DISTRIBUTION}[{extra}]' (or {module})"


def import_extra(module: str, extra: str, feature: str):
    """Import an optional package for `feature`, or raise a ConfigError naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(missing_extra(module.split(".")[0], extra, feature)) from None


def installed(module: str) -> bool:
    """Whether an optional package can be imported, without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a half-installed module
        return False
