"""The one error type the config layer raises: a one-line, user-facing message."""


class ScenarioError(ValueError):
    """A scenario could not be loaded: names the file, the key path and what is allowed."""


class ScenarioWarning(UserWarning):
    """Something in a scenario was replaced or adjusted (printed as one ``warning:`` line)."""
