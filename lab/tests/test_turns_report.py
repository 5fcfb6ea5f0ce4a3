"""The turns verdict report marks the levels and schedules that miss issue 19's bars."""

import json

from gateway_lab.turns_report import main


def level(c, agg, p50=1.0, p99=2.0):
    return {"concurrency": c, "aggregate_tps": agg, "e2e_p50_s": p50, "e2e_p99_s": p99,
            "per_request_tps": agg / c}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_a_level_below_095_of_the_best_single_server_is_marked(tmp_path, capsys):
    meta = {"workload": "chat", "hardware": "hw", "method": "steady"}
    results = {"pair-turns": [level(1, 100), level(64, 90)],
               "single-plain": [level(1, 50), level(64, 100)],
               "single-adaptive": [level(1, 100), level(64, 60)]}
    assert main([write(tmp_path, "a.json", {"meta": meta, "results": results})]) == 0
    out = capsys.readouterr().out
    assert "| pair-turns | 1.00 (adaptive) | 0.90 ✗ (plain) |" in out


def test_session_traffic_is_judged_on_e2e_p50_and_p99(tmp_path, capsys):
    meta = {"workload": "agentic", "hardware": "hw", "method": "steady"}
    results = {"pair-turns": [level(8, 1, p50=1.0, p99=2.2)],
               "single-mtp": [level(8, 1, p50=1.2, p99=2.0)]}
    main([write(tmp_path, "b.json", {"meta": meta, "results": results})])
    assert "0.83 (mtp) / 1.10 ✗ (mtp)" in capsys.readouterr().out


def test_a_schedule_needs_five_percent_more_tokens_than_every_single_server(tmp_path, capsys):
    def phase(c, agg):
        return {"concurrency": c, "aggregate_tps": agg, "per_request_tps": agg / c}

    meta = {"workload": "seed", "hardware": "hw", "schedule": "4:10,64:10"}
    results = [{"target": "pair-turns", "tokens": 1060, "phases": [phase(4, 100), phase(64, 900)]},
               {"target": "single-plain", "tokens": 900, "phases": [phase(4, 50), phase(64, 900)]},
               {"target": "single-adaptive-tuned", "tokens": 1040,
                "phases": [phase(4, 100), phase(64, 850)]}]
    main([write(tmp_path, "c.json", {"meta": meta, "results": results})])
    out = capsys.readouterr().out
    assert "plain 1.178, adaptive-tuned 1.019 ✗" in out
    assert "C=4 1.00 |" in out and "C=64" not in out.split("| pair-turns |")[1]
