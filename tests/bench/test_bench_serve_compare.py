"""`hybridmoe bench serve --compare`: the settings and their flags, the engine counters' arithmetic, the side-by-side
table, and a run against real servers (`hybridmoe serve` on the demo model, overlap on and off)."""

from __future__ import annotations

import json

import pytest

from hybridmoe.bench._serving import compare
from hybridmoe.bench._serving.report import summarize
from hybridmoe.bench._serving.records import RequestRecord
from hybridmoe.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_settings_are_every_combination_on_first():
    assert compare.settings(["overlap"]) == [("overlap on", ["--overlap", "on"]), ("overlap off", ["--no-overlap"])]
    both = compare.settings(["overlap", "pd"])
    assert [label for label, _ in both] == ["overlap on, pd on", "overlap on, pd off", "overlap off, pd on",
                                            "overlap off, pd off"]
    assert both[0][1] == ["--overlap", "on", "--pd"] and both[3][1] == ["--no-overlap"]


def test_comparisons_need_the_servers_flags(monkeypatch):
    flags = {"--overlap", "--no-overlap"}
    monkeypatch.setattr(compare, "serve_flags", lambda: flags)
    assert compare.parse("overlap") == ["overlap"]
    with pytest.raises(ValueError, match="no --pd flag yet"):
        compare.parse("overlap,pd")
    flags.add("--pd")
    assert compare.parse("overlap, pd") == ["overlap", "pd"]
    with pytest.raises(ValueError, match="unknown comparison 'tp'"):
        compare.parse("tp")
    with pytest.raises(ValueError, match="distinct"):
        compare.parse("overlap,overlap")


def test_the_real_serve_has_the_overlap_flags():
    assert {"--overlap", "--no-overlap"} <= compare.serve_flags()


def test_engine_delta_is_decode_tokens_over_decode_seconds():
    before = {"engine_steps": 10, "engine_tokens": 40, "engine_step_seconds": 1.0, "cpu_experts_seconds": 0.5,
              "cpu_experts_wait_seconds": 0.25}
    after = {"engine_steps": 30, "engine_tokens": 120, "engine_step_seconds": 3.0, "cpu_experts_seconds": 1.5,
             "cpu_experts_wait_seconds": 0.45}
    delta = compare.engine_delta(before, after)
    assert delta["decode_tok_s"] == pytest.approx(40.0) and delta["decode_step_ms"] == pytest.approx(100.0)
    assert delta["cpu_experts_ms_per_step"] == pytest.approx(50.0)
    assert delta["cpu_waited_ms_per_step"] == pytest.approx(10.0)
    assert compare.engine_delta({}, {})["decode_tok_s"] is None  # no decode step (a server without RunStats)
    plain = compare.engine_delta({}, {"engine_steps": 5, "engine_tokens": 20, "engine_step_seconds": 1.0})
    assert plain["decode_tok_s"] == 20.0 and plain["cpu_experts_ms_per_step"] is None  # not timed off hybrid


def test_the_table_puts_settings_side_by_side_with_their_ratio():
    def ok(i, tpot):
        return RequestRecord(i, "chat", 0, 1, float(i), status="ok", ttft_s=0.5, tpot_s=tpot, e2e_s=1.0,
                             prompt_tokens=10, output_tokens=11)

    fast, slow = summarize([ok(0, 0.01), ok(1, 0.01)], 2.0), summarize([ok(0, 0.02)], 2.0)
    table = compare.format_table(["overlap on", "overlap off"], [fast, slow],
                                 [{"decode_tok_s": 150.0}, {"decode_tok_s": 100.0}])
    lines = {line[:28].strip(): line[28:].split() for line in table.splitlines()[1:]}
    assert lines["decode tok/s in the engine"] == ["150.0", "100.0", "1.50x"]
    assert lines["TPOT p50 (ms)"] == ["10.0", "20.0", "0.50x"]
    assert lines["completed / failed"] == ["2", "/", "0", "1", "/", "0"]
    assert lines["CPU experts per step (ms)"] == ["-", "-"]


def test_compare_refuses_a_url(capsys):
    assert main(["bench", "serve", "--compare", "overlap", "--url", "http://127.0.0.1:9"]) == 2


def test_compare_runs_both_settings_and_reports_them(tmp_path, capsys):
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    code = main(["bench", "serve", "--compare", "overlap", "--num-requests", "4", "--concurrency", "4",
                 "--long-fraction", "0", "--system-tokens", "30", "--turn-tokens", "12", "--max-tokens", "8",
                 "--seed", "0", "--duration", "300", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "overlap on" in printed and "overlap off" in printed and "decode tok/s in the engine" in printed
    report = json.loads(out.read_text())
    assert [c["setting"] for c in report["combined"]] == ["overlap on", "overlap off"]
    assert [r["flags"] for r in report["runs"]] == [["--overlap", "on"], ["--no-overlap"]]
    for combined in report["combined"]:
        assert combined["summary"]["completed"] == 4
        engine = combined["engine"]
        # 4 users decoding: the engine's decode steps computed the requests' tokens after the first
        assert engine["decode_steps"] > 0 and engine["decode_tokens"] >= engine["decode_steps"]
        assert engine["decode_tok_s"] > 0
    assert png.read_bytes()[:8] == PNG_SIGNATURE
