"""The command line as a user runs it: generate (streaming + speed line), chat, demo, and clear errors."""

from __future__ import annotations

import importlib.metadata
import io
import os
import re
import subprocess
import sys

import pytest

from hybridmoe.checkpoint.default_model import default_model_dir, resolve_model_dir
from hybridmoe.cli import build_parser, main
from hybridmoe.commands._generation import build_engine
from hybridmoe.runtime.tokenizer import load_tokenizer

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


def test_the_demo_model_is_the_default_model_and_named_demo(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDMOE_CACHE", str(tmp_path))  # the random fallback, if the trained model is absent
    demo = default_model_dir()
    assert resolve_model_dir("demo") == resolve_model_dir(None) == demo
    for argv in (["generate", "--prompt", "x"], ["chat"], ["demo"], ["quantize", "--to", "int4", "--out", "o"]):
        assert build_parser().parse_args(argv).model == "demo"
    prompt = "A man was reading"
    assert main(["generate", "--prompt", prompt, "--max-tokens", "2"]) == 0
    assert f"prompt tokens: {len(load_tokenizer(demo).encode(prompt))} |" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
    assert main(["chat", "--model", "demo", "--max-tokens", "2"]) == 0
    assert len(SPEED_LINE.findall(capsys.readouterr().err)) == 1
    assert main(["plan", "--model", "demo", "--vram", "24GB", "--hardware", "rtx4090,epyc-genoa-2s"]) == 0
    assert capsys.readouterr().out.startswith(f"Plan: {demo.name} on rtx4090+epyc-genoa-2s")


def test_demo_gqa_names_the_companion_and_its_absence_is_a_clear_error(capsys, tmp_path, monkeypatch):
    assert main(["generate", "--model", "demo-gqa", "--prompt", "Love is", "--max-tokens", "1"]) == 0
    assert capsys.readouterr().out == " a\n"  # the companion's greedy start (MODEL_CARD.md, its samples), by a wide margin
    assert main(["plan", "--model", "demo-gqa", "--vram", "24GB", "--hardware", "rtx4090,epyc-genoa-2s"]) == 0
    assert capsys.readouterr().out.startswith("Plan: gqa_model on rtx4090+epyc-genoa-2s")
    monkeypatch.setattr("hybridmoe.checkpoint.default_model.GQA_ASSET_DIR", tmp_path / "gqa_model")
    assert main(["generate", "--model", "demo-gqa", "--prompt", "x"]) == 2
    assert f"demo-gqa: this installation has no {tmp_path / 'gqa_model'}" in capsys.readouterr().err


def test_engine_options_and_empty_prompts_are_error_lines(tiny_model_dir, capsys):
    model = str(tiny_model_dir("deepseek_v3"))
    for flags, message in ((["--kv-cache-gb", "100000"], "error: kv_cache_gb=100000 is more than this machine can "
                                                         "hold: "),
                           (["--kv-cache-gb", "-1"], "error: kv_cache_gb must be a number > 0"),
                           (["--prompt", ""], "error: the prompt is empty")):
        assert main(["generate", "--model", model, "--prompt", "hi", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err


def test_no_prefix_caching_turns_it_off(tiny_model_dir):
    model = str(tiny_model_dir("deepseek_v3"))
    for command in (["generate", "--prompt", "x"], ["chat"], ["demo"]):
        assert build_parser().parse_args(command).enable_prefix_caching is True
        assert build_parser().parse_args([*command, "--no-prefix-caching"]).enable_prefix_caching is False
    engine = build_engine(build_parser().parse_args(["generate", "--model", model, "--prompt", "x",
                                                     "--no-prefix-caching", "--kv-cache-gb", "0.01"]))
    assert engine.config.enable_prefix_caching is False and not engine.scheduler.block_manager.enable_prefix_caching


def test_version_is_the_installed_packages(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"hybridmoe {importlib.metadata.version('hybridmoe')}\n"


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
