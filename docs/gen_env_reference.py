"""Generates docs/reference/environment.md from common/env.py: every ``KVGRID_*`` environment variable.

    .venv/bin/python docs/gen_env_reference.py

writes, for every ``Var`` of ``common.env.ALL``, its name, type, default and what it does. tests/e2e/test_docs.py
checks that the committed page equals what this renders, and that it names every ``KVGRID_*`` variable the code
(common/, worker/, router/) mentions.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: common/ is importable
    sys.path.insert(0, str(ROOT))

from common.env import ALL, NODE_SCRIPT_VARS, Var  # noqa: E402

OUTPUT = ROOT / "docs" / "reference" / "environment.md"
COMMAND = ".venv/bin/python docs/gen_env_reference.py"


def _entry(var: Var) -> list[str]:
    doc = var.doc if var.doc.endswith(".") else var.doc + "."
    return [f"### `{var.name}`", "", f"- Type: {var.type}", f"- Default: {var.default}", "", doc, ""]


def render() -> str:
    lines = [
        "# Environment variables",
        "",
        f"<!-- Generated from common/env.py by `{COMMAND}`; do not edit by hand. -->",
        "",
        "Every `KVGRID_*` environment variable kvgrid reads. The Python code reads them all through",
        "`common/env.py`; the cluster launcher's node script (`router/control/node.sh`) reads the last group.",
        "",
        "## kvgrid",
        "",
    ]
    for var in ALL:
        if var not in NODE_SCRIPT_VARS:
            lines += _entry(var)
    lines += ["## The cluster node script (`router/control/node.sh`)", ""]
    for var in NODE_SCRIPT_VARS:
        lines += _entry(var)
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main() -> None:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
