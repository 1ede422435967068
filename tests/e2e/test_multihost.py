"""Multi-host runs in the network lab (yeto.testing.netlab): every host is a network
namespace on one switch, with documentation addresses (192.0.2.0/24) that exist only
inside the lab, so nothing leaves the machine and nothing in the root namespace
takes part. The syncer listens on host a's own address (192.0.2.1), islands run on
other hosts, and the tests wait on events (port files, log lines, the tape), never
on fixed sleeps where an event exists.

Needs root and iproute2; skipped with the reason elsewhere. Also here: the deployment
recipes in examples/deploy/, checked as far as this machine can (no Slurm, no cloud).

Here: the checks that need real processes (the others: tests/unit/test_multihost.py)."""


from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from syncer.tape import read_tape
from yeto.cli.join import shell_lines
from yeto.testing import netlab

ROOT = Path(__file__).resolve().parents[2]

WHY = netlab.unavailable()


needs_lab = pytest.mark.skipif(WHY is not None, reason=WHY or "")


PORT = 29400


SMALL = ["--seq-len", "64", "--batch-size", "4", "--lora-r", "4", "--eval-blocks", "8",
         "--inner-lr", "3e-3", "--no-progress"]


TOKEN = "lab-token-" + "5f" * 12


# ---- fixtures and helpers ------------------------------------------------------------
@pytest.fixture
def lab():
    if WHY:
        pytest.skip(WHY)
    with netlab.Lab() as lab:
        yield lab


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 192.0.2.1 (the syncer's host in every lab)."""
    return netlab.make_cert(tmp_path_factory.mktemp("tls"), ["192.0.2.1"])


def env(token: str | None = None) -> dict:
    """The environment of a lab process: this venv's python first on PATH (the printed
    join commands say `python`), the token only where given."""
    e = {k: v for k, v in os.environ.items() if k != "YETO_TOKEN"}
    e.update(PATH=f"{Path(sys.executable).parent}:{e.get('PATH', '')}",
             PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if token:
        e["YETO_TOKEN"] = token
    return e


def wait_for(pred, timeout: float, what: str, procs=()):
    """Poll `pred` until it returns something truthy; fail with `what` on timeout or
    when one of `procs` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            pytest.fail(f"{what}: a process exited first (code {dead[0].returncode})")
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def start_syncer(lab, host, state: Path, *args: str, token: str | None = TOKEN,
                 tls: tuple[Path, Path] | None = None):
    """`python -m syncer` on `host`'s own address; returns once it listens."""
    state.mkdir(parents=True, exist_ok=True)
    port_file = state / "port"
    cmd = [sys.executable, "-m", "syncer", "--host", host.addr, "--port", str(PORT),
           "--port-file", port_file, "--state-dir", state, *args]
    if tls:
        cmd += ["--tls-cert", tls[0], "--tls-key", tls[1]]
    log = open(state / "log.txt", "w")  # noqa: SIM115 - closed with the process
    proc = lab.popen(host, cmd, stdout=log, stderr=subprocess.STDOUT, env=env(token))
    log.close()
    wait_for(port_file.exists, 60, "the syncer to listen", [proc])
    return proc


def island_cmd(backend: str, model: Path, data: Path, out: Path, iid: str, n: int,
               *extra, tls: Path | None = None) -> list:
    module = {"torch": "yeto.learner", "mlx": "yeto.mlx.learner"}[backend]
    cmd = [sys.executable, "-m", module, "--model", model, "--data", data,
           "--syncer", f"192.0.2.1:{PORT}", "--learner-id", iid, "--num-learners", str(n),
           "--output", out, *SMALL, *extra]
    if backend == "torch":
        cmd += ["--threads", "1"]
    return cmd + (["--tls-ca", tls] if tls else [])


def adapter(d: Path) -> dict:
    return load_file(d / "adapter_model.safetensors")


def assert_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    assert all(np.array_equal(a[k], b[k]) for k in a), f"{what}: adapters differ"


def merges(state: Path) -> list[dict]:
    tape = state / "tape.jsonl"
    return [r for r in read_tape(tape) if r.get("event") == "merge"] if tape.exists() else []


# ---- the lab itself --------------------------------------------------------------------
@needs_lab
def test_the_lab_links_hosts_limits_bandwidth_and_tears_down(tmp_path):
    """Two hosts talk over the switch; a 20 Mbit/s limit holds; a relay adds its delay;
    a cut link refuses traffic until it is up again; the namespaces are gone after
    the block, even when it raised."""
    sink = ("import socket,sys,time\ns=socket.create_server((sys.argv[1],9000))\n"
            "print('up',flush=True)\nwhile True:\n c,_=s.accept();n=0;t=None\n"
            " while d:=c.recv(1<<16):\n  t=t or time.monotonic();n+=len(d)\n  "
            "c.sendall(b'k') if n==1 else None\n print(n,time.monotonic()-t,flush=True)")
    send = ("import socket,sys,time\nc=socket.create_connection((sys.argv[1],int(sys.argv[2])),"
            "timeout=2)\nt=time.monotonic();c.sendall(b'x');c.recv(1)\n"
            "print(time.monotonic()-t)\nc.sendall(b'y'*int(sys.argv[3]));c.close()")
    with pytest.raises(RuntimeError, match="on purpose"), netlab.Lab() as lab:
        a, b = lab.host("a"), lab.host("b", rate_mbit=20)
        names = [h.ns for h in (a, b)] + [lab.switch]
        srv = lab.popen(a, [sys.executable, "-c", sink, a.addr], stdout=subprocess.PIPE,
                        text=True)
        assert srv.stdout.readline().strip() == "up"
        r = lab.run(b, [sys.executable, "-c", send, a.addr, "9000", str(2_500_000)], timeout=60)
        assert r.returncode == 0, r.stderr
        n, seconds = srv.stdout.readline().split()
        # the limit holds: 2.5 MB cannot cross 20 Mbit/s in under ~1 s (a lower bound
        # only: a loaded machine may take longer, never shorter)
        assert int(n) == 2_500_001 and float(seconds) > 0.75
        relay, address = lab.relay(b, f"{a.addr}:9000", delay_ms=100)
        r = lab.run(b, [sys.executable, "-c", send, *address.split(":"), "10"], timeout=60)
        assert r.returncode == 0 and float(r.stdout.split()[0]) >= 0.2  # 2 x 100 ms
        # a launcher on a listening on all interfaces tells others a's own address
        r = lab.run(a, [sys.executable, "-c", "from yeto.cli.join import advertise_host; "
                                              "print(advertise_host('0.0.0.0'))"])
        assert r.stdout.strip() == a.addr, r.stderr
        with lab.cut(b):
            r = lab.run(b, [sys.executable, "-c", send, a.addr, "9000", "10"], timeout=60)
            assert r.returncode != 0  # no carrier: nothing gets through
        raise RuntimeError("on purpose")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in names)


# ---- a TLS syncer with torch and MLX islands on other hosts ------------------------------
@pytest.mark.mlx
def test_tls_syncer_torch_and_mlx_islands_on_three_hosts(lab, cert, tmp_path, tiny_llama,
                                                         tiny_task):
    pytest.importorskip("mlx_lm", reason="the MLX island needs mlx-lm: pip install 'yeto[mlx]'")
    train, held_out = tiny_task
    a, b, c = lab.host("a"), lab.host("b"), lab.host("c")
    state = tmp_path / "syncer"
    syncer = start_syncer(lab, a, state, "--quorum", "2", tls=cert)
    procs = []
    for host, backend, iid in ((b, "torch", "island-0"), (c, "mlx", "island-1")):
        out = tmp_path / iid
        log = open(tmp_path / f"{iid}.log", "w")  # noqa: SIM115
        procs.append(lab.popen(host, island_cmd(backend, tiny_llama, train, out, iid, 2,
                                                "--max-steps", "8", "--sync-every", "4",
                                                "--eval-data", held_out, tls=cert[0]),
                               stdout=log, stderr=subprocess.STDOUT, env=env(TOKEN)))
        log.close()
    for iid, p in zip(("island-0", "island-1"), procs):
        assert p.wait(timeout=300) == 0, (tmp_path / f"{iid}.log").read_text()[-3000:]
    assert syncer.wait(timeout=60) == 0, (state / "log.txt").read_text()[-3000:]
    final = adapter(state / "final")
    for iid in ("island-0", "island-1"):
        assert_identical(adapter(tmp_path / iid / "adapter"), final, iid)
    rounds = merges(state)
    assert rounds and all({r["learner"] for r in m["responders"]} == {"island-0", "island-1"}
                          for m in rounds)
    assert f"listening on 192.0.2.1:{PORT}" in (state / "log.txt").read_text()


def test_open_syncer_refuses_to_start_and_tokenless_island_is_refused(lab, cert, tmp_path,
                                                                      tiny_llama, tiny_task):
    a, b = lab.host("a"), lab.host("b")
    # no token and no TLS beyond loopback: the syncer does not start
    r = lab.run(a, [sys.executable, "-m", "syncer", "--host", a.addr, "--port", str(PORT)],
                env=env(None), timeout=60)
    assert r.returncode != 0
    assert f"refusing to listen on {a.addr} without a token or TLS" in r.stderr
    # with a token and TLS it listens; an island that lacks the token is refused
    state = tmp_path / "syncer"
    syncer = start_syncer(lab, a, state, "--quorum", "1", tls=cert)
    train, _ = tiny_task
    r = lab.run(b, island_cmd("torch", tiny_llama, train, tmp_path / "i0", "island-0", 1,
                              "--max-steps", "2", tls=cert[0]), env=env(None), timeout=240)
    assert r.returncode == 3, r.stderr[-3000:]
    assert f"syncer at 192.0.2.1:{PORT} refused island-0: missing or wrong credential" in r.stderr
    assert syncer.poll() is None  # the syncer serves on


# ---- yeto launch with an external slot ---------------------------------------------------
def read_join_block(stdout, lines: list[str]) -> list[str]:
    """Launch's output up to the end of the first join block; returns the block."""
    block = None
    for line in stdout:
        lines.append(line)
        if line.startswith("join island-"):
            block = [line.rstrip("\n")]
        elif block is not None:
            if not line.strip():
                return block
            block.append(line.rstrip("\n"))
    pytest.fail("launch ended before printing a join command:\n" + "".join(lines))


@pytest.mark.long  # ~8 s on two lab hosts: .ci/run runs it after the default tier
def test_launch_waits_for_an_external_island_that_joins_as_printed(lab, cert, tmp_path,
                                                                   tiny_llama, tiny_task):
    train, held_out = tiny_task
    a, b = lab.host("a"), lab.host("b")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "yeto", "launch", "--islands", "torch",
           "--external-islands", "torch:1", "--host", a.addr, "--tls-cert", cert[0],
           "--tls-key", cert[1], "--model", tiny_llama, "--data", train, "--eval-data",
           held_out, "--out", out, "--display", "plain", "--no-dashboard",
           "--max-steps", "8", "--sync-every", "4", "--threads", "1", *SMALL]
    launch = lab.popen(a, cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env(None))
    lines: list[str] = []
    block = read_join_block(launch.stdout, lines)
    run_lines = shell_lines(block)
    assert run_lines[-2] == 'pip install "yeto[torch]"'
    join_cmd = run_lines[-1]
    assert join_cmd.startswith(f"python -m yeto.learner --syncer {a.addr}:{PORT} "
                               "--learner-id island-1 --learner-index 1 --num-learners 2")
    assert f"--tls-ca {cert[0]}" in join_cmd
    token = (out / "token").read_text().strip()
    assert oct((out / "token").stat().st_mode & 0o777) == "0o600"
    # the run waits: the local island cannot train a round without the external one
    assert not merges(out / "syncer")
    # on host b, as printed (the lab has no internet: yeto is installed already)
    script = "\n".join(x for x in run_lines if not x.startswith("pip install"))
    (tmp_path / "b").mkdir()
    joined = lab.run(b, ["bash", "-c", script], input=token + "\n", cwd=tmp_path / "b",
                     env=env(None), timeout=300)
    assert joined.returncode == 0, joined.stderr[-3000:]
    rest, _ = launch.communicate(timeout=120)
    stdout = "".join(lines) + rest
    assert launch.returncode == 0, stdout[-4000:]
    assert re.search(r"island-1\s+torch\s+-\s+-\s+-\s+-\s+-\s+0\s+waiting \(external\)", stdout)
    assert "island-1 joined from another machine (torch)" in stdout
    rounds = merges(out / "syncer")
    assert rounds[0]["quorum"] == 2
    assert all({r["learner"] for r in m["responders"]} == {"island-0", "island-1"}
               for m in rounds)
    final = adapter(out / "adapter")
    assert_identical(adapter(out / "islands" / "island-0" / "adapter"), final, "island-0")
    assert_identical(adapter(tmp_path / "b" / "island-1" / "adapter"), final, "island-1")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["external"]["island-1"]["pushes"] == len(rounds)
    # the token is in OUT/token only: not in what launch printed, nor in any log
    assert token not in stdout and token not in joined.stdout + joined.stderr
    for f in out.rglob("*"):
        if f.is_file() and f.name != "token":
            assert token.encode() not in f.read_bytes(), f


# ---- a link cut mid-run ------------------------------------------------------------------
CUT_S = 4.0  # how long the link stays down (the one fixed wait: the cut itself)


H = 5        # --sync-every of the islands


STEPS = 150  # enough that training outlasts the cut at ~50 ms a step


def run_with_a_cut(lab, tmp_path, model, data, reset: bool, extra=()) -> dict:
    """Syncer on a, islands on b and c (quorum 1: each push commits, so c is never
    held up by b); b's link goes down for CUT_S once two rounds have committed, then
    comes back. Returns what the checks need."""
    a, b, c = lab.host("a"), lab.host("b"), lab.host("c")
    state = tmp_path / "syncer"
    syncer = start_syncer(lab, a, state, "--quorum", "1")
    procs = {}
    # --slowdown: steps of ~50 ms or more that mostly sleep (cheap on a shared machine),
    # so that training spans the cut. b steps 1.5x slower than c: offline, b pays no
    # sync and steps ~15 % faster than it did online, and the syncer takes at most
    # H x (2 + the rounds committed meanwhile) steps in b's next push (the claims
    # bound, syncer/bounds.py); at the same speed as c a cut of 4 s left b ~5 steps over
    # that in about half the runs, its claim was cut, and "every step counted once" failed
    for host, iid, slowdown in ((b, "island-0", "6"), (c, "island-1", "4")):
        log = open(tmp_path / f"{iid}.log", "w")  # noqa: SIM115
        procs[iid] = lab.popen(host, island_cmd("torch", model, data, tmp_path / iid, iid, 2,
                                                "--max-steps", str(STEPS), "--sync-every", str(H),
                                                "--slowdown", slowdown, *extra),
                               stdout=log, stderr=subprocess.STDOUT, env=env(TOKEN))
        log.close()
    wait_for(lambda: sum(any(r["learner"] == "island-0" for r in m["responders"])
                         for m in merges(state)) >= 2, 240, "two rounds from island-0",
             list(procs.values()))
    t_cut = time.time()
    with lab.cut(b, reset=reset):
        time.sleep(CUT_S)
    t_up = time.time()
    for iid, p in procs.items():
        assert p.wait(timeout=300) == 0, (tmp_path / f"{iid}.log").read_text()[-3000:]
    assert syncer.wait(timeout=60) == 0, (state / "log.txt").read_text()[-3000:]
    return dict(state=state, t_cut=t_cut, t_up=t_up, summary={
        iid: json.loads((tmp_path / iid / "summary.json").read_text()) for iid in procs})


def steps_through_the_cut(metrics: Path, t_cut: float, t_up: float) -> tuple[int, float]:
    """(steps the island made from its last record before the cut to its first record
    after the link came back, the steps its pace before the cut predicts for that
    time). Records are written at pushes, with the step and the wall time."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    recs = [r for r in recs if "time" in r and r.get("step")]
    pre = [r for r in recs if r["time"] < t_cut]
    post = next(r for r in recs if r["time"] > t_up)
    pace = (pre[-1]["step"] - pre[0]["step"]) / (pre[-1]["time"] - pre[0]["time"])
    return post["step"] - pre[-1]["step"], pace * (post["time"] - pre[-1]["time"])


def assert_nothing_lost(tmp_path, state: Path, summary: dict) -> None:
    """Every step and loss token of every island is in the tape exactly once, every
    round is there, and every island ends bit-identical to the syncer."""
    rounds = merges(state)
    assert [m["round"] for m in rounds] == list(range(1, len(rounds) + 1))
    final = adapter(state / "final")
    for iid, s in summary.items():
        mine = [r for m in rounds for r in m["responders"] if r["learner"] == iid]
        assert sum(r["steps"] for r in mine) == s["step"] == STEPS, iid
        assert sum(r["tokens"] for r in mine) == s["loss_tokens"], iid
        assert s["final"] is True
        assert_identical(adapter(tmp_path / iid / "adapter"), final, iid)


@pytest.mark.long  # minute-scale: .ci/run runs it after the default tier
def test_a_link_cut_mid_run_loses_nothing(lab, tmp_path, tiny_llama, tiny_task):
    """b's link goes down for seconds and its connections drop (a laptop whose
    Wi-Fi comes back on another network): b trains on offline, rejoins, and its
    offline steps arrive in its next push; c trains on; nothing is lost."""
    got = run_with_a_cut(lab, tmp_path, tiny_llama, tiny_task[0], reset=True)
    assert_nothing_lost(tmp_path, got["state"], got["summary"])
    log = (got["state"] / "log.txt").read_text()
    assert len(re.findall(r"island-0 joined \(generation", log)) == 2  # it reconnected
    assert "training continues locally" in (tmp_path / "island-0.log").read_text()
    done, paced = steps_through_the_cut(tmp_path / "island-0" / "metrics.jsonl",
                                        got["t_cut"], got["t_up"])
    # b kept its pace through the cut: a stalled island makes at most 2 H steps (one
    # push in flight, the next one waiting for it)
    assert done >= 0.5 * paced and done > 2 * H, (done, paced)


@pytest.mark.slow
def test_a_silent_link_cut_does_not_stall_the_island(lab, tmp_path, tiny_llama, tiny_task):
    """The same cut without dropping connections (no carrier; the connections hang):
    the island's keepalive pings go unanswered, so it counts the link as down within
    2 x --keepalive-s (1 s here, 20 s by default), trains on offline and reconnects
    when the link is back; nothing is lost."""
    got = run_with_a_cut(lab, tmp_path, tiny_llama, tiny_task[0], reset=False,
                         extra=("--keepalive-s", "1"))
    assert_nothing_lost(tmp_path, got["state"], got["summary"])
    done, paced = steps_through_the_cut(tmp_path / "island-0" / "metrics.jsonl",
                                        got["t_cut"], got["t_up"])
    assert done >= 0.5 * paced and done > 2 * H, (done, paced)


# ---- deployment recipes (examples/deploy/) ---------------------------------------------
DEPLOY = ROOT / "examples" / "deploy"


def test_slurm_script_parses_and_keeps_the_token_off_command_lines():
    script = DEPLOY / "slurm.sbatch"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stdout
    text = script.read_text()
    assert "python -m syncer --host 0.0.0.0" in text and "torchrun --standalone" in text
    assert "--token" not in text and "export YETO_TOKEN" in text


SRUN = """#!PYTHON
# srun for one machine: the job's nodes are this host. A step of --nodes=N > 1 runs its
# command N times at once (SLURM_NODEID 0..N-1) and fails if any copy fails; any other
# step runs its command once, in the foreground (the script backgrounds it with &).
import os, subprocess, sys
args, nodes = sys.argv[1:], 1
while args and args[0].startswith("--"):
    opt = args.pop(0)
    if opt.startswith("--nodes="):
        nodes = int(opt.split("=", 1)[1])
if nodes == 1:
    os.execvp(args[0], args)
procs = [subprocess.Popen(args, env=dict(os.environ, SLURM_NODEID=str(i))) for i in range(nodes)]
sys.exit(max(p.wait() for p in procs))
"""
SCONTROL = """#!/bin/sh
# scontrol show hostnames LIST, for a job of two nodes that are both this host
printf '127.0.0.1\\n127.0.0.1\\n'
"""


def _free_base_port(offsets=(0, 1, 100, 101)) -> int:
    """A port P with P + each offset free on loopback now (the recipe's shard and
    standby ports)."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 60000)
        try:
            socks = []
            for off in offsets:
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free ports")


@pytest.mark.long  # minute-scale: .ci/run runs it after the default tier
@pytest.mark.skipif(not Path(sys.executable).with_name("torchrun").exists(),
                    reason="torchrun not installed")
def test_slurm_script_runs_two_shards_with_standbys_on_one_machine(tmp_path, tiny_llama,
                                                                    tiny_task):
    """The Slurm recipe, run for real with stand-in srun and scontrol on one machine: two
    nodes (two torchrun islands), SHARDS=2 with STANDBYS=1 (four syncers). It ends with
    the run's adapter assembled from the shards, the islands' final weights bit for bit,
    and each standby holding its shard's last state."""
    from syncer import state

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN.replace("PYTHON", sys.executable))
    (bin_dir / "scontrol").write_text(SCONTROL)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    train, held_out = tiny_task
    run = tmp_path / "run"
    env = dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_NUM_NODES="2",
               MODEL=str(tiny_llama), DATA=str(train), EVAL_DATA=str(held_out), RUN=str(run),
               PORT=str(_free_base_port()), STEPS="20", SYNC_EVERY="5", SHARDS="2", FRAGMENTS="2",
               STANDBYS="1", ISLAND_ARGS="--seq-len 64 --batch-size 4 --threads 1")
    env.pop("SLURM_GPUS_PER_NODE", None)
    out = subprocess.run(["bash", str(DEPLOY / "slurm.sbatch")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    logs = {p.name: p.read_text()[-1500:] for p in run.rglob("*.log*") if p.is_file()}
    assert out.returncode == 0, (out.stdout, out.stderr, logs)
    assert "the run's adapter is in" in out.stdout
    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    for i in range(2):
        mine = load_file(run / "islands" / f"island-{i}" / "adapter" / "adapter_model.safetensors")
        assert sorted(mine) == sorted(adapter)
        assert all(np.array_equal(mine[k], adapter[k]) for k in adapter)
    token = state.StateKey((run / "token").read_text().strip())
    for i in range(2):
        primary = state.load(run / f"syncer-{i}", token)[3]
        standby = state.load(run / f"standby-{i}", token)[3]
        assert standby["version"] == primary["version"] > 0


def systemd_command(unit: Path) -> str:
    """The shell command of the unit's ExecStart (continuations joined, $$ -> $)."""
    text = unit.read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    cmd = line.removeprefix("ExecStart=/bin/sh -c ").replace("$$", "$")
    assert cmd[0] == cmd[-1] == "'"
    return cmd[1:-1]


def test_systemd_unit_verifies_and_resumes_only_a_saved_run(tmp_path):
    unit = DEPLOY / "yeto-syncer.service"
    if shutil.which("systemd-analyze"):
        r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
    cmd = systemd_command(unit).replace("exec /opt/yeto/bin/python", "exec echo")
    env = dict(os.environ, STATE_DIRECTORY=str(tmp_path), CREDENTIALS_DIRECTORY="/creds")
    first = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert first.stdout.split()[:3] == ["-m", "syncer", "--host"]
    assert f"--state-dir {tmp_path}" in first.stdout and "--resume" not in first.stdout
    assert "--tls-key /creds/server.key" in first.stdout
    (tmp_path / "state.safetensors").write_bytes(b"")
    again = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert again.stdout.split()[-1] == "--resume"


def test_systemd_unit_command_starts_a_syncer(lab, cert, tmp_path):
    """The unit's own command line, run as systemd would (state and credential
    directories, the token from the environment) on a lab host: it listens on every
    interface with TLS, and SIGTERM stops it cleanly."""
    a = lab.host("a")
    creds = tmp_path / "creds"
    creds.mkdir()
    for src, name in zip(cert, ("server.pem", "server.key")):
        shutil.copy(src, creds / name)
    cmd = systemd_command(DEPLOY / "yeto-syncer.service").replace(
        "/opt/yeto/bin/python", sys.executable).replace("--port 29400", "--port 29400 "
                                                        f"--port-file {tmp_path}/port")
    e = dict(env(TOKEN), STATE_DIRECTORY=str(tmp_path / "state"),
             CREDENTIALS_DIRECTORY=str(creds))
    (tmp_path / "state").mkdir()
    log = open(tmp_path / "log.txt", "w")  # noqa: SIM115
    proc = lab.popen(a, ["sh", "-c", cmd], stdout=log, stderr=subprocess.STDOUT, env=e)
    log.close()
    wait_for((tmp_path / "port").exists, 60, "the unit's syncer to listen", [proc])
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    assert f"listening on 0.0.0.0:{PORT}" in (tmp_path / "log.txt").read_text()


@pytest.mark.slow
@needs_lab
def test_bench_link_runs_and_reports(tmp_path):
    """scripts/bench_link.py --quick ends with its RESULT line (numbers not asserted)."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_link.py"), "--quick",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    last = r.stdout.strip().splitlines()[-1]
    m = re.match(r"^RESULT wait_share=(\S+) wait_share_P4=(\S+)( [a-z_A-Z0-9]+=\S+)*$", last)
    assert m, last
    assert 0 <= float(m.group(1)) <= 1 and 0 <= float(m.group(2)) <= 1
