"""The training loop: config -> ParallelContext -> model -> schedule -> reduce -> optimizer -> checkpoint."""

from __future__ import annotations

import math
import os
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megascale.checkpoint.format import complete_checkpoints, parse_step
from megascale.config import Config, ConfigError
from megascale.data.tokenizer import check_tokenizer
from megascale.distributed.random import seed_everything
from megascale.distributed.sequence import attention_kernels_for, build_sequence_layout
from megascale.distributed.sharding import TensorShard
from megascale.distributed.topology import ParallelContext
from megascale.model.flops import causal_halved_train_flops_per_token, train_flops_per_token
from megascale.model.fp8_layers import check_fp8
from megascale.model.gpt import build_model
from megascale.model.moe import moe_layer_ids, reduce_moe_stats, update_router_biases
from megascale.perf.flops import device_peak, fp8_peak
from megascale.run_plan import RunPlan, resolve_plan
from megascale.timers import PhaseTimers
from megascale.training.fault import numerics
from megascale.training.fault.events import append_event, read_events
from megascale.training.fault.inject import FaultInjector
from megascale.training.fault.progress import Progress
from megascale.training.metrics import MetricsSink, elapsed_and_eta, format_line, moe_fields
from megascale.training.profiling import StepProfiler
from megascale.training.run_dir import write_run_config
from megascale.training.step import evaluate, forward_backward_voting
from megascale.training.timer_log import TimerLog

if TYPE_CHECKING:  # built lazily below: these pull in the heavy optimizer/checkpoint stacks
    from megascale.checkpoint.manager import CheckpointManager
    from megascale.distributed.data_parallel.optimizer import DistributedOptimizer, StepStats
    from megascale.training.fault.lifecycle import RunLifecycle


def device_type(cfg: Config) -> str:
    """'cuda' when asked for or available (auto), else 'cpu'; one clear error if cuda is asked for but absent."""
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    return "cpu" if want == "cpu" or not torch.cuda.is_available() else "cuda"


def resolve_device(cfg: Config) -> torch.device:
    """This rank's device: see device_type; a CUDA rank takes the GPU of its LOCAL_RANK."""
    if device_type(cfg) == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def world_position() -> tuple[int, int]:
    """(rank, world size) of this process: from the initialised process group, else (0, 1)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def make_context(plan: RunPlan, rank: int, device: torch.device) -> ParallelContext:
    """ParallelContext of global rank `rank` under the plan's layout (creates its process groups)."""
    return ParallelContext(plan.rank_layout(), rank=rank, vpp=plan.vpp, device=device, v_shape=plan.v_shape)


def validate_runtime(cfg: Config, device: torch.device) -> None:
    """Checks the layout cannot make: precision and attention-kernel support of the device, the data on disk."""
    if device.type == "cpu" and cfg.train.dtype == "fp16":
        raise ConfigError("train.dtype=fp16 is not supported on CPU; use fp32 or bf16")
    attention_kernels_for(cfg, device)  # an explicit kernels.attention this device cannot serve
    check_fp8(cfg, device)
    check_data_paths(cfg)


def check_data_paths(cfg: Config) -> None:
    """Fail before building anything when the training data (or its tokenizer) is missing or does not fit."""
    d = cfg.data
    check_tokenizer(d.tokenizer, cfg.model.vocab_size)
    if not d.paths:
        if d.demo:
            return
        raise ConfigError("data.paths is empty; set data.paths to dataset prefixes made by `megascale preprocess` "
                          "(X for X.bin/X.idx), or data.demo=true for the built-in demo corpus")
    for item in d.paths:
        prefix = str(item)
        try:
            float(prefix)
            continue  # a blend weight in 'weight prefix weight prefix' form
        except ValueError:
            pass
        missing = [ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
        if missing:
            raise ConfigError(f"data.paths: '{prefix}{missing[0]}' not found; run `megascale preprocess "
                              f"--output-prefix {prefix} ...` or fix the path")


class Trainer:
    """Builds everything from one Config and runs `train()`; usable in-process or as one torchrun rank."""

    def __init__(self, cfg: Config, progress: Optional[Progress] = None) -> None:
        self.cfg = cfg
        # Fault tolerance: phase marks read by the hang watchdog; injected faults for drills.
        self.progress = progress or Progress()
        self.device = resolve_device(cfg)
        rank, world = world_position()
        self.plan = resolve_plan(cfg, world)  # again in every worker: the launcher resolved it before spawning
        self.ctx = make_context(self.plan, rank, self.device)
        self.faults = FaultInjector.from_config(cfg, self.ctx.rank)
        validate_runtime(cfg, self.device)
        self.attention = attention_kernels_for(cfg, self.device)  # the run's kernels, passed to the layout
        numerics.validate(cfg)
        self.run_dir = Path(cfg.train.output_dir)
        self.sink = MetricsSink(self.run_dir, self.ctx.is_logging_rank, cfg.log.tensorboard, cfg)
        self.timers = PhaseTimers(cfg.log.timers, self.device)  # passed to everything that runs a phase
        self.rng = seed_everything(cfg.train.seed, self.ctx.tp_rank, self.ctx.pp_rank, self.device, self.ctx.cp_rank)
        if self.ctx.pp_size > 1 and self.ctx.pp_group is not None:
            # NCCL: the first op on the pp group must include every member, not a batched p2p.
            dist.barrier(group=self.ctx.pp_group)
        sequence = build_sequence_layout(self.ctx, cfg, timers=self.timers, kernels=self.attention)
        # ZeRO-3 initialises the parameters bucket by bucket into their shards (never the whole model at once).
        self.chunks = build_model(cfg, self.ctx, self.rng, plan=self.plan, timers=self.timers, sequence=sequence,
                                  materialize=cfg.parallel.zero < 3)
        self.optimizer = self._build_optimizer()
        self.timer_log = TimerLog(self.ctx, self.run_dir, cfg.log.timers, cfg.log.straggler_threshold,
                                  cfg.log.straggler_window, self.sink.print)
        self.profiler = StepProfiler(cfg.log.profile_steps, self.run_dir, self.ctx.rank, self.device)
        self.step = 0
        self.consumed_samples = 0
        self.skipped_steps = 0
        self.resumed_extra: dict = {}
        self.ckpt = self._build_checkpointing()
        # Numerical faults: NaN/Inf/spike verdicts, their counters, and finite-only checkpoint commits.
        self.numerics = numerics.NumericsGuard.from_config(cfg)
        self.ckpt.state_check = numerics.first_nonfinite
        self.progress.enter("checkpoint_load")
        self._resume()
        self._catch_up_uploads()
        self.progress.enter("startup")
        from megascale.data.loader import build_data

        self.train_data, self.valid_data = build_data(cfg, self.ctx, self.consumed_samples, plan=self.plan)
        self.peak = device_peak(self.device, cfg.train.peak_tflops)
        # train.fp8: mfu_fp8 beside mfu, against the FP8 peak (None where the device has none).
        self.fp8_peak = fp8_peak(self.device) if cfg.train.fp8 != "off" else None
        self.flops_per_token = train_flops_per_token(cfg.model)
        self.causal_halved_flops_per_token = causal_halved_train_flops_per_token(cfg.model)
        self.memory_estimate_gb = 0.0
        if self.ctx.rank == 0:  # written once the model, the checkpoint and the data have all loaded
            write_run_config(cfg, self.run_dir)
        if self.ctx.is_logging_rank:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._announce()
        self.lifecycle = self._build_fault_lifecycle()
        if cfg.checkpoint.interval or cfg.checkpoint.save_final:
            # Host buffers for async saves, allocated under the first steps; started last, so a setup error above
            # (bad data, say) never leaves this thread in torch's allocator while the interpreter exits (abort).
            self.ckpt.prepare(self.state_shards())

    # ------------------------------------------------------------------ setup
    def _build_optimizer(self) -> DistributedOptimizer:
        from megascale.distributed.data_parallel.optimizer import DistributedOptimizer

        return DistributedOptimizer(self.chunks, self.ctx, self.cfg, timers=self.timers)

    def _build_fault_lifecycle(self) -> RunLifecycle:
        from megascale.training.fault.elastic import layout_record
        from megascale.training.fault.lifecycle import RunLifecycle

        return RunLifecycle(self.cfg, self.ctx.rank, self.ctx.world_size, self.device, self.run_dir, self.step,
                            self.resumed_extra, self.sink.print, layout=layout_record(self.plan))

    def _build_checkpointing(self) -> CheckpointManager:
        from megascale.checkpoint.manager import CheckpointManager
        from megascale.checkpoint.storage import checkpoint_roots

        local, remote = checkpoint_roots(self.cfg.checkpoint.dir, str(self.run_dir))
        manager = CheckpointManager(local, self.ctx, self.cfg, remote_url=remote)
        if manager.remote is not None:
            manager.remote.on_failure = self._upload_failed
            manager.remote.on_uploaded = self._uploaded
        if self.faults.active:
            manager.fault_hook = self.faults.checkpoint_hook(lambda: manager.last_save_stats.get("step", 0))
        return manager

    def _catch_up_uploads(self) -> None:
        """Rank 0 queues the local tier's commits the remote tier lacks (an earlier run's failed upload) on the
        background uploader, once the resume has read what it needs; the run's end waits for them."""
        if self.ckpt.remote is None or self.ctx.rank != 0:
            return
        self.ckpt.remote.catch_up(complete_checkpoints(self.ckpt.root))

    def _uploaded(self, name: str, size: int, seconds: float) -> None:
        """A checkpoint committed in the remote tier (called on rank 0's upload thread): one line says so."""
        assert self.ckpt.remote is not None
        print(f"checkpoint {name} uploaded to {self.ckpt.remote.store.url} ({size / 2**20:.1f} MiB in {seconds:.2f} s)",
              flush=True)

    def _upload_failed(self, name: str, error: str) -> None:
        """A checkpoint the remote tier could not take (called on the upload thread): a `checkpoint_upload_failed`
        event; the tier itself logs the line, and the run goes on from the local tier."""
        append_event(self.run_dir, "checkpoint_upload_failed", step=parse_step(Path(name)), ranks=[self.ctx.rank],
                     checkpoint=name, error=error)

    def state_shards(self) -> list[TensorShard]:
        """Model and optimizer state of this rank as checkpoint shards."""
        return self.optimizer.model_shards() + self.optimizer.state_shards()

    def _resume(self) -> None:
        c = self.cfg.checkpoint
        path = Path(c.load) if c.load else None
        if path is None and not c.resume:
            self.ckpt.protect_existing()  # a fresh run never overwrites the step dirs already there
            return
        shards = self.state_shards()
        # Optimizer state the checkpoint lacks (weights only, e.g. converted from HuggingFace, or an
        # fp32 run's checkpoint that has no fp32 master copy) starts fresh from the loaded weights.
        extra = self.ckpt.load(shards, path, optional=lambda name: name.startswith("optim."))
        self.optimizer.params_loaded()  # the load wrote the parameters: FP8 weight copies are stale
        for name, reason in self.ckpt.last_load_stats.get("skipped", []):
            self._note_skipped(name, reason)
        if extra is None:
            return
        stored = self.ckpt.last_load_stats["names"]
        missing = {s.name for s in shards if s.name.startswith("optim.") and s.name not in stored}
        self.resumed_extra = extra
        if missing:
            self.optimizer.reload_master_from_params()
        weights_only = not any(name.startswith("optim.") for name in stored)
        self.step = 0 if weights_only else int(extra.get("step", 0))
        self.consumed_samples = 0 if weights_only else int(extra.get("consumed_samples", 0))
        self.skipped_steps = int(extra.get("skipped_steps", 0))
        if not weights_only:
            self.optimizer.load_extra_state(extra.get("optimizer", {}))
            self.numerics.load_state_dict(extra.get("numerics", {}))
        # A rank's RNG streams belong to its place in the layout: restore them only under the
        # layout the checkpoint was written with (recorded once, in its metadata).
        rng = extra.get("rng", {}).get(str(self.ctx.rank))
        if rng is not None and self.ckpt.last_load_stats.get("same_layout"):
            torch.set_rng_state(torch.tensor(rng["cpu"], dtype=torch.uint8))
            self.rng.load_state_dict(rng["tracker"])
        from megascale.training.fault.attempts import restart_attempt

        if self.ctx.rank == 0 and not weights_only and restart_attempt() == 0:
            # a run started again by hand (restarts of the worker group have their `restart` event)
            ended = [e for e in read_events(self.run_dir) if e["kind"] in ("run_end", "run_failed", "preempted")]
            append_event(self.run_dir, "run_resumed", step=self.step, ranks=[],
                         after=ended[-1]["kind"] if ended else "no terminal event (killed)",
                         checkpoint=str(self.ckpt.last_load_stats.get("path")))
        if self.ctx.is_logging_rank:
            if weights_only:
                self.sink.print(f"loaded model weights from {path or self.ckpt.latest()}; optimizer starts fresh")
            else:
                where = self.ckpt.last_load_stats.get("path")
                tier = self.ckpt.last_load_stats.get("tier", "local")
                self.sink.print(f"resumed from step {self.step} ({self.consumed_samples} samples consumed) "
                                f"from the {tier} tier: {where}")

    def _note_skipped(self, name: str, reason: str) -> None:
        """A checkpoint passed over on resume: one log line and a `checkpoint_skipped` event (rank 0)."""
        self.sink.print(f"checkpoint {name} skipped: {reason}")
        if self.ctx.rank == 0:
            append_event(self.run_dir, "checkpoint_skipped", step=None, ranks=[], checkpoint=name, reason=reason)

    def _announce(self) -> None:
        if not self.ctx.is_logging_rank:
            return
        params = sum(p.numel() for chunk in self.chunks for p in chunk.parameters())
        lines = [f"megascale: {self.ctx.describe()} | device {self.peak.device_name} | "
                 f"peak {self.peak.tflops:.3g} TFLOP/s ({self.peak.label}){self._fp8_peak_clause()}",
                 f"model: {self.cfg.model.num_layers} layers, hidden {self.cfg.model.hidden_size}, "
                 f"{params / 1e6:.2f}M params on this rank | {self.plan.num_microbatches} micro-batches/step | "
                 f"{self.flops_per_token / 1e9:.3f} GFLOP/token",
                 self.attention.choice.describe(ring=self.ctx.cp_size > 1 and self.cfg.parallel.cp_mode != "ulysses",
                                                window=self.cfg.model.attention == "sliding_window")]
        if self.plan.cp_mode == "hybrid" and self.cfg.parallel.ulysses_size is None:
            lines.append(f"parallel.cp_mode=hybrid: picked ulysses_size {self.plan.ulysses_size} x ring "
                         f"{self.plan.ring_size} (the largest divisor of cp {self.plan.cp} dividing the kv heads "
                         f"per tp rank); set parallel.ulysses_size to choose")
        from megascale.perf.memory import estimate_memory, format_memory, kernel_profile

        estimate = estimate_memory(self.cfg, self.plan, kernel_profile(self.device.type, self.cfg.kernels.backend))
        self.memory_estimate_gb = estimate.total_bytes / 2**30
        lines.append(format_memory(estimate))
        for line in lines:
            self.sink.print(line)

    def _fp8_peak_clause(self) -> str:
        """With train.fp8: which peak MFU and mfu_fp8 are against, for the start-up line."""
        if self.cfg.train.fp8 == "off":
            return ""
        if self.fp8_peak is None:
            return "; MFU against the dense bf16 peak; no FP8 peak for this device, so no mfu_fp8"
        return (f"; MFU against the dense bf16 peak; metrics mfu_fp8 against the FP8 peak "
                f"{self.fp8_peak.tflops:.4g} TFLOP/s ({self.fp8_peak.source})")

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        """Run until train.steps; returns the metrics records this rank logged."""
        cfg = self.cfg
        records: list[dict] = []
        tokens_per_step = self.plan.tokens_per_step
        window_start, window_steps = time.perf_counter(), 0
        self.train_start, self.start_step = time.perf_counter(), self.step
        for chunk in self.chunks:
            chunk.train()
        while self.step < cfg.train.steps:
            self.progress.enter("step", self.step + 1)
            step_start = time.perf_counter()
            self.profiler.begin_step(self.step + 1)
            self.timers.begin_step(self.step + 1)
            with self.timers.phase("data_wait"):
                if self.ctx.is_first_stage or self.ctx.is_last_stage:
                    batches = self.train_data.next_step()
                else:  # middle pipeline stages need no tokens: keep the position, skip the read
                    self.train_data.skip_step()
                    batches = [{} for _ in range(self.plan.num_microbatches)]
            self.faults.at("step_start", self.step + 1)
            loss, votes = forward_backward_voting(
                self.chunks, batches, plan=self.plan, ctx=self.ctx, optimizer=self.optimizer,
                progress=self.progress, loss_hook=self.faults.loss_hook(self.step + 1), timers=self.timers,
                stop_vote=self.lifecycle.stop_vote)
            self.faults.at("after_forward", self.step + 1)
            self.progress.collective = "optimizer"
            with self.timers.phase("checkpoint_blocking"):
                self.ckpt.before_update()  # an async checkpoint's snapshot ran under this forward/backward
            with self.timers.phase("optimizer"):
                stats = self.optimizer.step(self.step, loss=loss, guard=self.numerics.check, stop_votes=votes)
            self._report_checkpoint()
            self.step += 1
            self.consumed_samples += cfg.train.global_batch_size
            self.skipped_steps += int(stats.skipped)
            log_step = self.step % cfg.log.interval == 0 or self.step == cfg.train.steps
            moe_table = self._moe_step(stats, log_step)
            if stats.fault is not None:  # its update was withheld on every rank: skip, roll back or stop
                numerics.apply_policy(self, stats.fault)
            window_steps += 1
            # Logging, evaluation and progress records are the logging rank's bookkeeping, not model
            # compute: timed apart so they do not make it look like a straggler (closed below).
            bookkeeping = self.timers.phase("logging")
            bookkeeping.__enter__()
            self.progress.collective = "log and evaluate"
            if log_step:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = (time.perf_counter() - window_start) / window_steps
                rec = self._record(loss, stats, elapsed, tokens_per_step)
                if moe_table is not None:
                    rec.update(moe_fields(moe_table, moe_layer_ids(cfg.model)))
                rec.update(elapsed_and_eta(time.perf_counter() - self.train_start, self.step - self.start_step,
                                           cfg.train.steps - self.step))
                if cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0 and self.valid_data:
                    rec["val_loss"] = evaluate(self.chunks, self.valid_data, cfg.train.eval_iters, plan=self.plan,
                                              ctx=self.ctx)
                self.sink.write(rec)
                self.sink.print(format_line(rec, cfg.train.steps, self.peak.source) + self.timer_log.log_fields())
                if len(records) == 0 and self.device.type == "cuda" and self.memory_estimate_gb:
                    self.sink.print(f"memory: measured peak {rec['mem_gb']:.2f} GiB vs estimate "
                                    f"{self.memory_estimate_gb:.2f} GiB "
                                    f"({100 * (rec['mem_gb'] / self.memory_estimate_gb - 1):+.0f}%)")
                records.append(rec)
                window_start, window_steps = time.perf_counter(), 0
            self.lifecycle.step_done(self.step, time.perf_counter() - step_start)
            bookkeeping.__exit__(None, None, None)
            if self._should_save():
                self.progress.enter("checkpoint_save")
                with self.timers.phase("checkpoint_blocking"):
                    self.save()
            self.timer_log.step_done(self.timers.end_step(), self.step, self.step % cfg.log.interval == 0)
            self.profiler.end_step(self.step)
            if self.lifecycle.stop_requested(stats.stop_votes):  # preemption: every rank stops after this same step
                self.progress.enter("checkpoint_save")
                self.lifecycle.preempt_save(self)
                break
        self.progress.enter("checkpoint_save")
        self.ckpt.wait()
        self._wait_uploads()
        self.progress.enter("done")
        self._report_checkpoint()
        self.timer_log.add(self.timers.flush())
        self.timer_log.close(self.step)
        self.profiler.close()
        self.sink.close()
        self.lifecycle.finish(self.run_dir)  # raises Preempted (SystemExit) after a preemption
        return records

    def _moe_step(self, stats: StepStats, log_step: bool) -> Optional[torch.Tensor]:
        """MoE bookkeeping after an optimizer step: the step's router statistics of every MoE layer summed over
        all ranks (one all-reduce, when they are logged or the sigmoid router's bias moves), and the bias update
        from the global loads (withheld with the step's update). None for a dense model or a quiet step."""
        moe = self.cfg.model.moe
        balancing = moe.enabled and moe.bias_update_rate > 0 and moe.router == "sigmoid"
        if not moe.enabled or not (log_step or balancing):
            return None
        table = reduce_moe_stats(self.chunks, self.cfg.model, self.ctx.device)
        if balancing and not stats.skipped and stats.fault is None:
            update_router_biases(self.chunks, self.cfg.model, table)
        return table

    def _report_checkpoint(self) -> None:
        """One line per finished save: how long training was blocked and how long the save took."""
        stats = getattr(self.ckpt, "last_save_stats", None) or {}
        if stats.get("total_s") is None or stats.get("reported"):
            return
        stats["reported"] = True
        numerics.note_checkpoint(self, stats)
        if self.ctx.is_logging_rank:
            state = "saved" if stats.get("ok") else f"FAILED ({stats.get('error')}); latest stays on the previous one"
            self.sink.print(f"checkpoint step {stats['step']} {state}: training blocked {stats['blocking_s']:.3f} s, "
                            f"total {stats['total_s']:.2f} s, {stats.get('bytes', 0) / 2**20:.1f} MiB")
        if not stats.get("ok") and numerics.NONFINITE_TAG not in (stats.get("error") or ""):
            if self.ctx.rank == 0:
                append_event(self.run_dir, "checkpoint_failed", step=int(stats["step"]), ranks=[],
                             error=str(stats.get("error"))[:500], final=stats["step"] == self.cfg.train.steps)
            self._save_failed(stats)

    def _wait_uploads(self) -> None:
        """The remote tier must hold the final checkpoint before the run reports success."""
        error = self.ckpt.wait_uploads()
        if error is None or self.ckpt.remote is None:
            return
        from megascale.checkpoint.format import CheckpointSaveFailed

        raise CheckpointSaveFailed(f"{error}; the checkpoints stay in the local tier {self.ckpt.root}: fix the store, "
                                   "then run the same command again (it first uploads the local checkpoints the "
                                   "store lacks; a finished run only uploads them and exits)")

    def _save_failed(self, stats: dict) -> None:
        """A failed save (disk full, failing file system): the final one, or any with on_save_failure=stop, ends
        the run with a non-zero exit; the last good checkpoint stays intact either way."""
        final = stats["step"] == self.cfg.train.steps
        if not final and self.cfg.checkpoint.on_save_failure == "continue":
            return
        if self.lifecycle.preempted_at is not None:  # the preemption's exit code says it: 75 or 128 + the signal
            return
        from megascale.checkpoint.format import CheckpointSaveFailed

        latest = self.ckpt.latest()
        why = "the final checkpoint" if final else "checkpoint.on_save_failure=stop"
        raise CheckpointSaveFailed(f"checkpoint step {stats['step']} was not saved ({why}): {stats.get('error')}; "
                                   f"the last good checkpoint {latest.name if latest else '(none)'} is intact: free "
                                   "space or fix the file system, then run again to resume from it")

    def _record(self, loss: torch.Tensor, stats: StepStats, step_time: float, tokens_per_step: int) -> dict:
        tokens_per_s = tokens_per_step / step_time
        tflops = self.flops_per_token * tokens_per_s / self.ctx.world_size / 1e12
        rec = {
            "step": self.step,
            "loss": float(loss),
            "lr": float(stats.lr),
            "grad_norm": float(stats.grad_norm),
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peak.tflops,
            "mfu_causal_halved": tflops / self.peak.tflops * self.causal_halved_flops_per_token / self.flops_per_token,
            "step_time_s": step_time,
            "mem_gb": self._memory_gb(),
            "consumed_samples": self.consumed_samples,
            "skipped_steps": self.skipped_steps,
            "loss_scale": float(stats.loss_scale),
            **self.numerics.counters(),
        }
        if self.fp8_peak is not None:
            rec["mfu_fp8"] = tflops / self.fp8_peak.tflops
        if not math.isfinite(rec["loss"]):
            rec["loss"] = float("nan")
        return rec

    def _memory_gb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB

    def _should_save(self) -> bool:
        c = self.cfg.checkpoint
        if c.interval and self.step % c.interval == 0:
            return True
        return c.save_final and self.step == self.cfg.train.steps

    def save(self) -> None:
        """Checkpoint the current state (asynchronously when configured)."""
        if not numerics.may_save(self):  # same verdict on every rank: all of them skip
            return
        # Every rank writes its own extra state: it holds this rank's streams only. Layout and
        # config are recorded once per checkpoint, by the checkpoint manager in metadata.json.
        rng = {str(self.ctx.rank): {"cpu": torch.get_rng_state().tolist(), "tracker": self.rng.state_dict()}}
        extra = {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "skipped_steps": self.skipped_steps,
            "optimizer": self.optimizer.extra_state(),
            "numerics": self.numerics.state_dict(),
            "rng": rng,
            **self.lifecycle.checkpoint_state(),
        }
        self.optimizer.wait_params()  # zero=1: updated params may still be in flight to this rank
        self.ckpt.save(self.step, self.state_shards(), extra)
