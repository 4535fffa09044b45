"""The one exception type for user mistakes: the entry points print its message as one line and exit 1."""


class UserError(Exception):
    """A mistake in the command line, a file or a configuration, stated with its fix."""
