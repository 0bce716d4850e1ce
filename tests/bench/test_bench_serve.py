"""`hybridmoe bench serve`: the summary on fixed records, the loopback guard, the workload generator, and runs
against the real server (`hybridmoe serve` on the demo model, started as a subprocess)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from hybridmoe.bench._serving.records import RequestRecord
from hybridmoe.bench._serving.report import SLO, format_summary, summarize
from hybridmoe.bench._serving.server import ServerError, ServerProcess, check_loopback
from hybridmoe.bench._serving.workload import (CHAT, COMPLETIONS, WORDS, Workload, WorkloadSpec, poisson_arrivals,
                                               words_text)
from hybridmoe.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- summary --------------------------------------------------------------------------------------------

def _ok(index, kind, ttft, tpot, out, prompt):
    return RequestRecord(index, kind, user=0, turn=1, start_s=float(index), status="ok", ttft_s=ttft, tpot_s=tpot,
                         e2e_s=ttft + (tpot or 0) * (out - 1), prompt_tokens=prompt, output_tokens=out)


def _records():
    return [_ok(0, "chat", 0.1, 0.01, 11, 100), _ok(1, "chat", 0.2, 0.02, 21, 200), _ok(2, "chat", 0.3, 0.03, 31, 300),
            _ok(3, "chat", 0.4, 0.06, 11, 400), _ok(4, "long", 40.0, None, 1, 500),
            RequestRecord(5, "chat", 1, 1, 5.0, status="error", error="HTTP 500: boom"),
            RequestRecord(6, "long", 2, 0, 6.0, status="cancelled")]


def test_summary_of_fixed_records():
    s = summarize(_records(), duration_s=10.0)
    assert (s["requests"], s["completed"], s["failed"], s["cancelled"]) == (7, 5, 1, 1)
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_token_throughput"] == pytest.approx(7.5)  # 75 tokens of the finished requests / 10 s
    assert s["prompt_token_throughput"] == pytest.approx(150.0)
    # linear interpolation between the 5 TTFTs and the 4 TPOTs (the 1-token reply has none)
    assert s["ttft_s"] == pytest.approx({"mean": 8.2, "p50": 0.3, "p90": 24.16, "p99": 38.416})
    assert s["tpot_s"] == pytest.approx({"mean": 0.03, "p50": 0.025, "p90": 0.051, "p99": 0.0591})
    assert s["e2e_s"]["p50"] == pytest.approx(1.0)  # of 0.1+0.1, 0.2+0.4, 0.3+0.9, 0.4+0.6, 40
    # of the 6 finished or failed: 3 meet both targets; TTFT misses 40 s and the failure; TPOT 60 ms and the failure
    assert s["slo"] == pytest.approx({"ttft_s": 30.0, "tpot_s": 0.05, "attainment": 3 / 6,
                                      "ttft_attainment": 4 / 6, "tpot_attainment": 4 / 6})
    assert s["by_kind"]["long"]["completed"] == 1 and s["by_kind"]["long"]["prompt_tokens_mean"] == 500
    assert s["by_kind"]["chat"]["output_tokens_mean"] == pytest.approx(18.5)


def test_slo_targets_are_settable():
    assert summarize(_records(), 10.0, SLO(ttft_s=50.0, tpot_s=0.1))["slo"]["attainment"] == pytest.approx(5 / 6)
    assert summarize(_records(), 10.0, SLO(ttft_s=0.15, tpot_s=0.1))["slo"]["attainment"] == pytest.approx(1 / 6)


def test_summary_without_finished_requests():
    s = summarize([RequestRecord(0, "chat", 0, 1, 0.0, status="error", error="x")], duration_s=1.0)
    assert s["ttft_s"]["p50"] is None and s["slo"]["attainment"] == 0.0 and s["request_throughput"] == 0.0
    assert "TTFT (s)" in format_summary(s)


def test_printed_table():
    text = format_summary(summarize(_records(), duration_s=10.0))
    ttft_row = next(line for line in text.splitlines() if line.startswith("TTFT (s)"))
    assert ttft_row.split()[2:] == ["8.200", "0.300", "24.160", "38.416"]
    tpot_row = next(line for line in text.splitlines() if line.startswith("TPOT (ms)"))
    assert tpot_row.split()[2:] == ["30.0", "25.0", "51.0", "59.1"]
    assert "50.0% of requests" in text and "1 failed, 1 cancelled" in text


# ---- loopback guard -------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.5.6.7:1/", "http://localhost:8000",
                                 "http://[::1]:8000", "https://127.0.0.1"])
def test_loopback_urls_are_accepted(url):
    assert check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com:8000", "http://0.0.0.0:8000",
                                 "http://127.0.0.1.example.com", "http://localhost.example.com:80",
                                 "http://[2001:db8::1]:80", "ftp://127.0.0.1", "127.0.0.1:8000"])
def test_other_urls_are_refused(url):
    with pytest.raises(ValueError, match="loopback|this machine"):
        check_loopback(url)


def test_cli_refuses_a_remote_url(capsys):
    assert main(["bench", "serve", "--url", "http://192.168.1.10:8000"]) == 2
    assert "not this machine" in capsys.readouterr().err


# ---- workload -------------------------------------------------------------------------------------------

def test_poisson_arrivals():
    times = poisson_arrivals(4.0, 20001, random.Random(1))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) > 0
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean
    assert poisson_arrivals(4.0, 50, random.Random(1)) == times[:50]
    assert poisson_arrivals(4.0, 50, random.Random(2)) != times[:50]


def test_open_loop_arrivals_follow_the_rate():
    spec = WorkloadSpec(concurrency=None, rate=2.0, num_requests=5000, seed=3)
    times = Workload(spec).arrival_times()
    assert len(times) == 5000 and times == Workload(spec).arrival_times()
    assert times[-1] / (len(times) - 1) == pytest.approx(0.5, rel=0.05)


def test_a_chat_grows_turn_by_turn_and_restarts():
    spec = WorkloadSpec(turns=3, seed=5)
    user = Workload(spec).new_user()
    first = user.next_request("chat")
    assert first.endpoint == CHAT and first.turn == 1
    assert [m["role"] for m in first.body["messages"]] == ["system", "user"]
    user.finished(first, "reply one")
    second = user.next_request("chat")
    assert second.turn == 2
    assert second.body["messages"][:2] == first.body["messages"]  # the history is sent again, as a prefix
    assert second.body["messages"][2] == {"role": "assistant", "content": "reply one"}
    assert second.body["messages"][3]["role"] == "user"
    user.finished(second, None)  # a failed turn is taken back
    third = user.next_request("chat")
    assert third.turn == 2 and [m["role"] for m in third.body["messages"]] == ["system", "user", "assistant", "user"]
    user.finished(third, "reply two")
    fourth = user.next_request("chat")
    user.finished(fourth, "reply three")
    assert fourth.turn == 3 and len(fourth.body["messages"]) == 6
    fifth = user.next_request("chat")  # after `turns` turns: a new conversation, same system prompt
    assert fifth.turn == 1 and len(fifth.body["messages"]) == 2
    assert fifth.body["messages"][0] == first.body["messages"][0]
    assert fifth.body["messages"][1] != first.body["messages"][1]


def test_a_long_prompt_leaves_the_chat_alone():
    user = Workload(WorkloadSpec(long_tokens=100, seed=0)).new_user()
    chat = user.next_request("chat")
    user.finished(chat, "hi")
    long = user.next_request("long")
    user.finished(long, "text")
    assert long.endpoint == COMPLETIONS and long.turn == 0 and "messages" not in long.body
    assert user.next_request("chat").turn == 2
    with pytest.raises(ValueError, match="unknown request kind"):
        user.next_request("poem")


def test_system_prompts_are_shared_across_users():
    workload = Workload(WorkloadSpec(system_prompts=2, system_tokens=50, seed=7))
    users = [workload.new_user() for _ in range(4)]
    systems = [u.next_request("chat").body["messages"][0]["content"] for u in users]
    assert systems[0] == systems[2] != systems[1] == systems[3]
    turns = [u.messages[1]["content"] for u in users]
    assert len(set(turns)) == 4  # each user's own turn after the shared prompt


def test_the_workload_is_seeded():
    def first_requests(seed):
        workload = Workload(WorkloadSpec(long_fraction=0.5, seed=seed))
        users = [workload.new_user() for _ in range(3)]
        return [u.next_request(u.draw_kind()).body for u in users for _ in range(3)]

    assert first_requests(1) == first_requests(1)
    assert first_requests(1) != first_requests(2)


def test_the_mix_follows_long_fraction():
    user = Workload(WorkloadSpec(long_fraction=0.25, seed=11)).new_user()
    kinds = [user.draw_kind() for _ in range(8000)]
    assert kinds.count("long") / len(kinds) == pytest.approx(0.25, abs=0.015)
    assert Workload(WorkloadSpec(long_fraction=0.0)).new_user().draw_kind() == "chat"


def test_prompts_are_sized_by_characters_per_token():
    text = words_text(random.Random(0), 500, 4.0)
    assert 2000 <= len(text) < 2000 + max(map(len, WORDS)) + 2
    assert len(words_text(random.Random(0), 500, 3.0)) < len(text)
    long = Workload(WorkloadSpec(long_tokens=300, chars_per_token=2.5)).new_user().next_request("long")
    assert 750 <= len(long.body["prompt"]) < 800


@pytest.mark.parametrize("bad", [dict(concurrency=2, rate=1.0), dict(concurrency=None), dict(concurrency=0),
                                 dict(num_requests=0), dict(long_fraction=1.5), dict(duration_s=-1)])
def test_bad_workloads_are_refused(bad):
    with pytest.raises(ValueError):
        WorkloadSpec(**bad)


# ---- against the real server ----------------------------------------------------------------------------

def test_a_server_that_dies_at_start_is_reported_with_its_output(tmp_path):
    with pytest.raises(ServerError, match="exited with status") as error:
        with ServerProcess(str(tmp_path / "no-such-model"), startup_timeout_s=120):
            pass
    assert "no-such-model" in str(error.value).split("its last lines:")[1]  # the server's own error message


@pytest.mark.slow
def test_bench_serve_starts_the_server_and_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    # seed 0 at these sizes: user 0 sends chat turns only, user 1 a long prompt first
    code = main(["bench", "serve", "--num-requests", "6", "--concurrency", "2", "--long-fraction", "0.3",
                 "--long-tokens", "120", "--system-tokens", "40", "--turn-tokens", "16", "--max-tokens", "8",
                 "--seed", "0", "--duration", "300", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "TTFT (s)" in printed and "requests/s" in printed
    report = json.loads(out.read_text())
    summary, records = report["summary"], report["requests"]
    assert (summary["completed"], summary["failed"], summary["cancelled"]) == (6, 0, 0)
    assert report["settings"]["workload"]["concurrency"] == 2 and report["settings"]["server"]["started_by_bench"]
    assert {r["kind"] for r in records} == {"long", "chat"}
    for r in records:
        assert r["status"] == "ok" and r["prompt_tokens"] > 0 and 1 <= r["output_tokens"] <= 8
        assert 0 < r["ttft_s"] <= r["e2e_s"]
    chats = sorted((r["user"], r["turn"], r["prompt_tokens"]) for r in records if r["kind"] == "chat")
    later = [(a, b) for a, b in zip(chats, chats[1:]) if a[0] == b[0] and b[1] == a[1] + 1]
    assert later and all(b[2] > a[2] for a, b in later)  # a conversation's next turn carries its history
    assert png.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow
def test_open_loop_run_against_a_running_server(tmp_path, capsys):
    with ServerProcess("demo") as server:
        code = main(["bench", "serve", "--url", server.url.replace("127.0.0.1", "localhost"), "--rate", "4",
                     "--num-requests", "5", "--long-fraction", "0", "--system-tokens", "40", "--turn-tokens", "16",
                     "--max-tokens", "4", "--json", str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr()
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["settings"]["workload"]["rate"] == 4.0 and not report["settings"]["server"]["started_by_bench"]
    assert report["summary"]["completed"] == 5 and all(r["kind"] == "chat" for r in report["requests"])
