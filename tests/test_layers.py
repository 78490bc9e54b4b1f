"""The layer rules of DESIGN.md that a test can check: cache/ and sched/ never import torch,
and no layer imports one above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "radixserve"
ORDER = ["cache", "sched", "model", "sim", "engine", "server", "router"]


def test_cache_sched_and_sim_import_without_torch():
    code = (
        "import sys, radixserve.cache, radixserve.sched, radixserve.sim.replay; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "radixserve" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ORDER else None


def test_no_layer_imports_a_layer_above_it():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        own = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if own not in ORDER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                target = _layer(node.module)
                if target is not None:
                    assert ORDER.index(target) <= ORDER.index(own), f"{rel} imports {node.module}"


def test_nothing_but_the_cli_imports_the_router():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "router" or rel.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("radixserve.router"), f"{rel} imports it"
