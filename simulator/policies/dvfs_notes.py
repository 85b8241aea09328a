"""The ``dvfs`` settings a run shows to have changed nothing, one line each (``DvfsRuntime.warnings``).

A setting that changes nothing is flagged, never silent (ARCHITECTURE.md decision 13):

* ``power_limit_w`` that never binds: the firmware lowers the clock only when the power averaged over its window
  exceeds the limit at one of its evaluations (``power_firmware.PowerLimitFirmware.run``), so where no evaluation of
  the run's metered power (the energy ledger, ``power_ledger``) exceeds it, the limit never acted. The line gives
  the highest such reading (the peak draw the firmware saw) and the instantaneous peak, and says whether a run
  without the setting would be the same (the board's default limit, its TDP, binds there too or not);
* ``power_limit_w`` equal to the board's default limit (its TDP) where it binds: the firmware holds that limit
  without it;
* ``locked_clocks_mhz`` at the GPU's maximum SM clock, and a ``phase_clocks_mhz`` plan whose every phase is at
  it: the model's GPU runs at its maximum clock without a lock or plan (``hardware_models.power.ClockController``
  starts there), so they ask for the clock it has.
"""

from __future__ import annotations

import numpy as np

from simulator.policies.power_firmware import window_averages


def settings_without_effect(rt) -> list[str]:
    """One line per ``dvfs`` setting of ``rt``'s run that changed nothing (module docstring); call after the run's
    ``summarize`` (the ledger complete, ``rt.env.now`` the run's end).

    Args:
        rt: The run's ``DvfsRuntime`` (its ``cfg.dvfs``, ``gpu``, ``ledger``, ``firmware``, ``policy``,
            ``power_limit_w``, ``fmax_mhz`` and firmware grid ``_fw_t0`` / ``period_s`` / ``window_s``).

    Returns:
        Lines for the summary's ``warnings`` (empty without a ``dvfs`` section or where every setting acted).
    """
    dcfg = getattr(rt.cfg, "dvfs", None) if rt.cfg is not None else None
    if dcfg is None:
        return []
    out = []
    if dcfg.power_limit_w is not None:
        note = _limit_note(rt)
        if note:
            out.append(note)
    clock = getattr(rt.policy, "clock_mhz", None)
    if dcfg.kind == "locked_clock" and clock is not None and clock >= rt.fmax_mhz:
        asked = dcfg.locked_clocks_mhz
        snapped = f" (snapped to {clock:g} MHz)" if asked != clock else ""
        out.append(f"dvfs.locked_clocks_mhz {asked:g} MHz{snapped} is the maximum SM clock of {rt.gpu.name}, the clock "
                   "it runs at without a lock (the model's default clock): the lock changes nothing")
    plan = getattr(rt.policy, "plan", None)
    if dcfg.kind == "phase_plan" and plan and all(mhz >= rt.fmax_mhz for mhz in plan.values()):
        out.append(f"dvfs.phase_clocks_mhz puts every phase it names ({', '.join(sorted(plan))}) at the maximum SM "
                   f"clock {rt.fmax_mhz:g} MHz, the clock every phase runs at without a plan: the plan changes nothing")
    return out


def _limit_note(rt) -> str | None:
    """The line for an explicit ``dvfs.power_limit_w``: it never bound, or it equals the default limit; else None."""
    cap, gpu = rt.power_limit_w, rt.gpu
    default = gpu.tdp_w or gpu.max_power_limit_w or None
    ledger = rt.ledger
    T, P, E = (np.asarray(x, dtype=float) for x in (ledger.t, ledger.p, ledger.e))
    avgs = window_averages(T, P, E, rt.env.now, rt._fw_t0, rt.period_s, rt.window_s)
    peak = float(avgs.max()) if len(avgs) else None
    fw = rt.firmware  # an explicit limit is metered per op (``DvfsRuntime.online``): its loop ran, if any
    bound = fw is not None and (fw.lowered > 0 or (peak is not None and peak > cap))
    if bound:
        if default and cap == default:
            return (f"dvfs.power_limit_w {cap:g} W is the default power limit of {gpu.name} (its TDP), which the "
                    "firmware holds without it: the run is the same as without it")
        return None
    inst = float(P.max())
    if peak is None:
        seen = (f"the run ({rt.env.now * 1e3:.3g} ms) ends before the firmware's first evaluation "
                f"(every {rt.period_s * 1e3:g} ms)")
    else:
        seen = (f"peak draw {peak:.0f} W (the highest {rt.window_s * 1e3:g} ms average power of the firmware's "
                f"readings, one per {rt.period_s * 1e3:g} ms; instantaneous peak {inst:.0f} W)")
    if fw is None:
        seen += f"; at most {rt.max_reachable_power_w():.0f} W is reachable (every unit busy at the top clock)"
    if not default or (peak if peak is not None else 0.0) <= default:
        tail = "the run is the same as without it"
    else:
        tail = (f"without it the default limit {default:g} W (TDP) would bind, so it lifts that limit "
                "rather than capping")
    return f"dvfs.power_limit_w {cap:g} W never binds: {seen}, so the clock is never lowered for it; {tail}"
