"""Fail when a JUnit report from pytest holds no test, or a skip whose reason no allowed pattern matches.

usage: check_skips.py REPORT.xml ALLOWED_SKIPS
ALLOWED_SKIPS: one regular expression per line (searched in the skip reason); '#' starts a comment.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET


def main(report: str, allowed_file: str) -> int:
    patterns = [re.compile(line.strip()) for line in open(allowed_file, encoding="utf-8")
                if line.strip() and not line.lstrip().startswith("#")]
    cases = list(ET.parse(report).getroot().iter("testcase"))
    if not cases:
        print("ci: the report lists no test", file=sys.stderr)
        return 1
    bad = []
    allowed = 0
    for case in cases:
        for skip in case.findall("skipped"):
            if skip.get("type") == "pytest.xfail":
                continue
            reason = skip.get("message") or skip.text or ""
            if any(p.search(reason) for p in patterns):
                allowed += 1
            else:
                where = "::".join(filter(None, (case.get("classname"), case.get("name"))))
                bad.append(f"{where}: {reason}")
    print(f"ci: {len(cases)} tests, {allowed} allowed skips, {len(bad)} unexpected skips")
    for line in bad:
        print(f"ci: unexpected skip: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
