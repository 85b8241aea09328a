"""The config layer's error types: one-line, user-facing messages."""


class ScenarioError(ValueError):
    """A scenario could not be loaded: names the file, the key path and what is allowed."""


class ScenarioWarning(UserWarning):
    """Something in a scenario was replaced or adjusted (printed as one ``warning:`` line)."""


class PolicyError(ValueError):
    """A policy's parameters are invalid (one line, naming the scenario key).

    Raised by the policies (``simulator.policies.registry`` re-exports it); defined here so that the
    CLI can catch it without importing the policies (pandas) at start-up."""
