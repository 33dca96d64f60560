"""Print "passed failed skipped" of a pytest junit XML file (failed = failures + errors).

Used by scripts/check/matrix.sh and .ci/run; runs on any Python 3 (stdlib only).
"""

import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
tests, failures, errors, skipped = (
    sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
)
print(tests - failures - errors - skipped, failures + errors, skipped)
