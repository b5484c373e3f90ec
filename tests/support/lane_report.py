"""A CI lane's verdict from pytest's JUnit XML: it fails where pytest skipped any test or ran fewer than it
must (a lane that ran nothing must not pass). python tests/support/lane_report.py LANE XML PYTEST_RC WANT"""
import sys
import xml.etree.ElementTree as ET

lane, xml, rc, want = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
try:
    root = ET.parse(xml).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"{lane}: FAILED: no test report from pytest ({e}; pytest exit status {rc})")
cases = list(root.iter("testcase"))
skipped = [c.get("classname") + "::" + c.get("name") for c in cases if c.find("skipped") is not None]
if skipped or len(cases) < want:
    sys.exit(f"{lane}: FAILED: {len(cases)} test(s) reported, {len(skipped)} skipped {skipped}; "
             f"the lane must run (at least {want}) and skip none")
print(f"{lane}: {len(cases)} test(s) ran, none skipped (pytest exit status {rc})", file=sys.stderr)
