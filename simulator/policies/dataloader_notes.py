"""What a run's DataLoader workers tell about the workers setting (``DataLoaderRuntime.warnings``).

A setting that changes nothing is flagged, never silent (ARCHITECTURE.md decision 13). With ``num_workers`` > 0 the
training loop waits in ``next()`` only for a batch that is not ready yet (``hardware_models.dataloader``); the wait
for the hand-off (``handoff_s``) is the training thread's own and the same whatever the workers. So:

* no measured batch was asked for before it was ready (each batch's lead, ``ready_s`` before ``next()``, >= 0), and
  the workers keep up in steady state (a batch every ``B / N`` s from ``N`` workers taking ``B`` s each, and every
  pin time from the one pin-memory thread, no slower than the step consumes them): the loader does not hold up the
  step, and more workers cannot shorten it. The steady state needs ``ceil(B / C)`` workers, ``C`` the time the step
  takes per batch (``simulator.studies.whatif_dataloader``'s rule), and ``B`` measured with ``N`` workers sharing
  the cores is no less than with fewer, so that many are enough by worker time;
* no measured batch was waited for, but the workers deliver slower than the step consumes: the prefetch buffer
  filled before or during the first steps is draining, and a longer run stalls (the measured steps are a transient).

Remote workers (``dataloader.remote``) also cross a network after the build; they are not judged here.
"""

from __future__ import annotations

import math

import numpy as np


def workers_notes(spec, records, waits, leads, steps, pin_busy_s: float) -> list[str]:
    """The lines above for one run's loader (empty with 0 or remote workers, or when a measured batch waited).

    Args:
        spec: The run's ``DataLoaderSpec``.
        records: ``DataLoaderModel.records`` (``BatchRecord`` per batch dispatched; times in s).
        waits: ``(step, wait_s)`` per batch received; ``leads``: ``(step, lead_s)`` alike (``ready_s`` before the
            ``next()`` call; negative: it waited).
        steps: The run's steps frame (``step``, ``step_time_s``, ``warmup``).
        pin_busy_s: The pin-memory thread's busy time over the run, s.
    """
    if spec.num_workers == 0 or spec.remote is not None or steps is None:
        return []
    measured = steps[~steps.warmup]
    ms = {int(s) for s in measured.step}
    lead = [x for s, x in leads if s in ms]
    if not lead or not len(measured) or min(lead) < 0:
        return []
    t0 = float(measured.start_s.min())
    built = [r for r in records if r.worker >= 0 and not math.isnan(r.built_s)]
    in_run = [r for r in built if r.start_s >= t0] or built
    if not in_run:
        return []
    n = spec.num_workers
    b_s = float(np.mean([r.built_s - r.start_s for r in in_run]))
    pinned = sum(1 for r in records if r.worker >= 0 and not math.isnan(r.ready_s)) if spec.pin_memory else 0
    pin_s = pin_busy_s / pinned if pinned else 0.0
    per_step = len(lead) / len(ms)
    c_s = float(measured.step_time_s.mean()) / per_step  # the step's time per batch
    every_s = max(b_s / n, pin_s)

    def ms_(x):
        return f"{x * 1e3:.3g} ms"

    deliver = (f"a batch takes {ms_(b_s)} on a worker, so {n} worker{'s' if n > 1 else ''} deliver one every "
               f"{ms_(b_s / n)}" + (f" (the pin-memory thread {ms_(pin_s)} per batch)" if pin_s > b_s / n else ""))
    if every_s <= c_s:
        need = max(1, math.ceil(b_s / c_s)) if b_s > 0 else 0
        fewer = (f"; {need} worker{'s' if need != 1 else ''} keep{'s' if need == 1 else ''} up in steady state"
                 if need < n else "")
        return [f"dataloader: data loading is not on the critical path with num_workers {n}: no measured step "
                f"waits for a batch ({deliver}, and the step takes {ms_(c_s)} per batch), so adding workers "
                f"changes nothing{fewer}"]
    return [f"dataloader: no measured step waits for a batch, but {deliver}, slower than the {ms_(c_s)} per batch "
            "the step takes: the prefetch buffer is draining, so a longer run stalls about "
            f"{ms_(every_s - c_s)} per batch (measure later steps: raise run.steps and run.warmup_steps, or see "
            "`simulate dataloader-workers`)"]
