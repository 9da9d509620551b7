"""The last line of bench/gpu/run.sh: one JSON object merging each stage's figures.

Each stage's output file ends (when the stage finished) with one JSON object; they are merged in
stage order, the `gpu`-marked tests' counts come from pytest's JUnit XML, and a stage that left
no figures (timed out, crashed, skipped) is named with its exit status in `stages_failed`.
Usage: summary.py --junit gpu.xml --stage NAME OUTPUT_FILE EXIT_STATUS [--stage ...]
       summary.py --junit gpu.xml --counts     (prints "PASSED FAILED" of the tests alone)
       summary.py --junit X.xml --counts-as X  (prints {"X_passed": P, "X_failed": F})
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# diag_bench.py's keys, first and always present (zero when its stage left none).
DIAG_KEYS = ("gemm_ratio_to_torch", "copy_ratio_to_torch", "memtest_coverage", "memtest_tb_per_s")


def test_counts(junit: Path) -> tuple[int, int]:
    """(passed, failed + errors) of a pytest JUnit XML report; (0, 1) when there is none."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return 0, 1
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return 0, 1
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return total - failed - skipped, failed


def last_object(path: Path) -> dict[str, Any] | None:
    """The JSON object on the last non-empty line of `path`, if it is one."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        value = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, required=True)
    parser.add_argument("--stage", nargs=3, action="append", default=[],
                        metavar=("NAME", "OUTPUT", "STATUS"))  # fmt: skip
    parser.add_argument("--counts", action="store_true", help="print the test counts alone")
    parser.add_argument("--counts-as", metavar="NAME", help="print them as one JSON object")
    args = parser.parse_args()
    passed, failed = test_counts(args.junit)
    if args.counts:
        print(passed, failed)
        return
    if args.counts_as:
        print(json.dumps({f"{args.counts_as}_passed": passed, f"{args.counts_as}_failed": failed}))
        return
    merged: dict[str, Any] = dict.fromkeys(DIAG_KEYS, 0.0)
    merged.update(gpu_tests_passed=passed, gpu_tests_failed=failed)
    stages_failed = []
    for name, output, status in args.stage:
        figures = last_object(Path(output))
        if figures is None or status != "0":
            stages_failed.append(f"{name} (exit {status})")
        if figures is not None:
            figures.pop("gpu_tests_passed", None)  # the JUnit counts above are the ones
            figures.pop("gpu_tests_failed", None)
            merged.update(figures)
    merged["stages_failed"] = stages_failed
    print(json.dumps(merged))


if __name__ == "__main__":
    main()
