"""Helpers for scripts/pin_bump/pin_bump.sh and scripts/pin_bump/release_sweep.sh (stdlib + packaging, any Python 3.10+).

Subcommands:
  latest                   < `pip index versions mlx-vlm`    the newest release
  releases FROM TO         < `pip index versions mlx-vlm`    every final release in [FROM, TO], oldest first
  recipe-env VERSION ENV...                                  the matrix environment whose recipe a release
                                                             gets: the newest untagged ENV at or below it
  conflicts                < pip's resolver error             the packages pip names as conflicting
  report WORKDIR OUT_BASE                                    write OUT_BASE.md and OUT_BASE.json, print
                                                             the exit status (0 / 1 / 2)
  sweep-row REPORT.json TABLE.md                             add one row to the sweep table (rows kept sorted)
  rebuild REPORTS_DIR TABLE.md                               rewrite the table's rows from the reports
  spread                   < releases, oldest first           an order whose every prefix spans the range

The report compares each checklist verdict with the record (compass_compat/verdicts.json, whatever
items it lists) for the nearest recorded release at or below this one (before this run records it).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from packaging.version import InvalidVersion, Version

EXIT_REPLACE, EXIT_KEEP, EXIT_BROKE = 0, 1, 2
KEY_PACKAGES = ("mlx", "mlx-vlm", "mlx-lm", "transformers")


def _available(text: str) -> List[Version]:
    match = re.search(r"^Available versions:\s*(.+)$", text, re.M)
    if not match:
        raise SystemExit(f"no 'Available versions:' line in pip's answer:\n{text}")
    out = []
    for part in match.group(1).split(","):
        try:
            out.append(Version(part.strip()))
        except InvalidVersion:
            continue
    return sorted(v for v in out if not v.is_prerelease and not v.is_devrelease)


def cmd_latest() -> int:
    print(_available(sys.stdin.read())[-1])
    return 0


def cmd_releases(low: str, high: str) -> int:
    for v in _available(sys.stdin.read()):
        if Version(low) <= v <= Version(high):
            print(v)
    return 0


def cmd_recipe_env(version: str, *envs: str) -> int:
    """The newest untagged matrix environment at or below ``version`` (none: print nothing)."""
    candidates = sorted((Version(e), e) for e in envs if "-" not in e and Version(e) <= Version(version))
    if candidates:
        print(candidates[-1][1])
    return 0


def cmd_conflicts() -> int:
    """Names pip's ResolutionImpossible error gives ("Cannot install A==1 and B==2 ...")."""
    text = sys.stdin.read()
    names = set()
    for match in re.finditer(r"Cannot install (.+?) because these package versions have conflicting", text):
        for part in re.split(r",\s*|\s+and\s+", match.group(1)):
            name = re.match(r"[A-Za-z0-9_.\-]+", part.strip())
            if name:
                names.add(name.group(0).lower())
    for match in re.finditer(r"The user requested ([A-Za-z0-9_.\-]+)", text):
        names.add(match.group(1).lower())
    print(" ".join(sorted(names)))
    return 0


# ------------------------------------------------------------------------------ the report


def _load_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def expected_block(record: Path) -> Dict[str, Any]:
    """The recorded verdicts: release -> implementation -> item -> verdict."""
    data = _load_json(record) or {}
    return {r: {k: e[k] for k in ("upstream", "vendored")} for r, e in data.get("releases", {}).items()}


def nearest_pin(block: Dict[str, Any], version: str) -> Optional[str]:
    pins = sorted((Version(p), p) for p in block if Version(p) <= Version(version))
    return pins[-1][1] if pins else None


def junit_counts(path: Path) -> Optional[Dict[str, int]]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests, failures, errors, skipped = (
        sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    )
    failed = [
        f"{case.get('classname', '')}::{case.get('name', '')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "passed": tests - failures - errors - skipped,
        "failed": failures + errors,
        "skipped": skipped,
        "failed_tests": failed,
    }


def _freeze(path: Path) -> Dict[str, str]:
    out = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if "==" in line and not line.startswith("#"):
                name, _, ver = line.partition("==")
                out[name.strip().lower().replace("_", "-")] = ver.split()[0]
    return out


def compare(measured: Dict[str, str], want: Optional[Dict[str, str]]) -> List[Dict[str, str]]:
    """Item-by-item differences over the union of the items measured and the items recorded."""
    if want is None:
        return []
    out = []
    for item in sorted(set(measured) | set(want), key=lambda s: int(s) if s.isdigit() else 10**6):
        got, exp = measured.get(item, "not run"), want.get(item, "not recorded")
        if got != exp:
            out.append({"item": item, "measured": got, "expected": exp})
    return out


def build_report(work: Path) -> Dict[str, Any]:
    meta = _load_json(work / "meta.json") or {}
    version = meta.get("mlx_vlm", "?")
    repo = Path(meta.get("repo", "."))
    block = expected_block(repo / "compass_compat" / "verdicts.json")
    pin = nearest_pin(block, version) if version != "?" else None
    freeze = _freeze(work / "freeze.txt")
    resolved = {name: freeze.get(name, "-") for name in KEY_PACKAGES}
    resolved["torch"] = freeze.get("torch", "-")
    problems: List[str] = []  # something of ours broke (exit 2)
    notes: List[str] = []

    if meta.get("env_error"):
        problems.append(f"the environment could not be built: {meta['env_error']}")
    if resolved["torch"] != "-":
        problems.append(f"torch {resolved['torch']} was installed: a pin-bump environment must not hold torch")

    checklist: Dict[str, Any] = {}
    for impl in ("upstream", "vendored"):
        rep = _load_json(work / f"checklist-{impl}.json")
        entry: Dict[str, Any] = {"exit_code": None, "verdicts": {}, "error": None, "seconds": None}
        if rep is None:
            entry["error"] = "no JSON report (the checklist crashed or did not run)"
        else:
            entry.update(
                exit_code=rep.get("exit_code"),
                verdicts=rep.get("verdicts", {}),
                error=rep.get("error"),
                seconds=rep.get("seconds"),
                evidence={str(i["item"]): i["evidence"] for i in rep.get("items", []) if i["verdict"] != "PASS"},
            )
        want = block.get(pin, {}).get(impl) if pin else None
        entry["expected_from"] = pin
        entry["differences"] = compare(entry["verdicts"], want) if entry["verdicts"] else []
        checklist[impl] = entry

    vend = checklist["vendored"]
    if vend["error"] or vend["exit_code"] != 0:
        failing = [k for k, v in vend["verdicts"].items() if v != "PASS"]
        problems.append(
            "the vendored copy fails checklist item(s) " + ", ".join(failing)
            if failing
            else f"the vendored checklist did not run: {vend['error']}"
        )
    elif vend["differences"]:
        problems.append(f"vendored verdicts differ from the record ({pin}): {vend['differences']}")
    up = checklist["upstream"]
    if up["error"] or up["exit_code"] not in (0, 1):
        problems.append(f"the upstream checklist could not run: {up['error']}")
    elif up["differences"]:
        notes.append(
            f"upstream verdicts differ from those recorded for {pin}: "
            + ", ".join(f"item {d['item']} {d['measured']} (recorded {d['expected']})" for d in up["differences"])
            + "; this run records them in compass_compat/verdicts.json: review that diff"
        )

    tests = junit_counts(work / "pytest.xml")
    selection = meta.get("tests", "full")
    if selection != "none":
        if tests is None:
            problems.append("the test run wrote no junit XML")
        elif tests["failed"]:
            problems.append(f"{tests['failed']} test(s) failed: " + ", ".join(tests["failed_tests"][:20]))
        elif tests["passed"] == 0:
            problems.append("the test run passed no test")

    gen: Dict[str, Any] = {}
    for name in ("vendored", "as_installed", "matrix"):
        text_file, rc_file = work / f"generate-{name}.txt", work / f"generate-{name}.rc"
        if not rc_file.is_file():
            continue
        rc = int(rc_file.read_text().strip() or "1")
        text = text_file.read_text(encoding="utf-8") if text_file.is_file() else ""
        gen[name] = {
            "exit_code": rc,
            "text": text.strip(),
            "sha256": hashlib.sha256(text.strip().encode("utf-8")).hexdigest() if rc == 0 else None,
        }
    matrix = gen.get("matrix")
    mine = gen.get("vendored")
    if mine is None or mine["exit_code"] != 0:
        problems.append("the default checkpoint's generate failed with the vendored copy")
    if matrix is None or matrix["exit_code"] != 0:
        problems.append("the matrix reference generate did not run; no hash to compare with")
    elif mine is not None and mine["sha256"] != matrix["sha256"]:
        problems.append(
            f"the generated text differs from the matrix's ({meta.get('matrix_env', '?')}): "
            f"{mine['text']!r} vs {matrix['text']!r}"
        )
    inst = gen.get("as_installed")
    if inst is not None and mine is not None and inst["sha256"] != mine["sha256"]:
        notes.append(
            f"as installed (upstream's cohere_compass live) the default checkpoint answers {inst['text']!r}, "
            f"not the vendored {mine['text']!r}"
        )

    if problems:
        code = EXIT_BROKE
    elif up["exit_code"] == 0:
        code = EXIT_REPLACE
    else:
        code = EXIT_KEEP
    upstream_fails = [k for k, v in up["verdicts"].items() if v != "PASS"]
    if code == EXIT_REPLACE:
        verdict = "upstream's cohere_compass passes every item: it can replace the vendored copy at this release"
    elif not up["verdicts"]:
        verdict = "no upstream verdict"
    elif up["verdicts"].get("1") == "FAIL":
        verdict = "keep the vendored copy: this release ships no cohere_compass"
    else:
        verdict = "keep the vendored copy: upstream fails item(s) " + ", ".join(upstream_fails)
    return {
        "mlx_vlm": version,
        "requested": meta.get("requested", version),
        "commit": meta.get("commit"),
        "date": meta.get("date"),
        "resolution": meta.get("resolution"),
        "requirements": meta.get("requirements"),
        "constraints": meta.get("constraints", []),
        "resolved": resolved,
        "python": meta.get("python"),
        "tests_selection": selection,
        "tests_command": meta.get("tests_command"),
        "checklist": checklist,
        "tests": tests,
        "generate": gen,
        "matrix_env": meta.get("matrix_env"),
        "seconds": meta.get("seconds", {}),
        "problems": problems,
        "notes": notes,
        "upstream_can_replace": code == EXIT_REPLACE,
        "verdict": verdict,
        "exit_code": code,
    }


def render_md(r: Dict[str, Any]) -> str:
    res = r["resolved"]
    lines = [
        f"# Pin bump: mlx-vlm {r['mlx_vlm']}",
        "",
        f"`bash scripts/pin_bump/pin_bump.sh {r['requested']}` on commit `{(r['commit'] or '?')[:12]}`, {r['date']}: "
        f"**exit {r['exit_code']}**: {r['verdict']}."
        + ("" if not r["problems"] else " Something of ours broke (below)."),
        "",
        "## What resolved",
        "",
        f"Resolution: {r['resolution']}.",
        "",
        f"Requirements: `{r['requirements']}`"
        + (f"; constraints: `{' '.join(r['constraints'])}`" if r["constraints"] else ""),
        "",
        "| mlx | mlx-vlm | mlx-lm | transformers | torch | Python |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {res['mlx']} | {res['mlx-vlm']} | {res['mlx-lm']} | {res['transformers']} | {res['torch']} | {r['python']} |",
        "",
        "## Checklist (`python -m pytest tests -m checklist`, reduced by `scripts/pin_bump/reduce.py`)",
        "",
    ]
    for impl in ("upstream", "vendored"):
        c = r["checklist"][impl]
        verdicts = c["verdicts"]
        items = sorted(verdicts, key=lambda s: int(s) if s.isdigit() else 10**6)
        passes = [i for i in items if verdicts[i] == "PASS"]
        fails = [i for i in items if verdicts[i] != "PASS"]
        lines.append(
            f"- **{impl}**: exit {c['exit_code']}"
            + (f", could not run: {c['error']}" if c["error"] else "")
            + f"; passes {', '.join(passes) or '-'}; fails {', '.join(fails) or '-'}"
            + (f" [{c['seconds']} s]" if c["seconds"] is not None else "")
        )
        if c["expected_from"] is None:
            lines.append("  - the record has no release at or below this one: nothing to compare with")
        elif c["differences"]:
            for d in c["differences"]:
                lines.append(
                    f"  - item {d['item']}: measured {d['measured']}, the record says {d['expected']} "
                    f"for {c['expected_from']}"
                )
        else:
            lines.append(f"  - every verdict equals the record's for {c['expected_from']}")
        for item, text in (c.get("evidence") or {}).items():
            short = text.replace("\n", " ")
            lines.append(f"  - {item}: {short[:300]}{'...' if len(short) > 300 else ''}")
    lines += ["", f"Upstream can replace the vendored copy: **{'yes' if r['upstream_can_replace'] else 'no'}**.", ""]
    t = r["tests"]
    lines += ["## Vendored test suite", ""]
    lines.append(f"Selection: {r['tests_selection']} (`{r['tests_command']}`).")
    lines.append("")
    if t is None:
        lines.append("No junit XML.")
    else:
        lines.append(
            f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped (junit counts xfails as skipped)."
        )
        for name in t["failed_tests"]:
            lines.append(f"- FAILED {name}")
    lines += ["", "## The default checkpoint's main job (`python -m compass_compat generate --no-verbose`)", ""]
    lines.append("| run | exit | sha256 (first 16) | text |")
    lines.append("| --- | --- | --- | --- |")
    labels = {
        "vendored": "this release, vendored live",
        "as_installed": "this release, as installed (upstream live where it ships)",
        "matrix": f"matrix env {r['matrix_env']}, same commit",
    }
    for name, g in r["generate"].items():
        lines.append(f"| {labels[name]} | {g['exit_code']} | {(g['sha256'] or '-')[:16]} | {g['text'][:80]!r} |")
    if r["problems"]:
        lines += ["", "## Problems (exit 2)", ""] + [f"- {p}" for p in r["problems"]]
    if r["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in r["notes"]]
    secs = r["seconds"]
    if secs:
        lines += ["", "Seconds: " + ", ".join(f"{k} {v}" for k, v in secs.items()) + "."]
    return "\n".join(lines) + "\n"


def cmd_report(work: str, out_base: str) -> int:
    report = build_report(Path(work))
    base = Path(out_base)  # "<dir>/0.7.11": a version, not a suffix
    base.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{base}.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    Path(f"{base}.md").write_text(render_md(report), encoding="utf-8")
    print(report["exit_code"])
    return 0


SWEEP_HEADER = (
    "| release | resolution | mlx | mlx-lm | transformers | vendored text sha256 | = matrix | tests | "
    "upstream verdict | exit | commit |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
)


def sweep_cell_resolution(text: Optional[str]) -> str:
    """ "recipe 0.6.3", "own metadata (0.6.3's recipe conflicts: transformers)" or "host"."""
    text = text or "?"
    own = re.match(r"own metadata \(recipe (\S+) conflicts with .*?: (.*)\)$", text)
    if own:
        names = [n for n in own.group(2).split() if n != "mlx-vlm"] or ["?"]
        return f"own metadata ({own.group(1)}'s recipe conflicts: {', '.join(names)})"
    return text.split(":")[0]


def cmd_sweep_row(report_json: str, table: str) -> int:
    r = json.loads(Path(report_json).read_text(encoding="utf-8"))
    path = Path(table)
    if not path.exists() or SWEEP_HEADER.splitlines()[0] not in path.read_text(encoding="utf-8"):
        with open(path, "a", encoding="utf-8") as f:
            f.write(SWEEP_HEADER)
    res, t = r["resolved"], r["tests"]
    mine, matrix = r["generate"].get("vendored"), r["generate"].get("matrix")
    same = "-" if not (mine and matrix and mine["sha256"]) else ("yes" if mine["sha256"] == matrix["sha256"] else "NO")
    tests = "-" if t is None else f"{t['passed']}/{t['failed']}/{t['skipped']}"
    up = r["checklist"]["upstream"]["verdicts"]
    fails = [k for k, v in up.items() if v != "PASS"]
    if not up:
        upstream = "not run"
    elif up.get("1") == "FAIL":
        upstream = "none shipped"
    else:
        upstream = "all pass" if not fails else "fails " + ",".join(fails)
    row = (
        f"| {r['mlx_vlm']} | {sweep_cell_resolution(r['resolution'])} | {res['mlx']} | {res['mlx-lm']} | "
        f"{res['transformers']} | {((mine or {}).get('sha256') or '-')[:16]} | {same} | {tests} | {upstream} | "
        f"{r['exit_code']} | {(r['commit'] or '?')[:8]} |\n"
    )
    # Rows kept in release order whatever order the sweep ran them in.
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    head = [line for line in lines if not re.match(r"^\| \d", line)]
    rows = [line for line in lines if re.match(r"^\| \d", line)] + [row]
    rows.sort(key=lambda line: Version(line.split("|")[1].strip()))
    path.write_text("".join(head + rows), encoding="utf-8")
    print(row, end="")
    return 0


def cmd_rebuild(reports: str, table: str) -> int:
    """Rewrite the table's rows from every report in ``reports`` (the header is kept)."""
    path = Path(table)
    head = [
        line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if not re.match(r"^\| \d", line)
    ]
    path.write_text("".join(head), encoding="utf-8")
    for report in sorted(Path(reports).glob("*.json")):
        cmd_sweep_row(str(report), table)
    return 0


def cmd_spread() -> int:
    """Releases (stdin, oldest first) reordered so any prefix covers the range evenly: every 8th,
    then every 4th, every 2nd, the rest (an interrupted sweep still spans the range)."""
    releases = [line.strip() for line in sys.stdin if line.strip()]
    order: List[str] = []
    for step in (8, 4, 2, 1):
        order += [r for i, r in enumerate(releases) if i % step == 0 and r not in order]
    if releases and releases[-1] in order:
        order.remove(releases[-1])
        order.insert(1, releases[-1])  # the newest early: it is what a pin bump is about
    print("\n".join(order))
    return 0


def main(argv: List[str]) -> int:
    commands = {
        "latest": (cmd_latest, 0),
        "releases": (cmd_releases, 2),
        "conflicts": (cmd_conflicts, 0),
        "report": (cmd_report, 2),
        "sweep-row": (cmd_sweep_row, 2),
        "spread": (cmd_spread, 0),
        "rebuild": (cmd_rebuild, 2),
    }
    if argv and argv[0] == "recipe-env":
        return cmd_recipe_env(*argv[1:])
    if not argv or argv[0] not in commands or len(argv) - 1 != commands[argv[0]][1]:
        print(__doc__, file=sys.stderr)
        return 2
    func, _ = commands[argv[0]]
    return func(*argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__: Tuple[str, ...] = ("build_report", "render_md", "expected_block", "nearest_pin")
