"""The config layer's error types: one-line, user-facing messages."""


class ScenarioError(ValueError):
    """A scenario could not be loaded: names the file, the key path and what is allowed; one line per problem
    (a file with several bad keys: several lines, each naming the file and its key)."""


class ScenarioWarning(UserWarning):
    """Something in a scenario was replaced or adjusted (printed as one ``warning:`` line)."""


class PolicyError(ValueError):
    """A policy's parameters are invalid (one line, naming the scenario key).

    Raised by the policies (``simulator.policies.registry`` re-exports it); defined here so that the
    CLI can catch it without importing the policies (pandas) at start-up."""


def error_text(exc: BaseException) -> str:
    """``exc``'s message as the command line prints it: each of its lines after ``error: ``."""
    return "\n".join(f"error: {line}" for line in str(exc).split("\n"))
