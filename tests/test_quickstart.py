"""The README's Quick start is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_quickstart_has_two_commands_and_ci_runs_the_test_one():
    commands = quickstart_commands()
    assert len(commands) == 2
    main_job, test_command = commands
    assert "radixserve serve" in main_job
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines
