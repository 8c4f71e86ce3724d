"""The bad-input suite as figures: cases tried / clear errors / tracebacks / hangs.

    python benchmarks/bad_input.py [--json] [--verbose]

Runs every case of tests/test_bad_input.py in this process (the suite's own `classify`, with its
alarm as the hang detector) and counts the outcomes per group and overall: "clear" (an
AutoparError or a one-line CLI error naming the problem), "unclear" (refused, but the message
does not name it), "accepted" (no error at all), "traceback" (another exception escaped) and
"hang". Cases that are not clear are listed with their messages. The exit status is 0 only when
every case is clear.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

OUTCOMES = ("clear", "unclear", "accepted", "traceback", "hang")


def load_suite():
    path = Path(__file__).resolve().parent.parent / "tests" / "test_bad_input.py"
    spec = importlib.util.spec_from_file_location("test_bad_input", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    parser.add_argument("--verbose", action="store_true", help="print every case's outcome")
    args = parser.parse_args()
    suite = load_suite()
    groups = {name[:-len("_CASES")].lower(): cases for name, cases in vars(suite).items()
              if name.endswith("_CASES")}
    counts = {group: Counter() for group in groups}
    unclear = []
    started = time.monotonic()
    for group, cases in groups.items():
        for case in cases:
            with tempfile.TemporaryDirectory() as scratch:
                outcome, message = suite.classify(case, Path(scratch))
            counts[group][outcome] += 1
            if args.verbose:
                print(f"{outcome:9} {case.id}", file=sys.stderr)
            if outcome != "clear":
                unclear.append((case.id, outcome, [line[:160] for line in message.strip().splitlines()[:3]]))
    total = sum(counts.values(), Counter())
    if args.json:
        print(json.dumps({"groups": {g: dict(c) for g, c in counts.items()}, "total": dict(total),
                          "tried": sum(total.values()), "seconds": time.monotonic() - started,
                          "not_clear": unclear}, indent=1))
    else:
        print(f"{'group':10} {'tried':>6} " + " ".join(f"{o:>9}" for o in OUTCOMES))
        for group, count in [*counts.items(), ("total", total)]:
            print(f"{group:10} {sum(count.values()):6} " + " ".join(f"{count[o]:9}" for o in OUTCOMES))
        print(f"({time.monotonic() - started:.1f} s)")
        for case_id, outcome, lines in unclear:
            print(f"\n{outcome}: {case_id}\n  " + "\n  ".join(lines))
    return 0 if total["clear"] == sum(total.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
