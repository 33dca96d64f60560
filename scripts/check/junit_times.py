"""Where a matrix run's time goes: seconds per test file and the slowest tests, from junit XML.

python3 scripts/check/junit_times.py build/matrix/*.xml [--top 20]      (stdlib only)
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    per_file: Dict[str, float] = defaultdict(float)
    tests: List[Tuple[float, str]] = []
    for path in args.xml:
        run = path.stem
        for case in ET.parse(path).iter("testcase"):
            seconds = float(case.get("time") or 0)
            name = case.get("classname", "").replace(".", "/") + ".py"
            per_file[name] += seconds
            tests.append((seconds, f"{run}: {case.get('classname')}::{case.get('name')}"))
    print(f"seconds per test file, all runs ({len(args.xml)}):")
    for name, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {seconds:8.1f}  {name}")
    print(f"the {args.top} slowest tests:")
    for seconds, name in sorted(tests, reverse=True)[: args.top]:
        print(f"  {seconds:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
