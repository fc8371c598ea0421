"""bench/elastic_bench.py's arithmetic on fixed timelines: the recovery time of an
in-memory event and of a relaunch, the steps redone, the throughput after the shrink
against the fresh 2-rank runs, and the report's met / NOT met against the targets."""

import json

from bench import elastic_bench as eb

BATCH = 1000


def write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def steps(first, last, t0, dt, world, launch=1, rows=0):
    return [{"t": t0 + (s - first) * dt, "step": s, "world": world, "launch": launch,
             "rows": rows} for s in range(first, last + 1)]


def test_an_in_memory_event(tmp_path):
    tl = tmp_path / "timeline"
    # 3 ranks at 0.1 s a step to step 30, the fault at t=103.05, step 31 on 2 ranks at 105
    write(tl.with_suffix(".rank0"), steps(1, 30, 100.1, 0.1, 3) + steps(31, 60, 105.0, 0.05, 2))
    write(tl.with_suffix(".rank2"), steps(1, 30, 100.1, 0.1, 3, rows=500)[:-1] +
          [{"t": 103.0, "step": 30, "world": 3, "launch": 1, "rows": 600, "dirty": 42}])
    (tmp_path / "out.json").write_text(json.dumps({"events": [{"rows_reverted": 7}],
                                                   "seen": [[3, 2]]}))
    res = eb.analyse("kill", str(tl), str(tmp_path / "out.json"), "", 103.05, BATCH, 60)
    assert abs(res["recovery_s"] - 1.95) < 1e-9 and res["in_memory_first_step"] == 31
    assert res["lost_rank_rows"] == 600 and res["lost_rank_rows_changed_since_save"] == 42
    assert res["rate_window"] == [36, 60] and abs(res["rate_after"] - 20000) < 1e-6
    assert "relaunch_first_step_s" not in res


def test_a_relaunch_counts_the_steps_redone(tmp_path):
    tl = tmp_path / "timeline"
    # lost after step 30; relaunched from the step-20 checkpoint: step 21 at t=120
    write(tl.with_suffix(".rank0"), steps(1, 30, 100.1, 0.1, 3) +
          steps(21, 60, 120.0, 0.05, 2, launch=2))
    text = ("kv.callbacks.Checkpoint: restored ckpt-0000000020 from /x/ck (step 20; a full "
            "checkpoint) in 0.5s\nkvcollrun: lost host(s) h3: relaunching on 2 rank(s)")
    res = eb.analyse("relaunch", str(tl), str(tmp_path / "none.json"), text, 103.05, BATCH, 60)
    assert abs(res["recovery_s"] - 16.95) < 1e-9 and res["steps_redone"] == 10
    assert res["restored"] == [{"checkpoint": "ckpt-0000000020", "step": 20}]
    assert res["relaunched"] and "in_memory_first_step_s" not in res


def test_the_report_says_met_and_not_met():
    # fresh runs: 100,000 samples/s to step 30, then 80,000 (a); 125,000 throughout (b)
    ta = [i * 0.01 for i in range(30)] + [0.29 + i * 0.0125 for i in range(1, 31)]
    fresh = [{"kind": "fresh", "samples_per_sec": 1.0, "others_busy_cores": 1.0,
              "step_times": {"first": 1, "t": t}} for t in (ta, [i * 0.008 for i in range(60)])]
    kill = {"kind": "kill", "recovery_s": 4.0, "in_memory_first_step_s": 4.0,
            "rate_after": 98_000.0, "rate_window": [36, 60], "global_batch": BATCH,
            "events": [{"detect_s": 0.1, "rows_reverted": 9}], "steps": 60, "kill_at": 30}
    stop = {"kind": "stop", "recovery_s": 11.0, "in_memory_first_step_s": 11.0,
            "rate_after": 90_000.0, "rate_window": [36, 60], "global_batch": BATCH,
            "events": [{}]}
    s = eb.summary([fresh[0], kill, stop, fresh[1]])
    k = s["events"]["kill"]     # over steps 36-60 the fresh runs did 80,000 and 125,000
    assert [round(x) for x in k["fresh_same_steps"]] == [80_000, 125_000]
    assert abs(k["throughput_ratio"] - 98_000 / 102_500) < 1e-9
    assert k["met"] and k["throughput_met"]
    assert not s["events"]["stop"]["met"] and not s["events"]["stop"]["throughput_met"]
    md = eb.markdown([fresh[0], kill, stop, fresh[1]], {"cpu": "X", "cores": 2}, "cmd", None)
    row = next(line for line in md.splitlines() if line.startswith("| SIGKILL, in memory |"))
    assert "| <= 5 s | met |" in row and "| 9 |" in row
    row = next(line for line in md.splitlines() if line.startswith("| SIGSTOP"))
    assert "| <= 10 s | NOT met |" in row
    assert "95.6%" in md and "87.8%" in md and "No plot" in md


def test_a_repeated_event_is_compared_with_the_fresh_runs_beside_it():
    def fresh(dt):
        return {"kind": "fresh", "step_times": {"first": 1, "t": [i * dt for i in range(60)]}}
    kill = {"kind": "kill", "rate_after": 90_000.0, "rate_window": [36, 60],
            "global_batch": BATCH, "events": [{}]}
    recs = [fresh(0.01), dict(kill), fresh(0.01), dict(kill), fresh(0.0125)]
    s = eb.summary(recs)
    assert list(s["events"]) == ["kill", "kill #2"]
    assert abs(s["events"]["kill"]["throughput_ratio"] - 0.9) < 1e-9         # 100,000
    assert abs(s["events"]["kill #2"]["throughput_ratio"] - 1.0) < 1e-9      # 100k and 80k
    md = eb.markdown(recs, {}, "cmd", None)
    assert "| after: SIGKILL, in memory #2 (steps [36, 60]) |" in md
