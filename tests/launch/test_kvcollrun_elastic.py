"""launch/kvcollrun --elastic (launch/supervisor.py) against stand-ins for mpirun and for
the remote-launch agent: what it runs, what it refuses, and when it relaunches.

- bad input gets an error naming it, before anything runs: --min-np > --max-np, a
  discovery script that fails or prints garbage, a hostfile line that is not one, a
  host that cannot be reached at the start, too few slots;
- a launch runs mpirun with --with-ft ulfm, the hosts and their slots, the ranks and
  KVCOLL_ELASTIC_MIN_NP exported;
- a job that lost a host (the ranks' "kvcoll-elastic" lines, or mpirun's own report, and
  mpirun may even exit 0 then) is relaunched on the hosts that are left, which it
  says; one whose survivors stopped below --min-np, or where a rank raised an ordinary
  error, is not; too few hosts left is an error with the reason;
- the SLURM and MPIJob examples run kvcollrun --elastic (their commands, run here with
  stand-ins for SLURM's and the operator's environment).
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
KVCOLLRUN = ROOT / "launch" / "kvcollrun"

# A stand-in for mpirun: records its arguments (one JSON line per launch in $LOG); what
# it prints and its exit code come from $SCRIPT, one JSON object per launch in order:
# {"print": [lines], "code": N}.
MPIRUN = f"""#!{sys.executable}
import json, os, sys
log = os.environ["LOG"]
with open(log, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "min_np": os.environ.get("KVCOLL_ELASTIC_MIN_NP")}}) + "\\n")
n = sum(1 for _ in open(log))
plan = json.loads(open(os.environ["SCRIPT"]).read())
step = plan[min(n, len(plan)) - 1]
for line in step.get("print", []):
    print(line, flush=True)
sys.exit(step.get("code", 0))
"""

# A stand-in for ssh or srun: `agent [options] HOST true` succeeds for the hosts in
# $HOSTS_UP.
AGENT = f"""#!{sys.executable}
import os, sys
if sys.argv[-3:-1] == ["kill", "-9"]:           # kvcollrun kills a lost rank
    open(os.environ["LOG"] + ".kill", "a").write(" ".join(sys.argv[1:]) + "\\n")
    sys.exit(0)
host = sys.argv[-2]
if host in os.environ["HOSTS_UP"].split():
    sys.exit(0)
sys.stderr.write(f"agent: cannot reach {{host}}\\n")
sys.exit(255)
"""


def tool(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def launch(tmp_path, args, plan=({"code": 0},), hosts_up="a b c", timeout=60):
    log = tmp_path / "log"
    script = tmp_path / "plan.json"
    script.write_text(json.dumps(list(plan)))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCOLL", "SLURM_", "OMPI_", "PRTE_"))}
    env.update(MPIRUN=str(tool(tmp_path, "mpirun", MPIRUN)), LOG=str(log), SCRIPT=str(script),
               HOSTS_UP=hosts_up, KVCOLLRUN_KILL_AFTER="2")
    agent = tool(tmp_path, "agent", AGENT)
    cmd = [str(KVCOLLRUN), "--elastic", "--prtemca", "plm_ssh_agent", str(agent), *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                         check=False)
    runs = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return out.returncode, out.stdout + out.stderr, runs


def value(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("args,said", [
    (["--min-np", "3", "--max-np", "2"], "--min-np 3 is more than --max-np 2"),
    (["--min-np", "0"], "--min-np must be >= 1"),
    (["--min-np", "x"], "--min-np must be an integer, got 'x'"),
    (["--min-np", "2", "-np", "1"], "-np 1 is outside [--min-np 2"),
    (["-H", "a:2", "--hostfile", "h"], "give the hosts one way"),
    (["-H", "a:x"], "'a:x' is not `host:slots or host`"),
    (["-H", "a:1,b:1", "--min-np", "3"], "fewer than --min-np 3"),
    (["-H", "a:1,zz:1"], "zz: `"),
    (["--heartbeat-period", "1", "--heartbeat-timeout", "2"], "must be more than 3"),
])
def test_bad_input_gets_an_error_naming_it(tmp_path, args, said):
    code, out, runs = launch(tmp_path, [*args, sys.executable, "train.py"])
    assert code == 2 and said in out and not runs, out


def test_a_discovery_script_that_fails_or_prints_garbage(tmp_path):
    fails = tool(tmp_path, "fails.sh", "#!/bin/sh\necho 'no inventory service' >&2\nexit 3\n")
    code, out, runs = launch(tmp_path, ["--host-discovery-script", str(fails), "true"])
    assert code == 2 and "failed with exit code 3: no inventory service" in out and not runs
    garbage = tool(tmp_path, "garbage.sh", "#!/bin/sh\necho a:2\necho 'b slots 4'\n")
    code, out, runs = launch(tmp_path, ["--host-discovery-script", str(garbage), "true"])
    assert code == 2 and "line 2: 'b slots 4' is not `host:slots or host`" in out, out
    empty = tool(tmp_path, "empty.sh", "#!/bin/sh\n")
    code, out, _ = launch(tmp_path, ["--host-discovery-script", str(empty), "true"])
    assert code == 2 and "printed no host" in out
    code, out, _ = launch(tmp_path, ["--host-discovery-script", str(tmp_path / "none"), "true"])
    assert code == 2 and "not an executable file" in out
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=two\n")
    code, out, _ = launch(tmp_path, ["--hostfile", str(hostfile), "true"])
    assert code == 2 and "line 2: 'b slots=two' is not `host [slots=N]`" in out, out


def test_an_unreachable_host_is_named_at_the_start(tmp_path):
    code, out, runs = launch(tmp_path, ["-H", "a:1,b:1,c:1", "true"], hosts_up="a c")
    assert code == 2 and not runs, out
    assert re.search(r"cannot be reached at start: b: .* exited with 255: agent: cannot "
                     r"reach b", out), out


def test_a_launch_runs_mpirun_with_ulfm_the_hosts_and_min_np(tmp_path):
    disc = tool(tmp_path, "d.sh", "#!/bin/sh\necho a:2\necho b\necho c:4 # big\n")
    code, out, runs = launch(tmp_path, ["--min-np", "2", "--max-np", "5",
                                        "--host-discovery-script", str(disc),
                                        sys.executable, "train.py", "--min-np", "9"])
    assert code == 0, out
    (run,) = runs
    argv = run["argv"]
    assert argv[argv.index("--with-ft") + 1] == "ulfm"
    assert value(argv, "--host") == "a:2,b:1,c:2" and value(argv, "-np") == "5"
    assert "KVCOLL_ELASTIC_MIN_NP" in argv and run["min_np"] == "2"
    assert argv[-3:] == ["train.py", "--min-np", "9"]       # the program's own flags stay
    assert "--oversubscribe" not in argv and "--elastic" not in argv
    mca = {tuple(argv[i + 1:i + 3]) for i, a in enumerate(argv) if a in ("--mca", "--prtemca")}
    assert {("mpi_ft_detector", "true"), ("mpi_ft_detector_thread", "true"),
            ("mpi_ft_detector_period", "0.5"), ("mpi_ft_detector_timeout", "2.5"),
            ("oob_tcp_keepalive_time", "2"), ("oob_tcp_keepalive_probes", "5"),
            ("mpi_ft_propagator_with_rbcast", "true")} <= mca, mca


def test_fault_settings_given_on_the_command_line_win(tmp_path):
    code, out, (run,) = launch(tmp_path, ["--heartbeat-period", "1", "--heartbeat-timeout",
                                          "5", "--mca", "mpi_ft_detector_thread", "false",
                                          "-H", "a:1", "true"])
    argv = run["argv"]
    pairs = [tuple(argv[i + 1:i + 3]) for i, a in enumerate(argv) if a == "--mca"]
    assert ("mpi_ft_detector_thread", "false") in pairs and \
        ("mpi_ft_detector_thread", "true") not in pairs
    assert ("mpi_ft_detector_timeout", "5") in pairs and ("mpi_ft_detector_period", "1") in pairs


def test_the_processes_the_survivors_went_on_without_are_killed(tmp_path):
    lost = ('[1,0]<stderr>: kvcoll-elastic {"event": "lost", "mode": "in-memory", "ranks": '
            '[1, 2], "hosts": ["b", "c"], "procs": [["b", 4242], ["c", 77]]}')
    plan = [{"print": [lost, lost, '[1,0]<stderr>: kvcoll-elastic {"event": "exit"}']}]
    code, out, _ = launch(tmp_path, ["-H", "a:1,b:1,c:1", "true"], plan)
    assert code == 0, out
    for _ in range(100):
        killed = (tmp_path / "log.kill").read_text().splitlines() \
            if (tmp_path / "log.kill").exists() else []
        if len(killed) == 2:
            break
        time.sleep(0.05)
    assert sorted(k.split()[-4:] for k in killed) == [["b", "kill", "-9", "4242"],
                                                       ["c", "kill", "-9", "77"]], killed


def test_a_lost_process_on_this_host_is_killed_without_a_kill_binary(tmp_path):
    # (a minimal Debian has no /bin/kill: kvcollrun once ran it, failed in silence, and
    # a stopped rank on the launching host outlived the job, so mpirun never exited)
    sys.path.insert(0, str(KVCOLLRUN.parent))
    import socket

    from supervisor import kill_lost

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    said = []
    path = os.environ["PATH"]
    os.environ["PATH"] = str(tmp_path)          # no kill, no anything
    try:
        kill_lost([(socket.gethostname(), victim.pid)], ["false"], said.append).join(10)
    finally:
        os.environ["PATH"] = path
    assert victim.wait(timeout=10) == -9
    assert said == [f"killed the lost process {victim.pid} on {socket.gethostname()}"]


LOST_C = ('[1,0]<stderr>: kvcoll-elastic {"event": "lost", "mode": "relaunch", '
          '"ranks": [2], "hosts": ["c"]}')
DAEMON_LOST_B = ("prterun has lost communication with a remote daemon.\n"
                 "  Remote daemon: [prterun-vm-1@1,2] on node b ")


def test_a_lost_host_is_relaunched_on_the_hosts_left(tmp_path):
    abort = "[1,0]<stderr>: kvcoll: rank 0 raised PeerLostError; aborting the job"
    plan = [{"print": [LOST_C, abort], "code": 1},
            # Open MPI's runtime ends the job on a lost daemon, and mpirun exits 0
            {"print": [DAEMON_LOST_B], "code": 0},
            {"print": ['[1,0]<stderr>: kvcoll-elastic {"event": "exit", "rank": 0}'],
             "code": 0}]
    code, out, runs = launch(tmp_path, ["--min-np", "1", "--cooldown", "600",
                                        "-H", "a:1,b:1,c:1", "true"], plan)
    assert code == 0, out
    assert [value(r["argv"], "--host") for r in runs] == ["a:1,b:1,c:1", "a:1,b:1", "a:1"]
    assert [value(r["argv"], "-np") for r in runs] == ["3", "2", "1"]
    assert "lost host(s) c: relaunching on 2 rank(s) (a:1, b:1) from the latest " \
           "checkpoint" in out, out
    assert "lost host(s) b: relaunching on 1 rank(s)" in out
    assert "the job recovered and finished (3 launch(es))" in out


def test_a_job_whose_start_failed_on_a_peer_is_launched_again(tmp_path):
    # (CI once saw kv.init's first collective fail under kvcollrun --elastic: a peer was
    # taken for lost before anything had begun; nothing is lost by starting again)
    failed = ('[1,2]<stderr>: kvcoll-elastic {"event": "start_failed", "error": "rank 2/3: '
              'dup (a new communicator: every rank must create it) failed: MPI_ERR_INTERN"}')
    start = '[1,0]<stderr>: kvcoll-elastic {"event": "start", "rank": 0}'
    plan = [{"print": [failed], "code": 1},
            {"print": [start, '[1,0]<stderr>: kvcoll-elastic {"event": "exit", "rank": 0}']}]
    code, out, runs = launch(tmp_path, ["-H", "a:1,b:1,c:1", "true"], plan)
    assert code == 0 and len(runs) == 2, out
    assert [value(r["argv"], "-np") for r in runs] == ["3", "3"]
    assert "the job did not come up (0 of 3 rank(s) started; kv.init: rank 2/3: dup (a new " \
           "communicator: every rank must create it) failed: MPI_ERR_INTERN): relaunching " \
           "on 3 rank(s)" in out, out


@pytest.mark.parametrize("said", [
    # Open MPI's ULFM: a rank segfaults inside MPI_Init (the failure notice of another
    # reaches a communicator not made yet); seen in 1-4% of elastic launches
    ["[1,1]<stderr>: [vm:22358] *** Process received signal ***",
     "[1,1]<stderr>: [vm:22358] Signal: Segmentation fault (11)",
     "[1,1]<stderr>: [vm:22358] [ 1] /v/lib/libmpi.so.40(ompi_comm_revoke_local+0x3f)[0x7f]",
     "[1,1]<stderr>: [vm:22358] [10] /v/lib/libmpi.so.40(ompi_mpi_init+0x385)[0x7fdb]",
     "[1,1]<stderr>: [vm:22358] [11] /v/lib/libmpi.so.40(PMPI_Init_thread+0xbf)[0x7fdb]",
     # (were the crashed rank's host named as lost, it is not cooled down)
     "prterun noticed that process rank 1 exited on signal 11 (Segmentation fault) on "
     "node b."],
    # the runtime itself did not come up
    ["The PMIx server's listener thread failed to start. We cannot", "continue."],
])
def test_a_job_whose_mpi_start_crashed_is_launched_again(tmp_path, said):
    start = '[1,0]<stderr>: kvcoll-elastic {"event": "start", "rank": 0}'
    plan = [{"print": said, "code": 1},
            {"print": [start, '[1,0]<stderr>: kvcoll-elastic {"event": "exit", "rank": 0}']}]
    code, out, runs = launch(tmp_path, ["-H", "a:1,b:1,c:1", "true"], plan)
    assert code == 0 and len(runs) == 2, out
    assert "the job did not come up (0 of 3 rank(s) started; Open MPI's start-up " \
           "failed: " in out and "relaunching on 3 rank(s) (a:1, b:1, c:1)" in out, out


def test_this_host_alone_relaunches_a_failed_start_on_as_many_ranks(tmp_path):
    """Open MPI's start-up crashed on this host (no hostfile): nothing was lost, so the
    relaunch has every rank (it used to lose one a failed start, and a test whose job
    was to lose rank 3 of 4 then ran on 2 ranks and lost none)."""
    said = ["[1,3]<stderr>: [vm:7] *** Process received signal ***",
            "[1,3]<stderr>: [vm:7] [10] /v/lib/libmpi.so.40(ompi_mpi_init+0x385)[0x7fdb]"]
    start = '[1,0]<stderr>: kvcoll-elastic {"event": "start", "rank": 0}'
    plan = [{"print": said, "code": 1}, {"print": said, "code": 1},
            {"print": [start, '[1,0]<stderr>: kvcoll-elastic {"event": "exit", "rank": 0}']}]
    code, out, runs = launch(tmp_path, ["--min-np", "2", "-np", "4", "true"], plan)
    assert code == 0 and len(runs) == 3, out
    assert [value(r["argv"], "-np") for r in runs] == ["4", "4", "4"], out


def test_a_crash_of_the_program_itself_is_not_relaunched(tmp_path):
    said = ["[1,1]<stderr>: [vm:1] *** Process received signal ***",
            "[1,1]<stderr>: [vm:1] [ 1] /v/lib/_kvcoll_c.so(kv_table_find+0x3f)[0x7f]"]
    code, out, runs = launch(tmp_path, ["-H", "a:1,b:1", "true"], [{"print": said, "code": 1}])
    assert code == 1 and len(runs) == 1 and "not relaunching" in out, out


def test_below_min_np_or_an_ordinary_error_is_not_relaunched(tmp_path):
    said = ('[1,1]<stderr>: kvcoll-elastic {"event": "below_min_np", "reason": "rank 2 '
            '(host c) lost at step 40: 2 rank(s) left, fewer than --min-np 3", "hosts": '
            '["c"], "ranks": [2], "saved": "/ck/x"}')
    below = [{"print": [said], "code": 3}]
    code, out, runs = launch(tmp_path, ["--min-np", "3", "-H", "a:1,b:1,c:1", "true"], below)
    assert code == 3 and len(runs) == 1, out
    assert "stopped below --min-np 3: rank 2 (host c) lost at step 40" in out
    bug = [{"print": ["[1,0]<stderr>: kvcoll: rank 0 raised ValueError; aborting the job"],
            "code": 1}]
    (tmp_path / "bug").mkdir()
    code, out, runs = launch(tmp_path / "bug", ["-H", "a:1,b:1", "true"], bug)
    assert code == 1 and len(runs) == 1 and "(a rank raised ValueError): not relaunching" in out


def test_too_few_hosts_left_ends_with_the_reason(tmp_path):
    plan = [{"print": [LOST_C], "code": 1}]
    code, out, runs = launch(tmp_path, ["--min-np", "3", "--elastic-timeout", "0",
                                        "-H", "a:1,b:1,c:1", "true"], plan)
    assert code == 1 and len(runs) == 1, out
    assert "lost host(s) c: 2 slot(s) left (a:1, b:1), fewer than --min-np 3" in out


def test_this_host_alone_relaunches_with_the_ranks_left(tmp_path):
    plan = [{"print": [LOST_C], "code": 1},
            {"print": ['[1,0]<stderr>: kvcoll-elastic {"event": "exit", "rank": 0}']}]
    code, out, runs = launch(tmp_path, ["--min-np", "2", "-np", "3", "true"], plan)
    assert code == 0, out
    assert [value(r["argv"], "-np") for r in runs] == ["3", "2"]
    assert all("--host" not in r["argv"] for r in runs)


def test_the_slurm_and_mpijob_examples_run_elastic(tmp_path):
    # SLURM: the batch script, with SLURM's environment and a stand-in for scontrol
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    tool(fakebin, "scontrol", "#!/bin/sh\necho node1\necho node2\n")
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCOLL", "SLURM_"))}
    env.update(PATH=f"{fakebin}:{env['PATH']}", SLURM_SUBMIT_DIR=str(ROOT),
               SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4", SLURM_JOB_NAME="t",
               SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_ID="7", KVCOLL_CHECKPOINTS=str(
                   tmp_path / "ck"), KVCOLLRUN_SHOW="1",
               MPIRUN=str(tool(tmp_path, "mpirun", MPIRUN)), LOG=str(log),
               SCRIPT=str(tool(tmp_path, "plan.json", '[{"code": 0}]')),
               TMPDIR=str(tmp_path), HOSTS_UP="node1 node2")
    tool(fakebin, "srun", AGENT)       # how kvcollrun reaches a node in an allocation
    out = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch")], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = [json.loads(x) for x in log.read_text().splitlines()]
    argv = run["argv"]
    assert value(argv, "--with-ft") == "ulfm" and value(argv, "--host") == "node1:4,node2:4"
    assert run["min_np"] == "4" and "examples/train.py" in " ".join(argv)
    # the Kubeflow MPI operator: the launcher's command from mpijob.yaml
    text = (ROOT / "launch" / "mpijob.yaml").read_text()
    block = re.search(r"- >-\n((?:\s{18}.*\n)+)", text).group(1)
    command = " ".join(line.strip() for line in block.splitlines()).replace("/kvcoll/", f"{ROOT}/")
    hostfile = tmp_path / "mpi-hosts"
    hostfile.write_text("w-0 slots=4\nw-1 slots=4\n")
    log.unlink()
    env.update(OMPI_MCA_orte_default_hostfile=str(hostfile), HOSTS_UP="w-0 w-1")
    del env["SLURM_JOB_ID"]
    tool(fakebin, "ssh", AGENT)
    out = subprocess.run(["bash", "-c", command.replace("/ck/", f"{tmp_path}/ck/")], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert value(run["argv"], "--with-ft") == "ulfm"
    assert value(run["argv"], "--host") == "w-0:4,w-1:4" and run["min_np"] == "4"


# A stand-in for mpirun for growing: the first launch says its 2 ranks started, lists a
# third host (as if it came up), and runs until SIGUSR2 (then exits 0, stopped); the
# second says its ranks ended.
GROWS = f"""#!{sys.executable}
import json, os, signal, sys, time
log = os.environ["LOG"]
with open(log, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:]}}) + "\\n")
if sum(1 for _ in open(log)) > 1:
    print('[1,0]<stderr>: kvcoll-elastic {{"event": "exit", "rank": 0}}', flush=True)
    sys.exit(0)
def stop(*_):
    for r in range(2):
        print('[1,%d]<stderr>: kvcoll-elastic {{"event": "exit", "rank": %d, "preempted": true}}'
              % (r, r), flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR2, stop)
for r in range(2):
    print('[1,%d]<stderr>: kvcoll-elastic {{"event": "start", "rank": %d}}' % (r, r), flush=True)
with open(os.environ["LISTED"], "a") as f:
    f.write("c:1\\n")
time.sleep(60)
sys.exit(5)
"""


def test_more_hosts_grow_the_job_at_a_save(tmp_path):
    listed = tmp_path / "listed"
    listed.write_text("a:1\nb:1\n")
    disc = tool(tmp_path, "d.sh", f"#!/bin/sh\ncat {listed}\n")
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCOLL", "OMPI_", "PRTE_"))}
    env.update(MPIRUN=str(tool(tmp_path, "mpirun", GROWS)), LOG=str(log), LISTED=str(listed),
               HOSTS_UP="a b c")
    agent = tool(tmp_path, "agent", AGENT)
    out = subprocess.run([str(KVCOLLRUN), "--elastic", "--prtemca", "plm_ssh_agent", str(agent),
                          "--max-np", "3", "--discovery-interval", "0.2",
                          "--host-discovery-script", str(disc), "true"],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [value(r["argv"], "--host") for r in runs] == ["a:1,b:1", "a:1,b:1,c:1"], said
    assert "1 more slot(s) usable (a:1, b:1, c:1): asking the job to stop after its next " \
           "step and save, to grow from 2 to 3 rank(s)" in said
    assert "the job stopped and saved: relaunching on 3 rank(s)" in said


def test_a_relaunch_that_does_not_come_up_is_retried_and_never_taken_for_success(tmp_path):
    start = '[1,0]<stderr>: kvcoll-elastic {"event": "start", "rank": 0}'
    plan = [{"print": [LOST_C], "code": 1},
            # a rank crashed while MPI came up, and mpirun exited 0 all the same
            {"print": ["[1,0]<stderr>: [vm:1] *** Process received signal ***",
                       "[1,1]<stderr>: kvcoll: rank 1 raised CommError; aborting the job"],
             "code": 0},
            {"print": [start, '[1,0]<stderr>: kvcoll-elastic {"event": "exit", "rank": 0}']}]
    code, out, runs = launch(tmp_path, ["--min-np", "1", "-H", "a:1,b:1,c:1", "true"], plan)
    assert code == 0 and len(runs) == 3, out
    assert "the relaunch did not come up (0 of 2 rank(s) started): relaunching" in out, out


# A stand-in for mpirun for growing back after a loss in memory: the first launch says
# its 3 ranks started, then that the survivors went on without rank 2 (host c) in
# memory, and runs until SIGUSR2 (it writes when that came, then exits 0, stopped) or
# for 8 s (then exits 5: it was never asked); the second says its ranks ended.
REGROWS = f"""#!{sys.executable}
import json, os, signal, sys, time
log = os.environ["LOG"]
with open(log, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:]}}) + "\\n")
if sum(1 for _ in open(log)) > 1:
    print('[1,0]<stderr>: kvcoll-elastic {{"event": "exit", "rank": 0}}', flush=True)
    sys.exit(0)
def stop(*_):
    with open(log + ".usr2", "w") as f:
        f.write(str(time.monotonic() - lost_at))
    for r in range(2):
        print('[1,%d]<stderr>: kvcoll-elastic {{"event": "exit", "rank": %d, "preempted": true}}'
              % (r, r), flush=True)
    sys.exit(0)
signal.signal(signal.SIGUSR2, stop)
for r in range(3):
    print('[1,%d]<stderr>: kvcoll-elastic {{"event": "start", "rank": %d}}' % (r, r), flush=True)
time.sleep(0.5)
lost_at = time.monotonic()
print('[1,0]<stderr>: kvcoll-elastic {{"event": "lost", "mode": "in-memory", "ranks": [2], '
      '"hosts": ["c"], "world": [3, 2], "procs": [["c", 4242]]}}', flush=True)
time.sleep(8)
sys.exit(5)
"""


def test_a_host_lost_in_memory_rejoins_after_its_cooldown(tmp_path):
    """The survivors went on in memory without host c's rank; c is still listed: once
    its cooldown is over, the job grows back from 2 to 3 ranks (not only after a
    relaunch: the job's world is what the survivors said, not the launch's)."""
    disc = tool(tmp_path, "d.sh", "#!/bin/sh\necho a:1\necho b:1\necho c:1\n")
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCOLL", "OMPI_", "PRTE_"))}
    env.update(MPIRUN=str(tool(tmp_path, "mpirun", REGROWS)), LOG=str(log), HOSTS_UP="a b c")
    agent = tool(tmp_path, "agent", AGENT)
    out = subprocess.run([str(KVCOLLRUN), "--elastic", "--prtemca", "plm_ssh_agent", str(agent),
                          "--min-np", "2", "--cooldown", "2", "--discovery-interval", "0.2",
                          "--host-discovery-script", str(disc), "true"],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    assert "1 more slot(s) usable (a:1, b:1, c:1): asking the job to stop after its next " \
           "step and save, to grow from 2 to 3 rank(s)" in said, said
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [value(r["argv"], "--host") for r in runs] == ["a:1,b:1,c:1"] * 2, said
    waited = float((tmp_path / "log.usr2").read_text())
    assert 2.0 <= waited < 5.0, f"asked to grow {waited:.2f}s after the loss (cooldown 2 s)"


# A stand-in for mpirun whose ranks were not in model.fit yet when kvcollrun asked them
# to stop (kvcoll notes the request there, and fit then trained to its end): the first
# SIGUSR2 is ignored, the next one stops the job (exits 0, stopped); then as GROWS.
DEAF_AT_FIRST = GROWS.replace("def stop(*_):\n", """asked = []
def stop(*_):
    asked.append(1)
    if len(asked) < 2:
        return
""")


def test_a_stop_request_the_job_was_not_listening_for_yet_is_repeated(tmp_path):
    listed = tmp_path / "listed"
    listed.write_text("a:1\nb:1\n")
    disc = tool(tmp_path, "d.sh", f"#!/bin/sh\ncat {listed}\n")
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCOLL", "OMPI_", "PRTE_"))}
    env.update(MPIRUN=str(tool(tmp_path, "mpirun", DEAF_AT_FIRST)), LOG=str(log),
               LISTED=str(listed), HOSTS_UP="a b c")
    agent = tool(tmp_path, "agent", AGENT)
    out = subprocess.run([str(KVCOLLRUN), "--elastic", "--prtemca", "plm_ssh_agent", str(agent),
                          "--max-np", "3", "--discovery-interval", "0.2",
                          "--host-discovery-script", str(disc), "true"],
                         env=env, capture_output=True, text=True, timeout=90, check=False)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [value(r["argv"], "--host") for r in runs] == ["a:1,b:1", "a:1,b:1,c:1"], said
    assert said.count("asking the job to stop") == 1, said   # (said once, sent again)


# A stand-in for mpirun: 3 ranks start; the survivors go on without host c's rank in
# memory; 2.5 s later the runtime loses host b's daemon and ends the job (exit 0); then
# as the first launch of LOST_C's plan, the next launch's ranks end.
LOST_IN_MEMORY_THEN_HOST = f"""#!{sys.executable}
import json, os, sys, time
log = os.environ["LOG"]
with open(log, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:]}}) + "\\n")
if sum(1 for _ in open(log)) > 1:
    print('[1,0]<stderr>: kvcoll-elastic {{"event": "start", "rank": 0}}', flush=True)
    print('[1,0]<stderr>: kvcoll-elastic {{"event": "exit", "rank": 0}}', flush=True)
    sys.exit(0)
for r in range(3):
    print('[1,%d]<stderr>: kvcoll-elastic {{"event": "start", "rank": %d}}' % (r, r), flush=True)
print('[1,0]<stderr>: kvcoll-elastic {{"event": "lost", "mode": "in-memory", "ranks": [2], '
      '"hosts": ["c"], "world": [3, 2], "procs": [["c", 4242]]}}', flush=True)
time.sleep(2.5)
print("prterun has lost communication with a remote daemon.", flush=True)
print("  Remote daemon: [prterun-vm-1@1,2] on node b ", flush=True)
sys.exit(0)
"""


def test_a_host_lost_in_memory_cools_down_from_its_loss_not_from_a_later_relaunch(tmp_path):
    """Host c's rank is lost in memory, then host b's daemon ends the job 2.5 s later:
    with a 2 s cooldown, c has cooled down by the relaunch, which runs on a and c (not
    on a alone, only to grow back to c at once)."""
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCOLL", "OMPI_", "PRTE_"))}
    env.update(MPIRUN=str(tool(tmp_path, "mpirun", LOST_IN_MEMORY_THEN_HOST)), LOG=str(log),
               HOSTS_UP="a b c", KVCOLLRUN_KILL_AFTER="2")
    agent = tool(tmp_path, "agent", AGENT)
    out = subprocess.run([str(KVCOLLRUN), "--elastic", "--prtemca", "plm_ssh_agent", str(agent),
                          "--min-np", "1", "--cooldown", "2", "-H", "a:1,b:1,c:1", "true"],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [value(r["argv"], "--host") for r in runs] == ["a:1,b:1,c:1", "a:1,c:1"], said


# A stand-in for mpirun that does not end after the job did: 3 ranks start, the
# survivors go on without host c's rank in memory, both say they ended, and mpirun waits
# on (for the daemon of host c, cut off) until it is killed.
HANGS_AFTER_THE_SURVIVORS = f"""#!{sys.executable}
import time
for r in range(3):
    print('[1,%d]<stderr>: kvcoll-elastic {{"event": "start", "rank": %d}}' % (r, r), flush=True)
print('[1,0]<stderr>: kvcoll-elastic {{"event": "lost", "mode": "in-memory", "ranks": [2], '
      '"hosts": ["c"], "world": [3, 2], "procs": [["c", 4242]]}}', flush=True)
for r in range(2):
    print('[1,%d]<stderr>: kvcoll-elastic {{"event": "exit", "rank": %d}}' % (r, r), flush=True)
time.sleep(120)
"""


def test_mpirun_waiting_on_after_every_survivor_ended_is_ended(tmp_path):
    """The survivors of a lost host finished and left, and mpirun waits on for the lost
    host's daemon: kvcollrun ends it KVCOLLRUN_KILL_AFTER seconds later, and the job
    finished (exit 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCOLL", "OMPI_", "PRTE_"))}
    env.update(MPIRUN=str(tool(tmp_path, "mpirun", HANGS_AFTER_THE_SURVIVORS)),
               LOG=str(tmp_path / "log"), HOSTS_UP="a b c", KVCOLLRUN_KILL_AFTER="2")
    agent = tool(tmp_path, "agent", AGENT)
    t0 = time.monotonic()
    out = subprocess.run([str(KVCOLLRUN), "--elastic", "--prtemca", "plm_ssh_agent", str(agent),
                          "--min-np", "2", "-H", "a:1,b:1,c:1", "true"],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    said = out.stdout + out.stderr
    assert out.returncode == 0 and time.monotonic() - t0 < 15, said
    assert "every rank left in the job ended, but mpirun did not" in said, said
    assert "the job recovered and finished (1 launch(es))" in said, said
