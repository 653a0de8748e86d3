"""The error type for problems a user can fix in their data or data options."""


class DataError(ValueError):
    """A problem with the user's data or data options; the message says how to fix it."""
