"""`kvslim bench peers`' rounds with fake engines: the engines take turns round by round, one that
cannot start or fails is reported with its reason, the ratios come from the same run's medians,
and the command writes its JSON, markdown and plot. No timing is asserted."""
import json

import pytest

from kvslim_lab.bench.machine import Bandwidth
from kvslim_lab.bench.peers import catalog
from kvslim_lab.bench.peers.render import markdown
from kvslim_lab.bench.peers.suite import PeersPlan, Unavailable, run_peers
from kvslim_lab.bench.workload import Workload
from kvslim.cli.main import main
from kvslim.errors import KvslimError


class Fake:
    def __init__(self, name, tpots, offline, log, fail_in=None, unavailable=None):
        self.name, self.label = name, f"fake {name}"
        self.tpots, self.off, self.log = list(tpots), list(offline), log
        self.fail_in, self.unavailable, self.calls, self.closed = fail_in, unavailable, 0, False

    def start(self):
        if self.unavailable:
            raise Unavailable(self.unavailable)

    def decode(self, prompt, output_len):
        self.log.append(("decode", self.name, len(prompt), output_len))
        self.calls += 1
        if self.fail_in == self.calls:
            raise RuntimeError("boom\nsecond line")
        return self.tpots.pop(0)

    def offline(self, prompts, output_len):
        self.log.append(("offline", self.name, len(prompts), output_len))
        return self.off.pop(0)

    def close(self):
        self.closed = True


PLAN = PeersPlan(Workload(1, 5, 3), Workload(4, 5, 6), rounds=3)
PROMPTS = {"decode": [[1] * 5], "offline": [[2] * 5] * 4}


def _run(engines):
    return run_peers(engines, PROMPTS, PLAN, {"cpu": "test"}, {"read_gb_s": 1.0}, 1,
                     show_progress=False)


def test_engines_take_turns_round_by_round_on_the_same_prompts():
    log = []
    a = Fake("kvslim-q4_1", [0.01] * 3, [{"cb": 100.0}] * 3, log)
    b = Fake("llamacpp-q4_0", [0.02] * 3, [{"-npl 4": 50.0}] * 3, log)
    _run([a, b])
    expected = []
    for _ in range(3):
        expected += [("decode", "kvslim-q4_1", 5, 3), ("decode", "llamacpp-q4_0", 5, 3),
                     ("offline", "kvslim-q4_1", 4, 6), ("offline", "llamacpp-q4_0", 4, 6)]
    assert log == expected
    assert a.closed and b.closed


def test_a_plan_without_offline_runs_batch_1_decode_only():
    log = []
    a = Fake("kvslim-f32", [0.01] * 2, [], log)
    d = run_peers([a], {"decode": [[1] * 5]}, PeersPlan(Workload(1, 5, 3), None, rounds=2),
                  {}, {}, 1, show_progress=False).to_dict()
    assert log == [("decode", "kvslim-f32", 5, 3)] * 2
    assert d["plan"]["offline"] is None and d["engines"][0]["status"] == "ran"
    assert d["engines"][0]["offline"]["output_tokens_per_s"] is None


def test_medians_best_setting_and_ratios_from_the_same_run():
    log = []
    own = Fake("kvslim-q4_1", [0.010, 0.020, 0.008], [{"cb": 90.0}, {"cb": 100.0}, {"cb": 95.0}],
               log)
    peer = Fake("llamacpp-q4_0", [0.004, 0.005, 0.004],
                [{"-npl 4": 40.0, "-npl 16": 120.0}, {"-npl 4": 60.0, "-npl 16": 110.0},
                 {"-npl 4": 50.0, "-npl 16": 130.0}], log)
    d = _run([own, peer]).to_dict()
    e_own, e_peer = d["engines"]
    assert e_own["decode"]["tokens_per_s"] == 100.0 and e_own["decode"]["tpot_ms"] == 10.0
    assert e_own["decode"]["tpot_ms_runs"] == [10.0, 20.0, 8.0]
    assert e_peer["offline"]["best_setting"] == "-npl 16"
    assert e_peer["offline"]["output_tokens_per_s"] == 120.0
    assert e_peer["offline"]["runs"]["-npl 4"] == [40.0, 60.0, 50.0]
    assert d["ratios"]["decode"] == {"kvslim-q4_1/llamacpp-q4_0": round(100 / 250, 2)}
    assert d["ratios"]["offline"] == {"kvslim-q4_1/llamacpp-q4_0": round(95 / 120, 2)}
    assert set(d) == {"command", "started", "seconds", "threads", "machine", "bandwidth",
                      "plan", "engines", "ratios", "serving"}
    assert d["plan"]["offline"]["num_prompts"] == 4 and d["plan"]["rounds"] == 3
    json.dumps(d)


def test_an_engine_that_cannot_start_or_fails_is_reported_not_fatal():
    log = []
    own = Fake("kvslim-f32", [0.01] * 3, [{"cb": 10.0}] * 3, log)
    absent = Fake("vllm-bf16", [], [], log, unavailable="no vLLM venv given")
    flaky = Fake("hf-f32", [0.05] * 3, [{"batch 8": 5.0}] * 3, log, fail_in=2)
    d = _run([own, absent, flaky]).to_dict()
    by = {e["engine"]: e for e in d["engines"]}
    assert [e["engine"] for e in d["engines"]] == ["kvslim-f32", "vllm-bf16", "hf-f32"]
    assert by["vllm-bf16"]["status"] == "skipped"
    assert by["vllm-bf16"]["reason"] == "no vLLM venv given"
    assert not any(name == "vllm-bf16" for _, name, *_ in log)
    assert by["hf-f32"]["status"] == "ran"                    # round 1 kept
    assert by["hf-f32"]["reason"] == "failed in round 2 (decode): RuntimeError: boom"
    assert by["hf-f32"]["decode"]["tpot_ms_runs"] == [50.0]
    assert flaky.closed
    assert len(by["kvslim-f32"]["decode"]["tpot_ms_runs"]) == 3
    assert set(d["ratios"]["decode"]) == {"kvslim-f32/hf-f32"}
    text = markdown(d)
    assert "skipped: no vLLM venv given" in text and "failed in round 2" in text


def test_engine_names_and_families():
    assert catalog.parse_engines("llamacpp,kvslim-f32") == [
        "llamacpp-q4_0", "llamacpp-q4_1", "llamacpp-q8_0", "llamacpp-f32", "kvslim-f32"]
    assert catalog.parse_engines("") == list(catalog.ENGINES)
    with pytest.raises(KvslimError, match="unknown engine 'tgi'"):
        catalog.parse_engines("hf,tgi")


def test_the_command_writes_json_markdown_and_plot(tmp_path, monkeypatch, capsys):
    log = []
    monkeypatch.setattr(catalog, "build", lambda names, opts: [
        Fake(n, [0.01] * 2, [{"s": 10.0 + i}] * 2, log) for i, n in enumerate(names)])
    monkeypatch.setattr(catalog, "prompts", lambda plan: {
        "decode": [[1] * plan.decode.input_len],
        "offline": [[2] * plan.offline.input_len] * plan.offline.num_prompts})
    monkeypatch.setattr("kvslim_lab.bench.machine.memory_bandwidth", lambda: Bandwidth(1.0, 2.0, 8))
    rc = main(["bench", "peers", "--engines", "kvslim-q4_1,hf", "--rounds", "2",
               "--num-prompts", "2", "--input-len", "16", "--output-len", "16",
               "--decode-len", "8", "--out", str(tmp_path), "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d == json.loads((tmp_path / "peers.json").read_text())
    assert [e["engine"] for e in d["engines"]] == ["kvslim-q4_1", "hf-f32"]
    assert d["ratios"]["offline"] == {"kvslim-q4_1/hf-f32": round(10 / 11, 2)}
    assert ("offline", "hf-f32", 2, 16) in log and ("decode", "hf-f32", 16, 8) in log
    assert (tmp_path / "peers.png").stat().st_size > 0
    assert "| fake hf-f32 |" in (tmp_path / "peers.md").read_text()
