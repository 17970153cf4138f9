"""Per-rank batches: slicing global batches by data-parallel rank, one reader per tp group, prefetch.

Global batch k (counting from the resume point) is samples [c + k*G, c + (k+1)*G) of
the dataset, c = consumed samples, G = train.global_batch_size. Data-parallel rank r
of dp takes the contiguous slice [r*G/dp, (r+1)*G/dp) of it and yields it as
micro-batches of train.micro_batch_size. Which samples make up a global batch thus
depends only on the seed and the data, never on the layout.

Ranks of one tensor-parallel group need identical data, so only the group's first
rank (``src_rank``) reads from disk and broadcasts; the others only receive. A
background thread reads the next ``prefetch`` slices ahead; it does no collectives,
which stay on the main thread in program order.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megascale.data.blended import SampleDataset, build_split_datasets, parse_data_paths
from megascale.data.demo import build_demo_corpus, default_demo_dir
from megascale.errors import UserError
from megascale.run_plan import resolve_plan

if TYPE_CHECKING:
    from megascale.config import Config
    from megascale.distributed.topology import ParallelContext
    from megascale.run_plan import RunPlan

DEMO_VOCAB = 8192

# A source that failed to read sends a batch whose first token is this, so receivers never
# hang in the broadcast, and on CPU raise a clear error (no extra collective per step).
_FAILED = -1


class _Prefetcher:
    """Reads local batch slices for consecutive positions on a background thread."""

    def __init__(self, read: Any, start: int, step: int, depth: int) -> None:
        self._read = read
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(start, step), daemon=True, name="megascale-data")
        self._thread.start()

    def _run(self, position: int, step: int) -> None:
        while not self._stop.is_set():
            try:
                item: Any = self._read(position)
            except BaseException as err:  # noqa: BLE001 - handed to the main thread, which re-raises it
                item = err
            while not self._stop.is_set():
                try:
                    self._queue.put((position, item), timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            position += step

    def get(self, position: int) -> np.ndarray:
        """The slice read for `position` (positions are consumed in order)."""
        got, item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        assert got == position, f"prefetch out of order: got {got}, wanted {position}"
        return item

    def close(self) -> None:
        """Stop the thread (it may be blocked on a full queue: drain it)."""
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.05)
            self._thread.join(timeout=0.05)


class BatchIterator:
    """Micro-batches of one optimizer step for this rank; see the module docstring.

    ``next_step()`` returns a list of ``num_microbatches`` dicts
    ``{"tokens": LongTensor[mb, s], "labels": LongTensor[mb, s]}`` on ``device``.
    ``dataset`` is None on ranks that only receive (tp rank > 0). With ``cycle`` the
    position wraps at ``num_samples`` (validation); otherwise running past it is an error.
    """

    def __init__(self, dataset: Optional[SampleDataset], *, num_samples: int, seq_length: int,
                 global_batch_size: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0, cycle: bool = False, src_rank: int = 0, group: Any = None,
                 rank: int = 0, device: Optional[torch.device] = None, prefetch: int = 2,
                 vocab_size: Optional[int] = None, name: str = "train", tokenizer: Optional[str] = None) -> None:
        per_rank, rest = divmod(global_batch_size, dp_size)
        if rest or per_rank % micro_batch_size:
            raise UserError(f"train.global_batch_size={global_batch_size} must be divisible by "
                            f"dp {dp_size} * train.micro_batch_size {micro_batch_size}")
        self.is_source = group is None or rank == src_rank
        if self.is_source:
            if dataset is None:
                raise ValueError("the source rank needs a dataset")
            if len(dataset) < num_samples:
                raise ValueError(f"dataset holds {len(dataset)} samples, {num_samples} requested")
        self.dataset = dataset if self.is_source else None
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.local_batch_size = per_rank
        self.num_microbatches = per_rank // micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cycle = cycle
        self.src_rank, self.group = src_rank, group
        self.device = device or torch.device("cpu")
        self.prefetch = prefetch
        self.vocab_size = vocab_size
        self.name = name
        self.tokenizer = tokenizer
        self._start = consumed_samples
        self._position = consumed_samples
        self._prefetcher: Optional[_Prefetcher] = None

    # position ----------------------------------------------------------------
    @property
    def consumed_samples(self) -> int:
        """Samples of all data-parallel ranks consumed so far (the resume position)."""
        return self._position

    def state_dict(self) -> dict:
        """Position to save in a checkpoint (the same on every rank)."""
        return {"consumed_samples": self._position}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position."""
        self._stop_prefetch()
        self._position = int(state["consumed_samples"])
        self._start = self._position

    def reset(self) -> None:
        """Back to the position this iterator started from (e.g. the same validation set each time)."""
        self.load_state_dict({"consumed_samples": self._start})

    def skip_step(self) -> None:
        """Advance one step without reading (for ranks that need no data, such as middle pipeline stages)."""
        self._stop_prefetch()
        self._position += self.global_batch_size

    # reading -----------------------------------------------------------------
    def sample_ids(self, position: int) -> np.ndarray:
        """Dataset indices of this rank's slice of the global batch starting at `position`."""
        first = position + self.dp_rank * self.local_batch_size
        ids = np.arange(first, first + self.local_batch_size, dtype=np.int64)
        if self.cycle:
            return ids % self.num_samples
        if ids[-1] >= self.num_samples:
            raise UserError(f"{self.name} data exhausted: sample {int(ids[-1])} asked, {self.num_samples} built "
                            f"(train.steps * global_batch_size); rebuild the loader with more train.steps")
        return ids

    def read_local(self, position: int) -> np.ndarray:
        """[local batch, seq_length+1] int64 tokens of this rank's slice (source rank only)."""
        assert self.dataset is not None
        ids = self.sample_ids(position)
        batch = np.stack([self.dataset[int(i)] for i in ids])
        if self.vocab_size is not None and batch.size and int(batch.max()) >= self.vocab_size:
            sample = int(ids[int(np.argmax(batch.max(axis=1)))])
            tokenizer = f"data.tokenizer={self.tokenizer}" if self.tokenizer else "data.tokenizer unset"
            raise UserError(f"{self.name} sample {sample} from dataset {sample_source(self.dataset, sample)} "
                            f"holds token id {int(batch.max())} >= model.vocab_size {self.vocab_size} "
                            f"({tokenizer}): the data was tokenized with a larger vocabulary than this model's; "
                            "re-run `megascale preprocess` with the model's tokenizer, or raise model.vocab_size "
                            "if that dataset's tokenizer is the one you mean")
        if batch.size and int(batch.min()) < 0:  # signed Megatron dtypes can hold them
            raise UserError(f"{self.name} data holds negative token id {int(batch.min())}; the dataset was not "
                            "made by a tokenizer: re-create it with `megascale preprocess`")
        return batch

    def _stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def _next_local(self) -> np.ndarray:
        if self.prefetch <= 0:
            return self.read_local(self._position)
        if self._prefetcher is None:
            self._prefetcher = _Prefetcher(self.read_local, self._position, self.global_batch_size, self.prefetch)
        return self._prefetcher.get(self._position)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """Micro-batches of the next optimizer step for this rank."""
        shape = (self.local_batch_size, self.seq_length + 1)
        error: Optional[BaseException] = None
        if self.is_source:
            try:
                local = torch.from_numpy(self._next_local())
            except BaseException as err:  # tell the receivers before raising
                if self.group is None:
                    raise
                error, local = err, torch.full(shape, _FAILED, dtype=torch.int64)
            if self.device.type == "cuda":
                local = local.pin_memory().to(self.device, non_blocking=True)
            else:
                local = local.to(self.device)
        else:
            local = torch.empty(shape, dtype=torch.int64, device=self.device)
        if self.group is not None:
            dist.broadcast(local, src=self.src_rank, group=self.group)
            if error is not None:
                raise error
            # Reading one element back is free on CPU; on a GPU it would stall the host every
            # step, so there the receivers rely on the source's own error ending the job.
            if not self.is_source and self.device.type == "cpu" and int(local[0, 0]) == _FAILED:
                raise UserError(f"reading {self.name} data failed on rank {self.src_rank} (this rank's tensor-"
                                f"parallel source); see its error message")
        self._position += self.global_batch_size  # with cycle, sample_ids wraps it
        mb = self.micro_batch_size
        return [{"tokens": local[i * mb:(i + 1) * mb, :-1].contiguous(),
                 "labels": local[i * mb:(i + 1) * mb, 1:].contiguous()}
                for i in range(self.num_microbatches)]

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        return self.next_step()

    def close(self) -> None:
        """Stop the background reader."""
        self._stop_prefetch()

    def __del__(self) -> None:
        # A plain try (not contextlib.suppress): __del__ may run at interpreter shutdown, when module globals are gone.
        try:  # noqa: SIM105
            self._stop_prefetch()
        except Exception:  # noqa: BLE001 - a finalizer must never raise
            pass


# ----------------------------------------------------------------------------- building from config


def demo_cache_dir(cfg: Config) -> Path:
    """Where the demo corpus lives: data.cache_dir/demo, else ~/.cache/megascale/demo."""
    return Path(cfg.data.cache_dir) / "demo" if cfg.data.cache_dir else default_demo_dir()


def sample_source(dataset: Any, index: int) -> str:
    """The indexed dataset (its prefix) sample `index` of a GPT or blended dataset comes from."""
    while hasattr(dataset, "dataset_index") and hasattr(dataset, "datasets"):  # a blend: follow the sample
        dataset, index = dataset.datasets[int(dataset.dataset_index[index])], int(dataset.dataset_sample_index[index])
    indexed = getattr(dataset, "indexed", None)
    return repr(getattr(indexed, "prefix", "?"))


def dataset_prefixes(cfg: Config) -> tuple[list[str], Optional[list[float]]]:
    """Prefixes and weights from data.paths/weights, building the demo corpus when asked to."""
    prefixes, weights = parse_data_paths(cfg.data.paths, cfg.data.weights)
    if prefixes:
        return prefixes, weights
    if not cfg.data.demo:
        raise UserError("no training data: data.paths is empty; set data.paths=[PREFIX] to a dataset made with "
                        "`megascale preprocess`, or data.demo=true for the built-in demo corpus")
    prefix, _ = build_demo_corpus(demo_cache_dir(cfg), vocab_size=min(DEMO_VOCAB, cfg.model.vocab_size))
    return [prefix], None


def sample_counts(cfg: Config) -> tuple[int, int]:
    """(train samples, validation samples) the run needs.

    Each evaluation reads train.eval_iters global batches from the start of the
    validation split (see BatchIterator.reset), so it sees the same samples
    whatever the layout.
    """
    t = cfg.train
    return t.steps * t.global_batch_size, max(t.eval_iters, 1) * t.global_batch_size


def build_datasets(cfg: Config, num_samples: tuple[int, int, int]) -> list[Optional[SampleDataset]]:
    """Train/valid/test datasets of the config (reads the data; no collectives)."""
    prefixes, weights = dataset_prefixes(cfg)
    cache_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else None
    return build_split_datasets(prefixes, weights, cfg.data.split, cfg.model.seq_length, cfg.train.seed,
                                num_samples, cache_dir)


def data_warnings(cfg: Config, datasets: list[Optional[SampleDataset]]) -> list[str]:
    """Data a run accepts but probably did not mean, one line each with what to do."""
    lines = []
    train = datasets[0]
    members = getattr(train, "datasets", [train]) if train is not None else []
    tokens = sum(int(getattr(m, "tokens_per_epoch", 0)) for m in members)
    seq = cfg.model.seq_length
    if members and tokens <= seq:
        lines.append(f"the training split holds {tokens} tokens, less than one sequence (model.seq_length {seq} "
                     "+ 1): every sample repeats the same text; add data (megascale preprocess) or lower "
                     "model.seq_length")
    if cfg.train.eval_interval and datasets[1] is None:
        lines.append(f"train.eval_interval={cfg.train.eval_interval} but the validation split is empty "
                     f"(data.split={cfg.data.split!r}): no validation loss will be logged; give validation a part "
                     "of data.split (e.g. 98,2,0) over enough documents, or set train.eval_interval=0")
    return lines


def _share_status(ok: bool, flags: list[int], src: int, group: Any, device: torch.device) -> list[int]:
    """Broadcast [ok, *flags] from src over group; returns the received flags."""
    status = torch.tensor([int(ok), *flags], dtype=torch.int64, device=device)
    dist.broadcast(status, src=src, group=group)
    return [int(x) for x in status.tolist()]


def build_data(cfg: Config, ctx: ParallelContext, consumed_samples: int = 0, *,
               plan: Optional[RunPlan] = None) -> tuple[BatchIterator, Optional[BatchIterator]]:
    """(train, valid) batch iterators of this rank; valid is None without validation documents.

    The batch split (global batch, micro-batch, dp) comes from the run plan; without one
    it is resolved from cfg and the context's world size.

    Collective: every rank must call it. Global rank 0 builds the sample indices first
    (and caches them), then the other tensor-parallel sources load them; the rest of
    each tp group reads nothing. A data error on a source is reported on every rank.
    """
    if plan is None:
        plan = resolve_plan(cfg, ctx.world_size)
    if plan.dp != ctx.dp_size:
        raise ValueError(f"the run plan has dp {plan.dp} but the ParallelContext dp {ctx.dp_size}")
    src_rank = ctx.ranks("tp")[0]
    group = ctx.group("tp")
    is_source = group is None or ctx.rank == src_rank
    distributed = ctx.world_size > 1 and dist.is_available() and dist.is_initialized()
    train_samples, valid_samples = sample_counts(cfg)
    wanted = (train_samples, valid_samples, 0)

    datasets: list[Optional[SampleDataset]] = [None, None, None]
    error: Optional[BaseException] = None
    if ctx.rank == 0:
        try:
            datasets = build_datasets(cfg, wanted)
            for line in data_warnings(cfg, datasets):
                print(f"megascale: warning: {line}", file=sys.stderr, flush=True)
        except Exception as err:  # noqa: BLE001 - shared below so no rank waits forever on a failed builder
            error = err
    if distributed:
        ok, = _share_status(error is None, [], 0, None, ctx.device)
        if not ok and ctx.rank != 0:
            raise UserError("building the datasets failed on rank 0; see its error message")
    if error is not None:
        raise error
    if is_source and ctx.rank != 0:
        try:
            datasets = build_datasets(cfg, wanted)  # from the cache rank 0 just wrote, where it is shared
        except Exception as err:  # noqa: BLE001 - shared below like rank 0's error
            error = err
    has_valid = datasets[1] is not None
    if group is not None:
        ok, valid_flag = _share_status(error is None, [int(has_valid)], src_rank, group, ctx.device)
        if not ok and not is_source:
            raise UserError(f"building the datasets failed on rank {src_rank} (this rank's tensor-parallel "
                            f"source); see its error message")
        has_valid = bool(valid_flag)
    if error is not None:
        raise error

    common: dict[str, Any] = dict(seq_length=plan.seq_length, global_batch_size=plan.global_batch_size,
                                  micro_batch_size=plan.micro_batch_size, dp_rank=ctx.dp_rank, dp_size=plan.dp,
                                  src_rank=src_rank, group=group, rank=ctx.rank, device=ctx.device,
                                  prefetch=cfg.data.prefetch, vocab_size=cfg.model.vocab_size,
                                  tokenizer=cfg.data.tokenizer)
    train = BatchIterator(datasets[0], num_samples=train_samples, consumed_samples=consumed_samples,
                          name="train", **common)
    valid = (BatchIterator(datasets[1], num_samples=valid_samples, cycle=True, name="valid", **common)
             if has_valid else None)
    return train, valid
