"""The engine's error type, in a module of its own so that the CLI can catch it without importing
the engine (pandas, numpy, SimPy) at start-up."""


class SimulationError(RuntimeError):
    """A run failed; the message names the phase (build, run, collect)."""
