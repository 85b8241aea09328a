"""Print the predicted-vs-measured table of the Llama-2-7B H100 GEMMs (simulator.studies.kernel_validation).

Usage: ``python scripts/vidur_gemm_table.py [--gpu PRESET]`` (default ``h100-sxm-80gb``, the GPU the Vidur
profiles were measured on).
"""

from __future__ import annotations

import argparse

import pandas as pd

from simulator.studies.kernel_validation import DATA, summary_table, vidur_gemm_errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100-sxm-80gb", help="GPU preset to price on (default h100-sxm-80gb)")
    args = ap.parse_args()
    t = summary_table(vidur_gemm_errors(gpu=args.gpu))
    print(f"Llama-2-7B layer GEMMs, measured on an H100 ({DATA}, microsoft/vidur) vs predicted on {args.gpu} "
          "(its default profile; h100-sxm-80gb's GEMMs are fitted on TP 1 and 2, TP 4 and 8 are held out); "
          "error = predicted / measured - 1")
    with pd.option_context("display.width", 120):
        print(t.assign(median_error=(100 * t.median_error).round(1),
                       median_abs_error=(100 * t.median_abs_error).round(1)).rename(
            columns={"median_error": "median error %", "median_abs_error": "median |error| %"}).to_string(index=False))


if __name__ == "__main__":
    main()
