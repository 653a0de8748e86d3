"""The error type for problems a user can fix in their data or data options."""

from posgpt.core.errors import UserError


class DataError(UserError, ValueError):
    """A problem with the user's data or data options; the message says how to fix it."""
