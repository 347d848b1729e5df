"""``bench tune``: one knob at a time over real server processes (the fake server script),
the best value kept, the report written, a killed run resumed, no server left behind."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from inflight.bench.__main__ import main
from inflight.bench.knob_flags import check_port, flag_value, parse_knob, set_flag
from inflight.bench.tune import choose, slo_usage

SCRIPT = pathlib.Path(__file__).with_name("bench_fake_openai.py")
REPO = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tune_args(port: int, report: pathlib.Path, data_dir) -> list[str]:
    # One slot of 80 ms serves 12.5 req/s, four serve 50; a 0.3 s TTFT breaks the 0.2 s SLO.
    # (Low rates: the fake servers and the client must keep their timing on a busy machine.)
    base = f"{sys.executable} {SCRIPT} --port {port} --service 0.08 --slots 1 --ttft 0.0"
    return ["tune", "--base-url", f"http://127.0.0.1:{port}", "--data-dir", str(data_dir), "--disable-tqdm",
            "--input-len", "4", "--output-len", "2", "--tokenize", "approx", "--num-prompts", "8",
            "--arrival", "constant", "--duration", "0.5", "--warmup-duration", "0.1", "--drain-timeout", "0.5",
            "--slo", "ttft_p50=0.2", "--rate-start", "5", "--rate-max", "40", "--tolerance", "1.0",
            "--max-points", "3", "--serve-cmd", base, "--knob", "slots=1,4", "--knob", "ttft=0.0,0.3",
            "--server-start-timeout", "30", "--server-log-dir", str(report / "logs"), "--report", str(report)]


def test_knob_parsing_and_choice():
    assert parse_knob("--max-num-seqs=8,16, 32") == ("max-num-seqs", ["8", "16", "32"])
    with pytest.raises(ValueError):
        parse_knob("max-num-seqs")
    assert set_flag(["serve", "--x", "1", "--y", "2"], "x", "3") == ["serve", "--x", "3", "--y", "2"]
    assert set_flag(["serve", "--x=1"], "x", "1") == ["serve", "--x", "1"]
    assert set_flag(["serve", "--enable-p"], "enable-p", "off") == ["serve", "--no-enable-p"]
    assert set_flag(["serve"], "block-size", "32") == ["serve", "--block-size", "32"]

    class R:
        def __init__(self, mean, ttft_hi=1.5, itl_hi=0.4):  # upper 95 % bounds at the limit (s)
            self.spread = {"mean": mean}
            slo = {"ttft_p95": {"hi": ttft_hi, "target": 2.0}, "itl_p95": {"hi": itl_hi, "target": 1.0}}
            self.best_point = None if mean is None else {"evidence": {"slo": slo}}
    results = {"8": R(2.0), "16": R(3.0), "32": R(3.0), "64": R(None)}
    assert choose(results, current="32", by_scale=False) == "32"  # a tie keeps the current value
    assert choose(results, current="8", by_scale=False) == "16"  # else the first listed
    # Trace replay: the smaller time scale is the higher load.
    assert choose({"a": R(0.5), "b": R(0.25)}, None, by_scale=True) == "b"
    # A tie goes to clearly more room under the tightest target: 128 uses 56 % (TTFT 1.12 of
    # 2 s), 256 uses 99 %; 5 % less is noise, and the current value stays.
    assert slo_usage(R(4.2, ttft_hi=1.12)) == pytest.approx(0.56)
    assert slo_usage(R(4.2, ttft_hi=0.2, itl_hi=0.9)) == pytest.approx(0.9)  # the tightest of the two
    assert choose({"128": R(4.2, ttft_hi=1.12), "256": R(4.2, ttft_hi=1.98)}, "256", False) == "128"
    assert choose({"128": R(4.2, ttft_hi=1.9), "256": R(4.2, ttft_hi=1.98)}, "256", False) == "256"
    assert choose({"128": R(4.0, ttft_hi=0.1), "256": R(4.2, ttft_hi=1.98)}, "256", False) == "256"


LLAMA = ["llama-server", "-m", "m.gguf", "-np", "16", "-c", "8192", "--port", "8090"]


def test_knobs_of_llama_server_in_long_or_short_spelling():
    """A knob named by the long or the short form replaces the flag in the spelling the
    command uses, never appending a duplicate; the command's own value gives the same command."""
    assert parse_knob("parallel=8,16,32") == ("parallel", ["8", "16", "32"])
    assert parse_knob("np=8,16") == parse_knob("-np=8,16") == parse_knob("--parallel=8,16") == ("parallel", ["8", "16"])
    assert parse_knob("-x=1,2") == ("-x", ["1", "2"])  # an unknown short flag stays one
    for name in ("parallel", "np", "-np"):
        assert set_flag(LLAMA, name, "32") == ["llama-server", "-m", "m.gguf", "-np", "32", "-c", "8192",
                                               "--port", "8090"]
        assert set_flag(LLAMA, name, "16") == LLAMA
        assert flag_value(LLAMA, name) == "16"
    long_form = ["llama-server", "--parallel", "16", "--ctx-size=8192"]
    assert set_flag(long_form, "np", "8") == ["llama-server", "--parallel", "8", "--ctx-size=8192"]
    assert set_flag(long_form, "c", "4096") == ["llama-server", "--parallel", "16", "--ctx-size", "4096"]
    # Both spellings given: the first is set, the other dropped with its value.
    assert set_flag(["llama-server", "-np", "4", "--parallel", "16"], "parallel", "8") == ["llama-server", "-np", "8"]
    assert set_flag(["llama-server"], "np", "8") == ["llama-server", "--parallel", "8"]  # absent: the long form
    assert set_flag(["s", "-ngl", "99"], "gpu-layers", "0") == ["s", "-ngl", "0"]  # three spellings
    # Switches: -cb / -nocb keep their short form; on/off as a value (-fa) stays a value.
    assert set_flag(["s", "-cb", "-np", "4"], "cont-batching", "off") == ["s", "-nocb", "-np", "4"]
    assert set_flag(["s", "--no-cont-batching"], "cb", "on") == ["s", "--cont-batching"]
    assert flag_value(["s", "-cb", "-np", "4"], "cb") == "on" and flag_value(["s", "-nocb"], "cont-batching") == "off"
    assert set_flag(["s", "-fa", "auto"], "flash-attn", "on") == ["s", "-fa", "on"]
    assert set_flag(["s"], "fa", "off") == ["s", "--flash-attn", "off"]
    assert flag_value(["s", "--x", "-1"], "x") == "-1"  # a negative number is a value, not a flag
    # vLLM's short forms.
    assert set_flag(["vllm", "serve", "m", "-tp", "2"], "tensor-parallel-size", "4") == ["vllm", "serve", "m",
                                                                                          "-tp", "4"]


def test_the_served_command_must_listen_at_base_url():
    check_port(LLAMA, "http://127.0.0.1:8090")
    with pytest.raises(ValueError, match="port 8090"):
        check_port(LLAMA, "http://127.0.0.1:8000")
    check_port(["serve", "--port=8001"], "http://127.0.0.1:8001")
    # llama-server listens on 8080 without --port.
    check_port(["/opt/llama/bin/llama-server", "-m", "m.gguf"], "http://127.0.0.1:8080")
    with pytest.raises(ValueError, match="8080 .no --port given"):
        check_port(["/opt/llama/bin/llama-server", "-m", "m.gguf"], "http://127.0.0.1:8000")
    check_port(["inflight", "serve"], "http://127.0.0.1:8000")


def test_tune_picks_the_best_value_per_knob_and_resumes(data_dir, tmp_path, capsys):
    port = free_port()
    report = tmp_path / "report"
    args = tune_args(port, report, data_dir)
    # Run 1 in a child process, terminated once its first configuration saved a point.
    proc = subprocess.Popen([sys.executable, "-m", "inflight.bench", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = report / "tune-state.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (state.exists() and '"passed"' in state.read_text()):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert port_free(port), "the terminated bench left its server running"
    saved = json.loads(state.read_text())["configs"]
    assert len(saved) == 1 and next(iter(saved.values()))["points"]

    # Run 2 continues: the saved points are replayed, the rest measured.
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "(saved point)" in err
    doc = json.loads((report / "tune.json").read_text())
    slots, ttft = doc["knobs"]
    assert slots["knob"] == "slots" and slots["base_value"] == "1" and slots["best"] == "4"
    by_value = {v["value"]: v for v in slots["values"]}
    # 12.5 req/s for one slot: 5 and 10 pass, 20 fails; four slots pass 20, the cap of 3 points.
    assert by_value["1"]["limits"] == [10.0] and by_value["1"]["failed_above"] == [20.0]
    assert by_value["4"]["limits"] == [20.0] and by_value["4"]["bounded"] is False
    assert "throughput" in by_value["1"]["curve"][-1]["evidence"]["causes"]
    assert ttft["best"] == "0.0"
    assert {v["value"]: v["limits"] for v in ttft["values"]} == {"0.0": [20.0], "0.3": [None]}
    assert any("no load passed" in w and "ttft_p50" in w for w in ttft["why"])
    rec = doc["recommended"]
    assert rec["command"].endswith("--slots 4 --ttft 0.0")
    # Values are ranked on their searches; the recommendation's limit is then held.
    assert rec["held"] is True and rec["limits"] == [20.0]
    holds = [p for p in rec["curve"] if p["held"]]
    assert [(h["x"], h["passed"]) for h in holds] == [(20.0, True)]
    assert holds[0]["evidence"]["window"]["seconds"] >= 2.5  # 5 x the 0.5 s window
    assert all(not p["held"] for k in doc["knobs"] for v in k["values"] for p in v["curve"])
    # Only one knob varied at a time: every command differs from the base in at most the
    # knobs already decided plus the one being tuned.
    commands = {v["command"] for k in doc["knobs"] for v in k["values"]}
    assert len(commands) == 3  # slots=4 with ttft=0.0 is measured once, not twice
    assert sorted(p.name for p in (report / "logs").iterdir()) == ["server-recommended.log", "server-slots=1.log",
                                                                   "server-slots=4.log", "server-ttft=0.3.log"]
    page = (report / "report.md").read_text()
    for section in ("## Result", "## One knob at a time", "## Workload", "## SLO", "## Machine",
                    "## Latency against load", "## At the limit", "## Every point"):
        assert section in page
    assert "Operating limit: 20 req/s**, held for" in page
    for png in ("lengths.png", "capacity.png", "at_limit.png", "latency_vs_load-slots.png",
                "latency_vs_load-ttft.png"):
        assert (report / png).stat().st_size > 10_000, png
    assert port_free(port)

    # Run 3: everything saved, so no server starts at all.
    assert main(args) == 0
    assert "starting:" not in capsys.readouterr().err


def test_sigterm_stops_the_capacity_server(data_dir, tmp_path):
    port = free_port()
    cmd = f"{sys.executable} {SCRIPT} --port {port} --service 0.001"
    proc = subprocess.Popen([sys.executable, "-m", "inflight.bench", "capacity", "--base-url",
                             f"http://127.0.0.1:{port}", "--data-dir", str(data_dir), "--disable-tqdm",
                             "--tokenize", "approx", "--input-len", "4", "--output-len", "2",
                             "--slo", "ttft_p50=1", "--duration", "30", "--serve-cmd", cmd],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and port_free(port):
        time.sleep(0.1)
    assert not port_free(port), "the server never started"
    time.sleep(1.0)  # into the first point
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert time.monotonic() - t0 < 20
    assert port_free(port)
    assert b"terminated" in proc.stderr.read()
    proc.stderr.close()


def test_server_dies_with_a_killed_bench(data_dir, tmp_path):
    """SIGKILL leaves no cleanup to run: the server gets SIGTERM from the kernel instead."""
    if sys.platform != "linux":
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    port = free_port()
    cmd = f"{sys.executable} {SCRIPT} --port {port}"
    proc = subprocess.Popen([sys.executable, "-m", "inflight.bench", "capacity", "--base-url",
                             f"http://127.0.0.1:{port}", "--data-dir", str(data_dir), "--disable-tqdm",
                             "--tokenize", "approx", "--slo", "ttft_p50=1", "--duration", "30",
                             "--serve-cmd", cmd], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and port_free(port):
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not port_free(port):
        time.sleep(0.2)
    assert port_free(port), "a SIGKILLed bench left its server running"
