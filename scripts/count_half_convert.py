"""Count the instructions and branch mispredicts per element of DeepSpeed 0.3's scalar fp32 -> fp16 copy-back.

What is counted (``hardware_models.host_kernels``, ``HALF_CONVERT_*``): the second OpenMP loop of DeepSpeed 0.3's
CPUAdam (microsoft/DeepSpeed, the ZeRO-Offload release of September 2020, csrc/adam/cpu_adam.cpp
``Adam_Optimizer::Step`` / ``Step_4`` / ``Step_8``, the ``if (dev_params)`` block): per tile, a loop unrolled by 4
that stores ``(__half)_params[t + j + k]`` into the pinned double buffer. In a .cpp built by the host compiler,
``(__half)f`` is CUDA's host ``__float2half`` (cuda_fp16.hpp, the branch without ``__CUDA_ARCH__``; e.g. the copy in
ggerganov/llama.cpp@f555db44ec12d429a073ce75208fd9ed3bf0a0c9 include/cuda/cuda_fp16.hpp): a software conversion
(``__internal_float2half``: the sign, five range cases -- NaN/Inf, overflow, normal, zero, denormal -- each giving
a 16-bit result and the dropped bits as a 32-bit ``remainder``), then round-to-nearest-even (increment when the
remainder is above one half, or exactly one half with an odd result). The C below is an independent
re-implementation of that algorithm with the same branch structure, checked bit-exact against the hardware
conversion (``_Float16`` / F16C) on the inputs it is run on.

The loop is compiled with ``gcc -O3`` (DeepSpeed's CPUAdamBuilder builds with -O3; ``-march`` is left at the
compiler default because valgrind does not run AVX-512 code, and the conversion is scalar, not vectorised, either
way: gcc 12 does not vectorise it for -march x86-64, haswell or skylake-avx512, and -march=haswell counts the same
22.52 instructions) and run under valgrind callgrind with
``--branch-sim=yes`` (its simulated predictor: 16k two-bit counters indexed by address and global history, valgrind
manual, section "Branch simulation"), collecting only inside the loop (``--toggle-collect``). Inputs: ``N`` fp32
weights drawn from N(0, 0.02^2) (GPT-2 / Megatron initialisation std 0.02), the values CPUAdam's parameters hold.

Printed: instructions / element (``Ir``), conditional-branch mispredicts / element (``Bcm``), and the core cycles
per element of the model: ``instructions / ISSUE_WIDTH + mispredicts x MISPREDICT_CYCLES`` (the constants of
hardware_models.host_kernels: 4-wide issue and a 15-cycle misprediction penalty on Skylake, Agner Fog,
*The microarchitecture of Intel, AMD and VIA CPUs*). ``--check``: exit 1 unless the counts, rounded as the
constants are written (2 and 3 decimals), equal ``HALF_CONVERT_INSTRUCTIONS`` and ``HALF_CONVERT_MISPREDICTS``.

Usage: python scripts/count_half_convert.py [--elements N] [--seed S] [--std X] [--check]
Needs gcc and valgrind on PATH (exit 2 with one line when one is missing).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The loop and its inputs. The RNG (xorshift64* + Box-Muller) runs outside the collected function.
C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Host fp32 -> fp16 of CUDA's cuda_fp16.hpp (see the Python docstring): range case, then round to nearest even. */
static inline uint16_t host_float2half(float f) {
    uint32_t bits, mag, sign, rest, out;
    memcpy(&bits, &f, sizeof bits);
    mag = bits & 0x7fffffffu;
    sign = (bits >> 16) & 0x8000u;
    if (mag >= 0x7f800000u) {                 /* NaN / +-Inf */
        rest = 0u;
        out = (mag == 0x7f800000u) ? (sign | 0x7c00u) : 0x7fffu;
    } else if (mag > 0x477fefffu) {           /* above the largest half: saturate, rounds to Inf */
        rest = 0x80000000u;
        out = sign | 0x7bffu;
    } else if (mag >= 0x38800000u) {          /* normal half */
        rest = mag << 19;
        out = sign | ((mag - 0x38000000u) >> 13);
    } else if (mag < 0x33000001u) {           /* rounds to +-0 */
        rest = mag;
        out = sign;
    } else {                                  /* denormal half */
        uint32_t shift = 0x7eu - (mag >> 23);
        uint32_t frac = (mag & 0x7fffffu) | 0x800000u;
        rest = frac << (32u - shift);
        out = (sign | (frac >> shift)) & 0xffffu;
    }
    if (rest > 0x80000000u || (rest == 0x80000000u && (out & 1u))) out++;
    return (uint16_t)out;
}

/* DeepSpeed 0.3's copy-back of one tile: unrolled by 4, one store per element into the pinned buffer. */
__attribute__((noinline)) void copy_back(uint16_t *restrict buf, const float *restrict params, size_t n) {
    for (size_t j = 0; j < n; j += 4) {
        buf[j] = host_float2half(params[j]);
        buf[j + 1] = host_float2half(params[j + 1]);
        buf[j + 2] = host_float2half(params[j + 2]);
        buf[j + 3] = host_float2half(params[j + 3]);
    }
}

static uint64_t rng_state;
static double uniform01(void) {
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return ((rng_state * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
}

int main(int argc, char **argv) {
    size_t n = strtoull(argv[1], NULL, 10);
    rng_state = strtoull(argv[2], NULL, 10) * 0x9e3779b97f4a7c15ull + 1;
    double std = atof(argv[3]);
    float *p = malloc(n * sizeof *p);
    uint16_t *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i += 2) {
        double u1 = uniform01(), u2 = uniform01();
        double r = sqrt(-2.0 * log(u1 > 0 ? u1 : 1e-300)) * std;
        p[i] = (float)(r * cos(6.283185307179586 * u2));
        if (i + 1 < n) p[i + 1] = (float)(r * sin(6.283185307179586 * u2));
    }
    copy_back(h, p, n);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {          /* bit-exact against the compiler's IEEE conversion */
        _Float16 ref = (_Float16)p[i];
        uint16_t rb;
        memcpy(&rb, &ref, sizeof rb);
        bad += rb != h[i];
    }
    printf("mismatches %zu\n", bad);
    return bad != 0;
}
"""


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        print(f"count_half_convert: {tool} not found on PATH (needed to compile / count the loop)", file=sys.stderr)
        sys.exit(2)
    return path


def count(elements: int = 1 << 20, seed: int = 1, std: float = 0.02) -> dict:
    """Compile the loop, run it under callgrind on ``elements`` N(0, ``std``^2) values, return the counts.

    Returns:
        ``{"instructions", "mispredicts", "cycles", "elements"}``: per element; ``cycles`` by the model's formula
        (``hardware_models.host_kernels``: instructions / ISSUE_WIDTH + mispredicts x MISPREDICT_CYCLES).

    Raises:
        ValueError: ``elements`` not a positive multiple of 4 (the loop is unrolled by 4, as DeepSpeed's).
        RuntimeError: the compile or the run failed, or the conversion is not bit-exact.
    """
    from hardware_models.host_kernels import ISSUE_WIDTH, MISPREDICT_CYCLES

    if elements <= 0 or elements % 4:
        raise ValueError(f"elements must be a positive multiple of 4, got {elements}")
    gcc, valgrind = _need("gcc"), _need("valgrind")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe, out = Path(tmp, "half.c"), Path(tmp, "half"), Path(tmp, "callgrind.out")
        src.write_text(C_SOURCE)
        cc = subprocess.run([gcc, "-O3", "-std=gnu11", str(src), "-o", str(exe), "-lm"], capture_output=True, text=True)
        if cc.returncode:
            raise RuntimeError(f"gcc failed: {cc.stderr.strip()}")
        run = subprocess.run([valgrind, "--tool=callgrind", "--branch-sim=yes", "--collect-atstart=no",
                              "--toggle-collect=copy_back", f"--callgrind-out-file={out}",
                              str(exe), str(elements), str(seed), repr(std)], capture_output=True, text=True)
        if run.returncode or "mismatches 0" not in run.stdout:
            raise RuntimeError(f"the loop failed or is not bit-exact: {run.stdout.strip()} {run.stderr[-400:]}")
        totals = _totals(out.read_text())
    ins, mis = totals["Ir"] / elements, (totals["Bcm"] + totals.get("Bim", 0.0)) / elements
    return {"instructions": ins, "mispredicts": mis, "cycles": ins / ISSUE_WIDTH + mis * MISPREDICT_CYCLES,
            "elements": elements}


def _totals(text: str) -> dict[str, float]:
    """The ``events:`` and ``totals:`` lines of a callgrind output file, as ``{event: count}``."""
    events = re.search(r"^events:(.*)$", text, re.M)
    totals = re.search(r"^totals:(.*)$", text, re.M)
    if not (events and totals):
        raise RuntimeError("no events/totals lines in callgrind's output file")
    return dict(zip(events.group(1).split(), (float(x) for x in totals.group(1).split())))


def matches(r: dict) -> bool:
    """Whether counts of :func:`count` equal the constants of hardware_models.host_kernels as they are written
    (instructions to 2 decimals, mispredicts to 3)."""
    from hardware_models.host_kernels import HALF_CONVERT_INSTRUCTIONS, HALF_CONVERT_MISPREDICTS

    return round(r["instructions"], 2) == HALF_CONVERT_INSTRUCTIONS and \
        round(r["mispredicts"], 3) == HALF_CONVERT_MISPREDICTS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=1 << 20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--check", action="store_true", help="exit 1 unless the counts match HALF_CONVERT_*")
    a = ap.parse_args(argv)
    from hardware_models.host_kernels import HALF_CONVERT_INSTRUCTIONS, HALF_CONVERT_MISPREDICTS, ISSUE_WIDTH, \
        MISPREDICT_CYCLES
    try:
        r = count(a.elements, a.seed, a.std)
    except ValueError as e:
        print(f"count_half_convert: {e}", file=sys.stderr)
        return 2
    print(f"elements {r['elements']}, N(0, {a.std}^2) fp32, gcc -O3, valgrind callgrind --branch-sim=yes")
    print(f"instructions / element  {r['instructions']:.3f}   (HALF_CONVERT_INSTRUCTIONS {HALF_CONVERT_INSTRUCTIONS})")
    print(f"mispredicts / element   {r['mispredicts']:.4f}  (HALF_CONVERT_MISPREDICTS {HALF_CONVERT_MISPREDICTS})")
    print(f"cycles / element        {r['cycles']:.3f}   (= instructions / {ISSUE_WIDTH:g} + mispredicts x "
          f"{MISPREDICT_CYCLES:g})")
    if a.check:
        ok = matches(r)
        print("check:", "constants match" if ok else "constants DIFFER from the counts")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
