"""The command line as a user runs it: generate (streaming + speed line), chat, demo, and clear errors."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from hybridmoe.cli import main

SPEED_LINE = re.compile(r"prompt tokens: \d+ \| output tokens: \d+ \| time to first token: [\d.]+ s \| "
                        r"prefill: [\d.]+ tok/s \| decode: [\d.]+ tok/s")


def test_generate_streams_and_reports_speed(tiny_model_dir, capsys):
    model = str(tiny_model_dir("deepseek_v3"))
    assert main(["generate", "--model", model, "--prompt", "The quick brown fox", "--max-tokens", "8",
                 "--ignore-eos", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and SPEED_LINE.search(err)
    assert "output tokens: 8" in err


def test_chat_reads_turns_until_exit(tiny_model_dir, capsys, monkeypatch):
    model = str(tiny_model_dir("qwen3_moe"))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nand again\n/exit\n"))
    assert main(["chat", "--model", model, "--max-tokens", "4", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    assert out.count("assistant> ") == 2 and len(SPEED_LINE.findall(err)) == 2


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path, tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "no config.json in model directory" in capsys.readouterr().err
    model = str(tiny_model_dir("mixtral"))
    assert main(["generate", "--model", model, "--prompt", "hi", "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_runs_with_no_arguments(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_CACHE", str(tmp_path))  # the random fallback, if the trained model is absent
    assert main(["demo", "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert "architecture: DeepseekV3ForCausalLM" in err and len(SPEED_LINE.findall(err)) == 2


def test_a_closed_output_pipe_stops_quietly():
    """`hybridmoe info | head -1`: when the reader has gone, the command stops with SIGPIPE's status (141) and
    no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout fails with EPIPE
    try:
        result = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "info"], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr
