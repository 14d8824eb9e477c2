"""Print the third-party requirements of every workspace package, one per line.

The Makefile installs these from the registry, then installs the workspace's
own packages with `--no-deps`: some of their names (zcore, zcomm) belong to
unrelated projects on PyPI and must never be resolved from the index.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def manifests() -> list[Path]:
    return [
        ROOT / "pyproject.toml",
        ROOT / "native" / "pyproject.toml",
        *sorted(ROOT.glob("packages/*/pyproject.toml")),
    ]


def main() -> int:
    local: set[str] = set()
    reqs: list[str] = []
    for path in manifests():
        data = tomllib.loads(path.read_text())
        local.add(data["project"]["name"])
        reqs += data["project"].get("dependencies", [])
        reqs += data.get("dependency-groups", {}).get("dev", [])
    seen: set[str] = set()
    for req in reqs:
        name = re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()
        if name not in local and req not in seen:
            seen.add(req)
            print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main())
