"""Print `name==version` lines of a hash-pinned lock (the constraints that keep pins on relock)."""

import re
import sys
from pathlib import Path

path = Path(sys.argv[1])
if path.is_file():
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+==[^\s\\;]+)", line)
        if m:
            print(m.group(1))
