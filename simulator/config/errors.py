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


class UnknownValue(Exception):
    """A check read a value that is itself invalid or missing (``cross_checks``' view of a refused file): the rule
    that read it is skipped (``refuse_each``), or the whole check when it read it outside a rule."""


def refuse_each(*rules) -> None:
    """Run each rule of one check (a callable returning its problem, ``key.path: ... (allowed: ...)``, or None) and
    ``refuse`` the problems found; a rule reading an unknown value (``UnknownValue``) is skipped alone, so the
    rules before and after it are still told.

    Raises:
        ValueError, pydantic.ValidationError: as ``refuse``.
    """
    problems = []
    for rule in rules:
        try:
            problem = rule()
        except UnknownValue:
            continue
        if problem:
            problems.append(problem)
    refuse(problems)


def refuse(problems: list[str]) -> None:
    """Refuse what one check between settings found wrong: each rule a value breaks is its own line.

    Nothing is raised for no problems. A validator that checks several rules collects their messages (each
    ``key.path: problem (allowed: ...)``) and calls this once, so that a value breaking two rules (a
    ``tensor_model_parallel_size`` dividing neither the GPUs per node nor the heads) is told both in one run.

    Raises:
        ValueError: one problem (what the validator raising it itself would give).
        pydantic.ValidationError: several, one ``value_error`` each: pydantic adds a validator's line errors
            to the model's (``loc`` relative to the model, as a ``ValueError``'s), and
            ``cross_checks.cross_setting_errors`` reads them the same way. Their ``input`` is an empty mapping:
            the messages name their values themselves.
    """
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        from pydantic import ValidationError
        from pydantic_core import InitErrorDetails, PydanticCustomError

        raise ValidationError.from_exception_data("check between settings", [InitErrorDetails(
            type=PydanticCustomError("value_error", "Value error, {error}", {"error": p}), loc=(), input={})
            for p in problems])
