"""`fault.*`: the fault-tolerance section of the config tree (hang timeouts, numerical guards, preemption,
fault injection, elastic continuation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megascale.config_fields import _f

NanPolicy = Literal["skip", "rollback", "stop"]
PreemptSignal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2"]
HeartbeatStore = Literal["auto", "store", "files"]
ElasticMode = Literal["none", "dp"]


@dataclass
class FaultConfig:
    """Fault tolerance: hang timeouts, numerical guards, preemption and fault injection."""

    startup_timeout_s: float = _f(600.0, "seconds a rank may take from launch to its first step before it counts "
                                         "as hung")
    step_timeout_s: float = _f(300.0, "seconds one training step may take before the watchdog declares a hang")
    checkpoint_timeout_s: float = _f(900.0, "seconds a checkpoint save or load may block before it counts as hung")
    heartbeat_s: float = _f(5.0, "seconds between watchdog heartbeats")
    run_lock_stale_s: float = _f(120.0, "seconds without a heartbeat after which the run lock of train.output_dir "
                                        "(held by a run on any host) counts as stale and a new run may take it")
    nan_policy: NanPolicy = _f("stop", "on a NaN/Inf loss or gradient norm, or a loss spike: skip the update, "
                                       "rollback to the last checkpoint and skip the batch, or stop", NanPolicy)
    spike_zscore: float = _f(0.0, "a loss more than this many standard deviations above the recent window "
                                  "counts as a spike; 0 = off")
    spike_window: int = _f(50, "steps in the loss window the spike z-score is measured against")
    max_rollbacks: int = _f(3, "rollbacks allowed in one run before the nan policy gives up and stops")
    max_consecutive_skips: int = _f(10, "nan_policy=skip: faulty steps in a row after which the weights count "
                                        "as broken and training stops; 0 = never")
    preempt_signal: PreemptSignal = _f("SIGTERM", "signal that asks for a checkpoint and a clean exit (Slurm --signal "
                                                   "sends SIGUSR1)", PreemptSignal)
    preempt_grace_s: float = _f(60.0, "seconds after the preemption signal in which a final checkpoint may be "
                                      "written")
    inject: Optional[str] = _f(None, "fault injection for tests and drills, e.g. 'kill:rank=1:step=5' "
                                     "(see docs/reliability.md); also read from MEGASCALE_FAULT")
    watchdog: bool = _f(True, "run the per-rank hang watchdog thread (heartbeats, phase timeouts, stack dumps)")
    heartbeat_store: HeartbeatStore = _f("auto", "where heartbeats go: the launcher's c10d store, files in "
                                                 "<output_dir>/.heartbeats, or auto (the store when the elastic "
                                                 "agent hosts it, else files)", HeartbeatStore)
    collective_timeout_s: float = _f(0.0, "process-group timeout for one collective; 0 = the longest phase timeout "
                                          "plus 60 s, so the watchdog names the hung rank before a collective "
                                          "times out")
    elastic: ElasticMode = _f("none", "dp: a world size other than the configured one (an elastic restart on fewer "
                                     "or more ranks) re-plans data parallelism: dp = world / (tp*pp*cp), tp/pp/cp "
                                     "stay, and the global batch is kept by more or fewer micro-batches per step "
                                     "(micro_batch_size lowered where it would not split); none: parallel.dp must "
                                     "match the world size. `megascale train --min-nproc` sets dp",
                              ElasticMode)
