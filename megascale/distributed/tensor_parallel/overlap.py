"""Tensor-parallel communication/computation overlap (`parallel.tp_overlap`).

The plain tensor-parallel layers run "communicate, then compute": with sequence
parallelism a column-parallel GEMM waits for the whole all-gather of its input,
and a row-parallel GEMM finishes before its reduce-scatter starts. Here each
collective is split into one chunk per tp rank (the rank's sequence shard) and
pipelined with the GEMM on the chunk that has already arrived (MegaScale,
NSDI 2024, after Wang et al.'s "decomposition" and TransformerEngine's ring
exchange):

* column, SP, forward: ring all-gather of x. At step k a rank multiplies the
  shard it holds while passing that shard to its ring successor and receiving
  the next one from its predecessor; tp GEMMs hide tp-1 transfers.
* column, SP, backward: ring reduce-scatter of dx. Each step computes the
  partial dx of one sequence chunk while the previous chunk's partial sum
  travels one hop; the weight-gradient GEMM runs under the last hop.
* row, SP, forward: the same ring reduce-scatter, with the GEMM of chunk i+1
  under the transfer of chunk i.
* row, SP, backward: ring all-gather of the output gradient, with the dx and
  dweight GEMMs of each arrived chunk under the next transfer.
* column, no SP: backward starts the dx all-reduce asynchronously and computes
  the weight gradient under it (Megatron's async grad all-reduce).
* row, no SP: forward all-reduces the output in sequence chunks, chunk i in
  flight while chunk i+1 is computed.

Communication goes through `_Channel`: on CPU it returns gloo's asynchronous
work handles (gloo runs them on its own threads), on CUDA it issues the
collective from a side stream ordered after the compute stream by an event,
and the compute stream waits on the side stream's completion event only where
it reads the data; the host never synchronises the device.

Numerics: every output element is the same dot products as the reference path;
only the order of the cross-rank sums (ring order instead of the library's
reduce-scatter order) and of the chunked weight-gradient sums changes, so
results match the non-overlapped path to float32 reduction-order noise
(relative ~1e-6), not bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from megascale.distributed import comm
from megascale.timers import timed

if TYPE_CHECKING:
    from megascale.distributed.tensor_parallel.layers import TPSettings

__all__ = ["column_linear", "column_linears", "row_linear", "row_linear_sum"]


class _InFlight:
    """A communication that has been issued; `wait()` orders the caller after it."""

    def __init__(self, works: Optional[list[Any]] = None, event: Optional[torch.cuda.Event] = None,
                 timers: Any = None) -> None:
        self.works = works or []
        self.event = event
        self.timers = timers

    def wait(self) -> None:
        """Block on gloo work (CPU) or make the current CUDA stream wait for the side stream;
        timed as tp_overlap_wait: the part of the overlapped communication the GEMMs did not hide."""
        with timed(self.timers, "tp_overlap_wait"):
            if self.event is not None:
                torch.cuda.current_stream().wait_event(self.event)
            for work in self.works:
                work.wait()
        self.works, self.event = [], None


class _Channel:
    """Issues this tp group's collectives so that they run beside the GEMMs."""

    def __init__(self, group: Any, device: torch.device, timers: Any = None) -> None:
        self.group, self.timers = group, timers
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # p2p ops address peers by global rank.
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)
        # Streams come from torch's per-device pool, so creating one per call is cheap
        # and keeps this module free of cached global state.
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def _issue(self, launch: Callable[[], list[Any]], tensors: tuple[torch.Tensor, ...]) -> _InFlight:
        if self.stream is None:
            return _InFlight(works=launch(), timers=self.timers)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.stream.device))
        self.stream.wait_event(ready)  # inputs were written on the compute stream
        with torch.cuda.stream(self.stream):
            for work in launch():
                work.wait()  # NCCL: a stream dependency of the side stream, not a host wait
            done = torch.cuda.Event()
            done.record(self.stream)
        for t in tensors:
            # Allocated on the compute stream, used on the side stream: keep the caching
            # allocator from reusing the memory before the side stream is done with it.
            t.record_stream(self.stream)
        return _InFlight(event=done, timers=self.timers)

    def ring_exchange(self, send: torch.Tensor, recv: torch.Tensor) -> _InFlight:
        """Send `send` to the next rank of the ring and receive the previous rank's into `recv`."""
        ops = [dist.P2POp(dist.isend, send, self.next_peer, self.group),
               dist.P2POp(dist.irecv, recv, self.prev_peer, self.group)]
        # batch_isend_irecv groups the pair so NCCL cannot deadlock when next == prev (tp=2).
        return self._issue(lambda: list(dist.batch_isend_irecv(ops)), (send, recv))

    def all_reduce(self, tensor: torch.Tensor) -> _InFlight:
        """Sum `tensor` in place over the group, asynchronously."""
        return self._issue(lambda: [dist.all_reduce(tensor, group=self.group, async_op=True)], (tensor,))

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor) -> _InFlight:
        """Every rank's `shard` concatenated along dim 0 into `out`, asynchronously."""
        return self._issue(lambda: [dist.all_gather_into_tensor(out, shard, group=self.group, async_op=True)],
                           (out, shard))

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor) -> _InFlight:
        """This rank's dim-0 slice of the sum of `tensor` over the group into `out`, asynchronously."""
        return self._issue(lambda: [dist.reduce_scatter_tensor(out, tensor, group=self.group, async_op=True)],
                           (out, tensor))


def _mm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[..., k] @ [k, n] -> [..., n], written into out (a contiguous view) when given."""
    a2d = a.reshape(-1, a.shape[-1])
    if out is None:
        return torch.mm(a2d, b).view(*a.shape[:-1], b.shape[-1])
    torch.mm(a2d, b, out=out.view(-1, b.shape[-1]))
    return out


def _weight_grad(grad_out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """dW = grad_out^T @ inp over all leading dims: [out, in]."""
    return torch.mm(grad_out.reshape(-1, grad_out.shape[-1]).t(), inp.reshape(-1, inp.shape[-1]))


def _fuse_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Weights [n_i, in] that read one input, stacked along their output rows for one GEMM
    (the tensor itself for one weight). A temporary: the parameters keep their own layout."""
    return weights[0] if len(weights) == 1 else torch.cat(list(weights), dim=0)


def _weight_grads(grad_out: torch.Tensor, inp: torch.Tensor, weights: Sequence[torch.Tensor],
                  needed: Sequence[bool]) -> list[Optional[torch.Tensor]]:
    """Each column weight's gradient from one `_weight_grad` GEMM over the fused output [.., sum n_i].

    The one place a column layer computes its weight gradients from what its
    backward holds, so a schedule that defers them can call it later.
    """
    if not any(needed):
        return [None] * len(weights)
    parts = _weight_grad(grad_out, inp).split([w.shape[0] for w in weights], dim=0)
    return [part if need else None for part, need in zip(parts, needed)]


def _sum_mm(inputs: Sequence[torch.Tensor], weights_t: Sequence[torch.Tensor],
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sum_i inputs[i] @ weights_t[i] ([.., k_i] @ [k_i, n]), written into out when given."""
    y = _mm(inputs[0], weights_t[0], out=out)
    for x, w_t in zip(inputs[1:], weights_t[1:]):
        y.view(-1, w_t.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), w_t)
    return y


def _check_divisible(length: int, size: int, what: str) -> None:
    if length % size:
        raise ValueError(f"{what}: sequence length {length} is not divisible by tensor-parallel size {size}; "
                         f"choose model.seq_length divisible by parallel.tp")


def _ring_all_gather(channel: _Channel, chunks: list[torch.Tensor],
                     consume: Callable[[int, torch.Tensor], object]) -> None:
    """Fill `chunks` (chunks[rank] already holds this rank's shard) around the ring.

    At step k this rank holds chunk (rank - k) mod tp: it forwards it to the next
    rank, receives chunk (rank - k - 1) from the previous one, and runs
    `consume(index, chunk)` on the held chunk while the transfer is in flight.
    """
    size, rank = channel.size, channel.rank
    pending: Optional[_InFlight] = None
    for step in range(size):
        held = (rank - step) % size
        if pending is not None:
            pending.wait()
        pending = None
        if step < size - 1:
            pending = channel.ring_exchange(chunks[held], chunks[(held - 1) % size])
        consume(held, chunks[held])
    assert pending is None


def _ring_reduce_scatter(channel: _Channel, partial_of: Callable[[int], torch.Tensor],
                         under_last_hop: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """Sum over the group of partial_of(c) for this rank's chunk c = rank, by a pipelined ring.

    At step k this rank computes its partial of chunk (rank - 1 - k) mod tp, adds
    the running sum of that chunk received from the previous rank, and forwards
    it; the next step's GEMM runs while that hop is in flight. The chunk a rank
    finishes on (step tp-1) is its own. `under_last_hop` runs while the final hop
    is in flight (the weight-gradient GEMM).
    """
    size, rank = channel.size, channel.rank
    pending: Optional[_InFlight] = None
    incoming: Optional[torch.Tensor] = None
    total = torch.empty(0)
    for step in range(size):
        total = partial_of((rank - 1 - step) % size)
        if step == size - 1 and under_last_hop is not None:
            under_last_hop()
        if pending is not None:
            assert incoming is not None  # set together with pending
            pending.wait()
            total += incoming
        pending = None
        if step < size - 1:
            incoming = torch.empty_like(total)
            pending = channel.ring_exchange(total, incoming)
    return total


def column_saved(ctx: Any) -> tuple[torch.Tensor, list[torch.Tensor], bool, list[bool]]:
    """(saved input, weights, dX wanted, dW wanted per weight) of a column function `apply(x, settings,
    *weights)`: what the running backward pass asks for (a split backward's B or W, see `comm.needed_grads`)."""
    inp, *weights = ctx.saved_tensors
    needed = comm.needed_grads(ctx)
    return inp, weights, needed[0], list(needed[2:])


def start_regather(channel: _Channel, shard: torch.Tensor, wanted: bool) -> tuple[torch.Tensor, Optional[_InFlight]]:
    """(the gathered input's buffer, its in-flight all-gather) for a column backward that saved only
    this rank's shard; issued first, so it runs under the input-gradient GEMMs. (shard, None) when
    not `wanted`."""
    if not wanted:
        return shard, None
    shard = shard.contiguous()
    full = shard.new_empty((channel.size * shard.shape[0], *shard.shape[1:]))
    return full, channel.all_gather(full, shard)


class _ColumnLinear(torch.autograd.Function):
    """y = F.linear(gather_sequence(x) or copy_to_group(x), cat(weights)), communication overlapped.

    Several weights reading the same x run as one GEMM on one gathered input. Under
    SP with `settings.regather` only x itself (this rank's shard) is saved; the
    backward re-gathers it with one all-gather issued before the input-gradient
    GEMMs, which it runs under, and waits for it just before the weight gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, settings: TPSettings, *weights: torch.Tensor) -> torch.Tensor:
        ctx.settings = settings
        comm.record_inputs(ctx, x, settings, *weights)
        weight = _fuse_weights(weights)
        if not settings.sp:
            ctx.save_for_backward(x, *weights)
            return _mm(x, weight.t())
        channel = _Channel(settings.group, x.device, settings.timers)
        x = x.contiguous()
        total = x.new_empty((channel.size * x.shape[0], *x.shape[1:]))
        x_chunks = list(total.chunk(channel.size, dim=0))
        x_chunks[channel.rank].copy_(x)
        y = x.new_empty((total.shape[0], *x.shape[1:-1], weight.shape[0]))
        y_chunks = y.chunk(channel.size, dim=0)
        weight_t = weight.t()
        _ring_all_gather(channel, x_chunks, lambda c, chunk: _mm(chunk, weight_t, out=y_chunks[c]))
        # Either this rank's shard (re-gathered in backward) or, as the reference path
        # (gather, then F.linear) does, the whole gathered input.
        ctx.save_for_backward(x if settings.regather else total, *weights)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        settings: TPSettings = ctx.settings
        inp, weights, need_dx, need_dw = column_saved(ctx)
        grad_y = grad_y.contiguous()
        channel = _Channel(settings.group, grad_y.device, settings.timers)
        inp, gathering = start_regather(channel, inp, settings.sp and settings.regather and any(need_dw))
        dweights: list[Optional[torch.Tensor]] = [None] * len(weights)
        done = [False]

        def weight_grad() -> None:
            if gathering is not None:
                gathering.wait()
            dweights[:] = _weight_grads(grad_y, inp, weights, need_dw)
            done[0] = True

        if not need_dx:
            weight_grad()
            return (None, None, *dweights)
        weight = _fuse_weights(weights)
        if not settings.sp:
            dx = _mm(grad_y, weight)
            reduce = channel.all_reduce(dx)
            weight_grad()  # under the dx all-reduce
            reduce.wait()
            return (dx, None, *dweights)
        grad_chunks = grad_y.chunk(channel.size, dim=0)
        dx = _ring_reduce_scatter(channel, lambda c: _mm(grad_chunks[c], weight), under_last_hop=weight_grad)
        if not done[0]:
            weight_grad()
        return (dx, None, *dweights)


class _RowLinear(torch.autograd.Function):
    """y = reduce_scatter_sequence(sum_i F.linear(x_i, w_i)) or reduce_from_group(...), overlapped.

    apply(x, weight, settings, x_2, w_2, ...): extra (input, weight) pairs add their
    products before the one reduction (the parallel block's attention and MLP outputs).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, settings: TPSettings,
                *more: torch.Tensor) -> torch.Tensor:
        ctx.settings = settings
        comm.record_inputs(ctx, x, weight, settings, *more)
        xs, ws = [x, *more[0::2]], [weight, *more[1::2]]
        ctx.save_for_backward(*xs, *ws)
        channel = _Channel(settings.group, x.device, settings.timers)
        weights_t = [w.t() for w in ws]
        if settings.sp:
            _check_divisible(x.shape[0], channel.size, "row-parallel reduce-scatter")
            x_chunks = [xi.chunk(channel.size, dim=0) for xi in xs]
            return _ring_reduce_scatter(channel, lambda c: _sum_mm([chunks[c] for chunks in x_chunks], weights_t))
        y = x.new_empty((*x.shape[:-1], weight.shape[0]))
        pending = []
        # Rows of y are independent: all-reduce piece i while piece i+1 is computed.
        for y_piece, *x_pieces in zip(y.chunk(channel.size, dim=0), *(xi.chunk(channel.size, dim=0) for xi in xs)):
            _sum_mm(x_pieces, weights_t, out=y_piece)
            pending.append(channel.all_reduce(y_piece))
        for p in pending:
            p.wait()
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        settings: TPSettings = ctx.settings
        saved = ctx.saved_tensors
        pairs = len(saved) // 2
        xs, ws = saved[:pairs], saved[pairs:]
        needs = comm.needed_grads(ctx)  # a split backward's B or W pass asks for only some of them
        need_dx = [needs[0], *needs[3::2]]
        need_dw = [needs[1], *needs[4::2]]
        grad_y = grad_y.contiguous()
        if not settings.sp:
            # reduce_from_group's backward is the identity: no communication.
            dxs = [_mm(grad_y, w) if need else None for w, need in zip(ws, need_dx)]
            dws = [_weight_grad(grad_y, x) if need else None for x, need in zip(xs, need_dw)]
            return _row_grads(dxs, dws)
        channel = _Channel(settings.group, grad_y.device, settings.timers)
        full = grad_y.new_empty((channel.size * grad_y.shape[0], *grad_y.shape[1:]))
        grad_chunks = list(full.chunk(channel.size, dim=0))
        grad_chunks[channel.rank].copy_(grad_y)
        accumulators = [_RowGradAccumulator(x, w, channel.size, dx, dw)
                        for x, w, dx, dw in zip(xs, ws, need_dx, need_dw)]

        def consume(c: int, grad_chunk: torch.Tensor) -> None:
            for acc in accumulators:
                acc.add(c, grad_chunk)

        _ring_all_gather(channel, grad_chunks, consume)
        return _row_grads([acc.dx for acc in accumulators], [acc.result_dweight() for acc in accumulators])


def _row_grads(dxs: Sequence[Optional[torch.Tensor]], dws: Sequence[Optional[torch.Tensor]]) -> tuple:
    """`_RowLinear.backward`'s return: (dx, dw, None for settings, dx_2, dw_2, ...)."""
    out: list[Optional[torch.Tensor]] = [dxs[0], dws[0], None]
    for dx, dw in zip(dxs[1:], dws[1:]):
        out += [dx, dw]
    return tuple(out)


class _RowGradAccumulator:
    """One (input, weight) pair's dx and dweight, filled chunk by chunk as the output gradient arrives."""

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, size: int, need_dx: bool, need_dw: bool) -> None:
        self.weight = weight
        self.dx = x.new_empty(x.shape) if need_dx else None
        self.dx_chunks = self.dx.chunk(size, dim=0) if self.dx is not None else None
        self.x_chunks = x.chunk(size, dim=0)
        # Low-precision weights: sum the per-chunk products in fp32 so that chunking adds
        # one rounding per chunk product, not a low-precision running sum.
        acc_dtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        self.dweight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_dw else None

    def add(self, c: int, grad_chunk: torch.Tensor) -> None:
        """Chunk c of the output gradient has arrived: its part of dx and its term of dweight."""
        if self.dx_chunks is not None:
            _mm(grad_chunk, self.weight, out=self.dx_chunks[c])
        if self.dweight is None:
            return
        g2d = grad_chunk.reshape(-1, grad_chunk.shape[-1]).t()
        x2d = self.x_chunks[c].reshape(-1, self.x_chunks[c].shape[-1])
        if self.dweight.dtype == g2d.dtype:
            self.dweight.addmm_(g2d, x2d)
        else:
            self.dweight.add_(torch.mm(g2d, x2d))

    def result_dweight(self) -> Optional[torch.Tensor]:
        """The summed weight gradient in the weight's dtype."""
        if self.dweight is not None and self.dweight.dtype != self.weight.dtype:
            return self.dweight.to(self.weight.dtype)
        return self.dweight


# Eager under torch.compile (train.compile): p2p on a side stream is not traceable, and the
# chunked GEMMs leave nothing for the compiler to fuse.
@torch.compiler.disable
def column_linear(x: torch.Tensor, weight: torch.Tensor, settings: TPSettings) -> torch.Tensor:
    """Column-parallel GEMM with its input communication overlapped.

    x: [s/tp, b, in] with sequence parallelism, else [s, b, in]; weight: this
    rank's [out/tp, in]. Equals F.linear(comm.gather_sequence(x), weight) (SP)
    or F.linear(comm.copy_to_group(x), weight), forward and backward.
    """
    if settings.size == 1 or settings.group is None:
        return torch.nn.functional.linear(x, weight)
    return _ColumnLinear.apply(x, settings, weight)


@torch.compiler.disable
def column_linears(x: torch.Tensor, weights: Sequence[torch.Tensor], settings: TPSettings) -> torch.Tensor:
    """`column_linear` of several weights [n_i, in] that read x, as one GEMM: [.., sum n_i]. Needs tp > 1."""
    return _ColumnLinear.apply(x, settings, *weights)


@torch.compiler.disable
def row_linear(x: torch.Tensor, weight: torch.Tensor, settings: TPSettings) -> torch.Tensor:
    """Row-parallel GEMM with its output reduction overlapped.

    x: [s, b, in/tp]; weight: [out, in/tp]. Equals
    comm.reduce_scatter_sequence(F.linear(x, weight)) (SP, output [s/tp, b, out])
    or comm.reduce_from_group(F.linear(x, weight)) (output [s, b, out]).
    """
    if settings.size == 1 or settings.group is None:
        return torch.nn.functional.linear(x, weight)
    return _RowLinear.apply(x, weight, settings)


@torch.compiler.disable
def row_linear_sum(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], settings: TPSettings) -> torch.Tensor:
    """`row_linear` of sum_i F.linear(x_i, w_i) with one reduction for all pairs. Needs tp > 1."""
    (x, weight), rest = pairs[0], pairs[1:]
    return _RowLinear.apply(x, weight, settings, *(t for pair in rest for t in pair))
