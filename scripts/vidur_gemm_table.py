"""Print the predicted-vs-measured table of the Llama-2-7B H100 GEMMs (simulator.studies.kernel_validation)."""

from __future__ import annotations

import pandas as pd

from simulator.studies.kernel_validation import summary_table, vidur_gemm_errors


def main() -> None:
    t = summary_table(vidur_gemm_errors())
    with pd.option_context("display.width", 120):
        print(t.assign(median_error=(100 * t.median_error).round(1),
                       median_abs_error=(100 * t.median_abs_error).round(1)).rename(
            columns={"median_error": "median error %", "median_abs_error": "median |error| %"}).to_string(index=False))


if __name__ == "__main__":
    main()
