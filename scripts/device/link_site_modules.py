"""On the GPU machine: make MODULE of the SGLang bundle (/tmp/site) importable in the test process by
linking it, and whatever top-level modules it turns out to need that the test process lacks, into TARGET
(put TARGET first on PYTHONPATH). Only missing modules are linked, so the test process's own packages are
never shadowed. Prints what it linked and, if the import still fails, why.

    python3 scripts/device/link_site_modules.py /tmp/xgsite xgrammar
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SITE = Path("/tmp/site")


def main() -> int:
    target, module = Path(sys.argv[1]), sys.argv[2]
    target.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{target}:{os.environ.get('PYTHONPATH', '')}"}
    wanted, linked = module, []
    for _ in range(12):
        for path in SITE.glob(f"{wanted}*"):
            if path.name == wanted or path.name.startswith((f"{wanted}.", f"{wanted}-")):
                (target / path.name).unlink(missing_ok=True)
                (target / path.name).symlink_to(path)
                linked.append(path.name)
        done = subprocess.run(
            [sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True
        )
        if done.returncode == 0:
            print(f"{module} importable; linked {linked}")
            return 0
        missing = re.search(r"No module named '([\w]+)", done.stderr)
        if missing is None or not any(SITE.glob(f"{missing.group(1)}*")):
            print(f"{module} not importable; linked {linked}:\n{done.stderr[-1500:]}")
            return 1
        wanted = missing.group(1)
    print(f"{module} not importable after linking {linked}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
