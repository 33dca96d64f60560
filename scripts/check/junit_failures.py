"""Print one line per failed or errored test in pytest junit XML files: run, test id, message.

.ci/run prints these last, so the failing tests are named in the lines a CI log keeps.
Usage: junit_failures.py FILE.xml [...]; the run's label is the file's stem. Stdlib only.
"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

for name in sys.argv[1:]:
    try:
        root = ET.parse(name).getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"{Path(name).stem}: junit XML unreadable ({exc})")
        continue
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is None:
                continue
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            message = (bad.get("message") or "").strip().splitlines()
            print(f"{Path(name).stem}: {kind.upper()} {test}: {message[0][:300] if message else ''}")
