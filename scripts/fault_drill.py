#!/usr/bin/env python
"""Fault drill: real `megascale train --nproc N` runs, faults delivered from outside, times measured.

    python scripts/fault_drill.py [--nproc 2] [--out /tmp/megascale-drill] [--only restart,preempt,...]
    python scripts/fault_drill.py --scenario multi

Drills (each on configs/tiny.yaml shrunk to a 2-layer model, dp = nproc, gloo on CPU):
  restart   SIGKILL rank 1 after step 5 with --max-restarts 2: seconds from the kill to the first
            survivor stopping (detect), to the new attempt ready to train (recover), steps lost,
            final loss vs a fault-free run, effective training time.
  raise     an exception on rank 1 at step 2 without restarts: seconds to the launcher's exit.
  sigint    SIGINT to the launcher's process group: seconds to exit 130.
  orphan    SIGKILL of the launcher: seconds until no worker is left.
  preempt   SIGTERM to the launcher after step 3: seconds to exit 75 with a committed checkpoint,
            then the resumed run's final loss vs the fault-free one.
  store     plain torchrun --max-restarts 1 with a bare gloo worker whose rank 1 dies in attempt 0 and
            starts late in attempt 1: with the agent's store shared and no prefix (torch's default) the
            restart fails with "connectFullMesh ... Connection refused"; with
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or with megascale's per-attempt prefix, it connects.
  multi     (--scenario multi) one run, dp = nproc, --max-restarts 4, checkpoints every 2 steps,
            fault.step_timeout_s=5 and fault.nan_policy=skip, surviving five faults in turn: SIGKILL of
            rank 1 from outside (attempt 0), SIGSTOP of rank 1 from outside (attempt 1), an injected
            raise on rank 0 (attempt 2), a crash inside a checkpoint save on rank 1 (attempt 3) and a NaN
            loss on rank 1 (attempt 4, skipped). Prints per fault the seconds to detect and to recover and
            the steps lost, the run's effective training time (its run_end event), and its final loss
            against a run with no restart whose only fault is the same NaN: the skip drops one update, so
            a fault-free run would end elsewhere; every restart must leave the trajectory unchanged.
Prints one line per drill; docs/reliability.md quotes its output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
         "model.seq_length=32", "train.global_batch_size=8", "train.micro_batch_size=2", "log.interval=1",
         "log.tensorboard=false", "optim.warmup_steps=2", "optim.decay_steps=8", "train.eval_interval=0",
         "train.steps=10", "checkpoint.interval=2"]
STORE_WORKER = '''
import datetime, os, sys, time
import torch, torch.distributed as dist
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(3)  # the peer reads rank 1's address before rank 1 has published its new one
if os.environ.get("DRILL_PREFIX") == "1":
    from megascale.training.fault.rendezvous import init_on_agent_store
    init_on_agent_store("gloo", 60)
else:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
dist.all_reduce(torch.ones(1))
if attempt == 0 and rank == 1:
    os._exit(9)
time.sleep(1.0 if attempt == 0 else 0.0)
dist.all_reduce(torch.ones(1))
'''


def command(out: Path, nproc: int, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "megascale.cli", "train", "--config", "configs/tiny.yaml",
            f"train.output_dir={out}", *MODEL, "--nproc", str(nproc), "--max-restarts", str(max_restarts)]


def start(args: list[str], log: Path, extra_path: str = "") -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def wait_step(out: Path, step: int, proc: subprocess.Popen, attempt: int = 0) -> None:
    while read_json(out / "attempts" / str(attempt) / "progress.json").get("step", 0) < step:
        if proc.poll() is not None:
            raise SystemExit(f"drill run ended early (code {proc.returncode}); see {out.parent}")
        time.sleep(0.02)


def events(out: Path, kind: str) -> list[dict]:
    path = out / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def final_loss(out: Path) -> float:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records[-1]["loss"]


def step_losses(out: Path) -> dict[int, float]:
    """step -> loss (a step trained again after a restart: its last record)."""
    return {rec["step"]: rec["loss"] for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def live_workers(out: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and b"megascale.train" in cmd and f"train.output_dir={out}".encode() in cmd:
            pids.append(int(entry.name))
    return pids


def drill_restart(base: Path, nproc: int, reference: float) -> str:
    out = base / "restart" / "run"
    proc = start(command(out, nproc, max_restarts=2), base / "restart.log")
    wait_step(out, 5, proc)
    victim = read_json(out / "attempts" / "0" / "rank_1.json")["pid"]
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    code = proc.wait()
    (restart,) = events(out, "restart")
    survivors = [read_json(p).get("exit_time") for p in (out / "attempts" / "0").glob("rank_*.json")]
    detected = min(t for t in survivors if t)
    (end,) = events(out, "run_end")
    return (f"restart: exit {code}; SIGKILL of rank 1 at step {restart['last_step']}: detected "
            f"{detected - killed:.2f} s after the kill (event: {restart['detect_s']:.2f} s), recovered in "
            f"{restart['recover_s']:.1f} s, resumed from step {restart['resumed_from']} ({restart['steps_lost']} "
            f"lost); final loss {final_loss(out):.6f} vs fault-free {reference:.6f}; effective training time "
            f"{100 * end['effective']:.1f}% ({end['useful_s']:.1f} s of {end['wall_s']:.1f} s)")


def drill_raise(base: Path, nproc: int) -> str:
    out = base / "raise" / "run"
    proc = start([*command(out, nproc), "fault.inject=raise:rank=1:step=2"], base / "raise.log")
    code = proc.wait()
    (failed,) = events(out, "rank_failed")
    elapsed = time.time() - failed["time"]
    return f"raise: exit {code}, {elapsed:.2f} s from the exception on rank 1 to the launcher's exit"


def drill_sigint(base: Path, nproc: int) -> str:
    out = base / "sigint" / "run"
    proc = start(command(out, nproc), base / "sigint.log")
    wait_step(out, 2, proc)
    sent = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    code = proc.wait()
    return f"sigint: exit {code} {time.time() - sent:.2f} s after SIGINT; workers left: {len(live_workers(out))}"


def drill_orphan(base: Path, nproc: int) -> str:
    out = base / "orphan" / "run"
    proc = start(command(out, nproc), base / "orphan.log")
    wait_step(out, 2, proc)
    sent = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    while live_workers(out) and time.time() - sent < 30:
        time.sleep(0.01)
    left = live_workers(out)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return f"orphan: launcher SIGKILLed; {'all workers gone' if not left else f'{len(left)} workers LEFT'} " \
           f"after {time.time() - sent:.2f} s"


def drill_preempt(base: Path, nproc: int, reference: float) -> str:
    out = base / "preempt" / "run"
    proc = start(command(out, nproc), base / "preempt.log")
    wait_step(out, 3, proc)
    sent = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    code = proc.wait()
    elapsed = time.time() - sent
    (preempted,) = events(out, "preempted")
    again = start(command(out, nproc), base / "preempt2.log")
    code2 = again.wait()
    return (f"preempt: exit {code} {elapsed:.2f} s after SIGTERM, stopped at step {preempted['step']} with "
            f"checkpoint {'saved' if preempted['saved'] else 'NOT saved'}; resumed run exit {code2}, final loss "
            f"{final_loss(out):.6f} vs fault-free {reference:.6f}")


MULTI_STEPS = 16
MULTI_STEP_TIMEOUT = 5  # seconds: the hung rank must be named within this + 10 s
MULTI = [f"train.steps={MULTI_STEPS}", f"optim.decay_steps={MULTI_STEPS}", "checkpoint.interval=2",
         f"fault.step_timeout_s={MULTI_STEP_TIMEOUT}", "fault.heartbeat_s=1", "fault.checkpoint_timeout_s=30",
         "fault.nan_policy=skip"]
# Each injected fault names its attempt, so it fires once and the restarted group runs past it.
MULTI_RAISE = "raise:rank=0:step=7:attempt=2"
MULTI_CRASH = "crash_in_save:rank=1:step=10:attempt=3"
MULTI_NAN_STEP = 13
MULTI_NAN = f"nan:rank=1:step={MULTI_NAN_STEP}:attempt=4"


def multi_reference(base: Path, nproc: int) -> Path:
    """Run directory of the same run with no restart, whose one fault is the NaN at the same step (skipped)."""
    out = base / "multi_reference" / "run"
    spec = f"fault.inject=nan:rank=1:step={MULTI_NAN_STEP}"
    proc = start([*command(out, nproc), *MULTI, spec], base / "multi_reference.log")
    if proc.wait() != 0:
        raise SystemExit(f"reference run failed; see {base / 'multi_reference.log'}")
    return out


def first_survivor_stop(out: Path, attempt: int) -> float:
    """Earliest exit time recorded by a rank of `attempt` (the first survivor stopping)."""
    times = [read_json(p).get("exit_time") for p in (out / "attempts" / str(attempt)).glob("rank_*.json")]
    return min(t for t in times if t)


def wait_attempt(out: Path, attempt: int, proc: subprocess.Popen) -> None:
    """Block until rank 0 of `attempt` has recorded its start (the previous attempt is over)."""
    while not (out / "attempts" / str(attempt) / "rank_0.json").exists():
        if proc.poll() is not None:
            raise SystemExit(f"multi drill ended early (code {proc.returncode}); see {out.parent}")
        time.sleep(0.05)


def seconds(value: float | None, digits: int = 1) -> str:
    """A duration for the report ('?' where the records could not tell)."""
    return "?" if value is None else f"{value:.{digits}f} s"


def multi_line(name: str, detect: float | None, restart: dict, bound: float | None = None) -> str:
    """One fault of the multi drill: detect (against `bound` where the drill promises one), recover, steps lost."""
    within = "" if bound is None or detect is None else f" ({'within' if detect < bound else 'OVER'} {bound:g} s)"
    return (f"  {name}: detected {seconds(detect, 2)}{within}, recovered {seconds(restart['recover_s'])}, last step "
            f"{restart['last_step']}, resumed from {restart['resumed_from']}, {restart['steps_lost']} steps lost "
            f"(cause: {restart['cause'][:90]})")


def drill_multi(base: Path, nproc: int) -> str:
    """Five faults in one run; see the module docstring."""
    reference_dir = multi_reference(base, nproc)
    reference = final_loss(reference_dir)
    out = base / "multi" / "run"
    spec = f"fault.inject={MULTI_RAISE};{MULTI_CRASH};{MULTI_NAN}"
    proc = start([*command(out, nproc, max_restarts=4), *MULTI, spec], base / "multi.log")
    wait_step(out, 3, proc, attempt=0)
    killed = time.time()
    os.kill(read_json(out / "attempts" / "0" / "rank_1.json")["pid"], signal.SIGKILL)
    wait_attempt(out, 1, proc)
    wait_step(out, 5, proc, attempt=1)
    stopped_pid = read_json(out / "attempts" / "1" / "rank_1.json")["pid"]
    stopped = time.time()
    os.kill(stopped_pid, signal.SIGSTOP)
    try:
        code = proc.wait(timeout=900)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # the watchdog kills it; make sure nothing outlives us
            with contextlib.suppress(OSError):
                os.kill(stopped_pid, sig)
    if code != 0:
        raise SystemExit(f"multi drill exit {code}; see {base / 'multi.log'}")
    restarts = {e["attempt"]: e for e in events(out, "restart")}
    hang = events(out, "hang")[0]
    nan = events(out, "nan")
    (end,) = events(out, "run_end")
    lines = [f"multi: exit {code}, {end['attempts']} attempts, {MULTI_STEPS} steps; per fault:",
             multi_line("SIGKILL rank 1 (outside)", first_survivor_stop(out, 0) - killed, restarts[1], bound=30),
             multi_line(f"SIGSTOP rank 1 (outside), hang named rank {hang['ranks']}", hang["time"] - stopped,
                        restarts[2], bound=MULTI_STEP_TIMEOUT + 10),
             multi_line("raise on rank 0", restarts[3]["detect_s"], restarts[3]),
             multi_line("crash_in_save on rank 1", restarts[4]["detect_s"], restarts[4]),
             (f"  nan on rank 1: detected at step {nan[0]['step']} (same step, before the update), "
              f"{len(nan)} event(s), update skipped, 0 steps lost, no restart"),
             (f"  effective training time {100 * end['effective']:.1f}% ({end['useful_s']:.1f} s of "
              f"{end['wall_s']:.1f} s wall); final loss {final_loss(out):.6f} vs {reference:.6f} for the run without "
              f"restarts with the same NaN skipped; all {MULTI_STEPS} step losses "
              f"{'equal' if step_losses(out) == step_losses(reference_dir) else 'DIFFERENT'}")]
    return "\n".join(lines)


def drill_store(base: Path) -> str:
    script = base / "store_worker.py"
    script.write_text(STORE_WORKER)
    results = []
    for name, extra in (("shared store, no prefix", {}), ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}), ("per-attempt prefix", {"DRILL_PREFIX": "1"})):
        env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
        env.update(extra, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               "--max-restarts=1", "--monitor-interval=0.1", str(script)], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        refused = "connectFullMesh" in proc.stderr + proc.stdout
        results.append(f"{name}: {'restart OK' if proc.returncode == 0 else 'FAILED'}"
                       f"{' (connectFullMesh ... Connection refused)' if refused else ''}")
    return "store: " + "; ".join(results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/megascale-drill"))
    parser.add_argument("--only", default="restart,raise,sigint,orphan,preempt,store")
    parser.add_argument("--scenario", choices=["single", "multi"], default="single",
                        help="single: the drills of --only, one fault each; multi: five faults in one run")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    if args.scenario == "multi":
        report = drill_multi(args.out, args.nproc)
        print(report, flush=True)
        return 1 if "OVER" in report or "DIFFERENT" in report else 0
    wanted = args.only.split(",")
    reference = 0.0
    if {"restart", "preempt"} & set(wanted):
        ref = start(command(args.out / "reference" / "run", args.nproc), args.out / "reference.log")
        if ref.wait() != 0:
            raise SystemExit(f"fault-free run failed; see {args.out / 'reference.log'}")
        reference = final_loss(args.out / "reference" / "run")
    drills = {"restart": lambda: drill_restart(args.out, args.nproc, reference),
              "raise": lambda: drill_raise(args.out, args.nproc),
              "sigint": lambda: drill_sigint(args.out, args.nproc),
              "orphan": lambda: drill_orphan(args.out, args.nproc),
              "preempt": lambda: drill_preempt(args.out, args.nproc, reference),
              "store": lambda: drill_store(args.out)}
    for name in wanted:
        print(drills[name](), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
