"""The curl examples of README.md and docs/serving.md work as written: run with curl against a server named `demo`
(the tiny model under that name), the port swapped for the test's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import running_server, tiny_engine

ROOT = Path(__file__).resolve().parents[2]


def _curl_commands(path: Path) -> list[str]:
    """Every `curl ...` command of the file's bash blocks, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip().startswith("curl "):
                commands.append(command.strip())
    return commands


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_examples(model_dir):
    commands = _curl_commands(ROOT / "README.md") + _curl_commands(ROOT / "docs" / "serving.md")
    assert len(commands) >= 5
    with running_server(tiny_engine(model_dir), served_model_name="demo") as server:
        port = server.url.rsplit(":", 1)[1]
        for command in commands:
            command = command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            result = subprocess.run(command + " --silent --show-error --fail-with-body --max-time 60", shell=True,
                                    capture_output=True, text=True, timeout=90)
            assert result.returncode == 0, (command, result.stdout, result.stderr)
            body = result.stdout
            if "/metrics" in command:
                assert "hybridmoe:kv_blocks_used" in body
            elif '"stream": true' in command:
                assert body.rstrip().endswith("data: [DONE]")
            else:
                assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
