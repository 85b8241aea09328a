"""Studies: what runs many scenarios (sweeps, Pareto fronts, what-ifs, validation) on top of ``simulator.api``."""
