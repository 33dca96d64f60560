"""The checklist's verdicts for one implementation, from a pytest run of the marked tests.

    python -m scripts.pin_bump.reduce JUNIT_XML IMPLEMENTATION [SECONDS] > checklist-IMPLEMENTATION.json
    python -m scripts.pin_bump.reduce --absent upstream    (a release that ships no cohere_compass)

JUNIT_XML is ``pytest -m checklist --checklist-measure --junitxml=...`` run with IMPLEMENTATION
(upstream or vendored) live; every item PASSes where all its tests passed (tests/support/checklist.py).
Prints the report pin_bump.sh's helpers and record.py read: verdicts, each item's evidence, and
exit_code 0 (every item passes), 1 (some fail) or 2 (no verdict: the run left no marked test).
Where the release ships no cohere_compass of its own (before 0.6.13) there is nothing to run with
upstream's live (``import compass_compat`` refuses the switch): ``--absent`` FAILs every item, saying so.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from tests.support import checklist


def report(junit: Path, implementation: str, seconds: Optional[int] = None) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "implementation": implementation,
        "mlx_vlm_version": importlib.metadata.version("mlx-vlm"),
        "seconds": seconds,
        "error": None,
        "verdicts": {},
        "items": [],
    }
    try:
        outcomes = checklist.outcomes_from_junit(junit)
    except (OSError, ValueError) as err:  # ElementTree's ParseError is a ValueError
        outcomes, out["error"] = [], f"no junit XML from the marked tests ({err})"
    if not outcomes and out["error"] is None:
        out["error"] = f"{junit} holds no test marked checklist: the marked tests did not run"
    if out["error"] is None:
        names = checklist.item_names()
        for n, got in checklist.verdicts(outcomes).items():
            out["verdicts"][n] = got["verdict"]
            out["items"].append({"item": int(n), "name": names.get(n, ""), **got})
    out["exit_code"] = 2 if out["error"] else (0 if all(v == "PASS" for v in out["verdicts"].values()) else 1)
    return out


def absent(implementation: str) -> Dict[str, Any]:
    version = importlib.metadata.version("mlx-vlm")
    evidence = f"no upstream cohere_compass (mlx-vlm {version} ships none; the first release that does is 0.6.13)"
    names = checklist.item_names()
    items = [{"item": int(n), "name": name, "verdict": "FAIL", "evidence": evidence} for n, name in names.items()]
    return {
        "implementation": implementation,
        "mlx_vlm_version": version,
        "seconds": 0,
        "error": None,
        "verdicts": dict.fromkeys(names, "FAIL"),
        "items": items,
        "exit_code": 1,
    }


def main(argv: List[str]) -> int:
    if argv == ["--absent", "upstream"]:
        print(json.dumps(absent("upstream"), indent=2))
        return 1
    if len(argv) not in (2, 3) or argv[1] not in ("upstream", "vendored"):
        print(__doc__, file=sys.stderr)
        return 2
    result = report(Path(argv[0]), argv[1], int(argv[2]) if len(argv) == 3 else None)
    print(json.dumps(result, indent=2))
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
