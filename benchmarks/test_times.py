"""Where the test suite's time goes: a pytest JUnit report summed per file and listed per test.

    .venv/bin/python -m pytest -q --junitxml=/tmp/junit.xml        # the whole suite (make test's command)
    .venv/bin/python benchmarks/test_times.py /tmp/junit.xml [--top 40] [--compare /tmp/before.xml]

Besides files and tests it sums blocks of the suite (block_of): the reference pair, the sampling checks (the names
tests/conftest.py marks slow by), the HTTP server, Ray, the rest.

A test's time includes the set-up of the fixtures it is the first to use (the real-pair references, a Ray cluster),
so compare files, or the same test across two reports of the same machine; and compare the tests a change left
alone too: this project's Zen 3 VM has run the same suite 44 and 80 minutes on consecutive days.
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import RAY_FILES, SLOW_WORDS  # noqa: E402 -- the suite's own words for its slow tests


def cases(path: str) -> dict[str, tuple[str, float]]:
    """test id -> (file, seconds) for every test case in a JUnit report."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        file = case.get("classname", "")
        out[f"{file}::{case.get('name')}"] = (file, float(case.get("time", 0.0)))
    return out


def block_of(test_id: str) -> str:
    """The block of the suite a test belongs to (the first rule that holds)."""
    file, name = test_id.split("::", 1)
    path = file.replace(".", "/") + ".py"
    if file.startswith("tests.test_real_pair") or "reference_pair" in name:
        return "the reference pair"
    if any(word in name for word in SLOW_WORDS):
        return "sampling checks (tiny models, Ray nodes included)"
    if file.startswith("tests.server."):
        return "the HTTP server (tiny models)"
    if path.endswith(RAY_FILES):
        return "Ray, other tests"
    return "everything else (tiny models, unit tests)"


def by_block(report: dict[str, tuple[str, float]]) -> tuple[collections.Counter, collections.Counter]:
    """Seconds and tests per block."""
    seconds, count = collections.Counter(), collections.Counter()
    for test_id, (_, s) in report.items():
        block = block_of(test_id)
        seconds[block] += s
        count[block] += 1
    return seconds, count


def by_file(report: dict[str, tuple[str, float]]) -> collections.Counter:
    totals = collections.Counter()
    for file, seconds in report.values():
        totals[file] += seconds
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a pytest --junitxml file")
    parser.add_argument("--top", type=int, default=40, help="how many of the slowest tests to list")
    parser.add_argument("--compare", help="an earlier report: files and tests side by side, before -> after")
    args = parser.parse_args()
    after = cases(args.report)
    before = cases(args.compare) if args.compare else {}
    total = sum(s for _, s in after.values())
    print(
        f"{len(after)} tests, {total / 60:.1f} min"
        + (f" (before: {len(before)} tests, {sum(s for _, s in before.values()) / 60:.1f} min)" if before else "")
    )
    blocks_before, _ = by_block(before)
    print("\nper block (worker-minutes, tests):")
    seconds, count = by_block(after)
    for block, s in seconds.most_common():
        print(
            f"{s / 60:8.1f}"
            + (f"  (before {blocks_before[block] / 60:5.1f})" if before else "")
            + f"  {count[block]:5d}  {block}"
        )
    files_before = by_file(before)
    print("\nper file (s):")
    for file, seconds in by_file(after).most_common(25):
        print(f"{seconds:8.1f}" + (f"  (before {files_before[file]:7.1f})" if before else "") + f"  {file}")
    print(f"\nthe {args.top} slowest tests (s):")
    for name, (_, seconds) in sorted(after.items(), key=lambda kv: -kv[1][1])[: args.top]:
        was = f"  (before {before[name][1]:6.1f})" if name in before else ("  (new)" if before else "")
        print(f"{seconds:8.1f}{was}  {name}")


if __name__ == "__main__":
    main()
