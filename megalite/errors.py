"""The one exception type for user mistakes: the entry points print its message as one line and exit 1."""


class UserError(Exception):
    """A mistake in the command line, a file or a configuration, stated with its fix.

    ``local``: only this rank may see it (its environment, its rendezvous, a signal it received), so every
    rank that hits one reports it with its rank, not only rank 0."""

    def __init__(self, message: str = "", local: bool = False):
        super().__init__(message)
        self.local = local
