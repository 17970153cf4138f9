"""The shared experts run while the expert-parallel all-to-alls are in flight, forward and backward.

Two gloo ranks form one expert-parallel group (ep 2) and run one MoE layer of the real
model (shared expert, SwiGLU) forward and backward. The test records, in order, each
all-to-all's launch and wait (`_Exchange.launch` / `wait` in
megascale/distributed/expert_parallel/dispatch.py), the shared expert's two GEMMs in
the forward (fc1, fc2) and their weight gradients in the backward (the parameters'
gradient hooks, which fire as soon as the GEMM's backward has produced them), and checks
the exact sequence:

- overlap on (`parallel.ep_overlap=true`): fc1 between the dispatch's launch and wait,
  fc2 between the combine's; in the backward the combine's gradient all-to-all is
  launched, fc2's backward runs, then it is waited for, and likewise the dispatch's
  around fc1's backward. This is what autograd's order (the ready node created last in
  the forward runs first) gives the launch/wait split; the test fails if that order,
  the shared expert's split or the launch/wait split is lost.
- overlap off: every all-to-all is waited for before anything else runs, the shared
  expert after the routed path (forward) and before it (backward).
- with full recomputation (the layer under `megascale.model.recompute`), the replayed
  forward's all-to-alls pair up (each launch followed by its wait, nothing left in
  flight) before the backward runs in the overlapped order.

The layer's output and every gradient are the same with overlap on and off (the same
arithmetic; only the order in which the input's gradient contributions are added may
differ: 1e-6 relative).

Slow, on four ranks (tp 2 + SP + ep 2): the shared MLP's own tp collectives (fc1's
all-gather, fc2's reduce-scatter, and in the backward fc2's gradient all-gather, fc1's
input re-gather and gradient reduce-scatter) are issued while the ep all-to-alls are in
flight, and the members of every process group issue the same collectives in the same
order, so the concurrent collectives on the two groups cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import parity
import pytest
import torch
from dist_utils import Outcome, run_scenarios

from megascale.distributed.expert_parallel import dispatch as ep_dispatch
from megascale.model.moe import MoELayer

HIDDEN, SEQ, BATCH = 32, 8, 2
FORWARD_ON = ["launch dispatch", "fc1", "wait dispatch", "launch combine", "fc2", "wait combine"]
BACKWARD_ON = ["launch combine grad", "fc2 grad", "wait combine", "launch dispatch grad", "fc1 grad", "wait dispatch"]
FORWARD_OFF = ["launch dispatch", "wait dispatch", "launch combine", "wait combine", "fc1", "fc2"]
BACKWARD_OFF = ["fc2 grad", "fc1 grad", "launch combine grad", "wait combine", "launch dispatch grad", "wait dispatch"]


def _layer(rank: int, overlap: bool, world: int = 2, layout: tuple[str, ...] = ()) -> MoELayer:
    from megascale.distributed.topology import ParallelContext
    from megascale.run_plan import resolve_plan

    cfg = parity.make_config(["model.num_layers=1", f"model.hidden_size={HIDDEN}", "model.num_heads=4",
                              "model.vocab_size=64", f"model.seq_length={SEQ}", "model.activation=swiglu",
                              "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=16",
                              "model.moe.shared_experts=1", "model.moe.aux_loss_coeff=0.01", "parallel.ep=2",
                              f"parallel.ep_overlap={overlap}", f"train.micro_batch_size={BATCH}",
                              f"train.global_batch_size={2 * BATCH}", *layout])
    ctx = ParallelContext(resolve_plan(cfg, world).rank_layout(), rank=rank, device=torch.device("cpu"))
    layer = parity.build_chunks(cfg, ctx)[0].layers["0"].mlp
    assert isinstance(layer, MoELayer) and layer.overlap == overlap and layer.shared is not None
    return layer


@contextmanager
def _recording(layer: MoELayer, events: list[str]) -> Iterator[None]:
    """Append the all-to-alls' launches and waits and the shared expert's GEMMs and weight gradients to events."""
    exchange = ep_dispatch._Exchange
    launch, wait = exchange.launch, exchange.wait

    def traced_launch(self: Any, rows: torch.Tensor, backward: bool) -> torch.Tensor:
        events.append(f"launch {self.kind}{' grad' if backward else ''}")
        return launch(self, rows, backward)

    def traced_wait(self: Any) -> None:
        if self.work is not None:
            events.append(f"wait {self.kind}")
        wait(self)

    assert layer.shared is not None
    handles = []
    for name in ("fc1", "fc2"):
        module = getattr(layer.shared, name)
        handles.append(module.register_forward_pre_hook(lambda *_, name=name: events.append(name)))
        handles.append(module.weight.register_hook(lambda grad, name=name: events.append(f"{name} grad")))
    exchange.launch, exchange.wait = traced_launch, traced_wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        exchange.launch, exchange.wait = launch, wait  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()


def _run(layer: MoELayer, x: torch.Tensor, grad: torch.Tensor, recompute: bool) -> tuple[list[str], list[str],
                                                                                        dict[str, torch.Tensor]]:
    """(forward events, backward events, output and every gradient) of one forward and backward."""
    from megascale.model.recompute import recompute as recomputed

    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    forward: list[str] = []
    backward: list[str] = []
    with _recording(layer, forward):
        out = recomputed(layer, layer.bc.rng, x) if recompute else layer(x)
    with _recording(layer, backward):
        out.backward(grad)
    assert x.grad is not None
    values = {"output": out.detach(), "input grad": x.grad}
    values.update({name: p.grad for name, p in layer.named_parameters() if p.grad is not None})
    return forward, backward, values


def _layers(rank: int, world: int) -> dict[bool, MoELayer]:
    """The layer with overlap on and off (the same weights), built once per spawn."""
    return {overlap: _layer(rank, overlap) for overlap in (True, False)}


def scenario_order(recompute: bool, rank: int, world: int, layers: dict[bool, MoELayer]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(20 + rank)
    x, grad = torch.randn(SEQ, BATCH, HIDDEN, generator=gen), torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    on = _run(layers[True], x, grad, recompute)
    off = _run(layers[False], x, grad, recompute)
    return {"on": on[:2], "off": off[:2], "values": (on[2], off[2])}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    return run_scenarios({"plain": partial(scenario_order, False), "recompute": partial(scenario_order, True)}, 2,
                         setup=_layers)


def test_shared_experts_run_between_each_all_to_all_launch_and_wait(outcomes: dict[str, Outcome]) -> None:
    for rank, result in enumerate(outcomes["plain"].check()):
        assert result["on"] == (FORWARD_ON, BACKWARD_ON), f"rank {rank}, overlap on: {result['on']}"
        assert result["off"] == (FORWARD_OFF, BACKWARD_OFF), f"rank {rank}, overlap off: {result['off']}"


def test_recomputation_replays_paired_all_to_alls_and_keeps_the_overlap(outcomes: dict[str, Outcome]) -> None:
    for rank, result in enumerate(outcomes["recompute"].check()):
        # The backward starts by replaying the forward (at its first saved tensor), then runs in order.
        assert result["on"] == (FORWARD_ON, FORWARD_ON + BACKWARD_ON), f"rank {rank}, overlap on: {result['on']}"
        assert result["off"] == (FORWARD_OFF, FORWARD_OFF + BACKWARD_OFF), f"rank {rank}, off: {result['off']}"


@pytest.mark.parametrize("case", ["plain", "recompute"])
def test_overlap_changes_no_value(outcomes: dict[str, Outcome], case: str) -> None:
    for rank, result in enumerate(outcomes[case].check()):
        on, off = result["values"]
        assert on.keys() == off.keys() and len(on) > 8
        for name, value in on.items():
            torch.testing.assert_close(value, off[name], rtol=1e-6, atol=1e-7, msg=f"rank {rank}: {name}")


# ----------------------------------------------------------------------------- tp 2 + SP + ep 2, four ranks

TP_SP = ("parallel.tp=2", "parallel.sequence_parallel=true")
COLLECTIVES = ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


@contextmanager
def _collectives(events: list[str], issued: list[tuple[str, tuple[int, ...]]], tp_ranks: tuple[int, ...]
                 ) -> Iterator[None]:
    """Record every collective issued: its name and group into `issued`, tp ones as "tp NAME" into events."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def traced(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
            issued.append((name, ranks))
            if ranks == tp_ranks:
                events.append(f"tp {name}")
            return originals[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, traced(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _between(events: list[str], start: str, end: str) -> list[str]:
    begin = events.index(start)
    return events[begin + 1:events.index(end, begin)]


def scenario_tp_sp(rank: int, world: int, shared: Any) -> dict[str, Any]:
    """Forward and backward of the layer under tp 2 + SP + ep 2 with overlap on, recording the order."""
    import torch.distributed as dist

    layer = _layer(rank, True, world, TP_SP)
    tp_ranks = tuple(dist.get_process_group_ranks(layer.bc.tp.group))
    gen = torch.Generator().manual_seed(30 + rank)
    x = torch.randn(SEQ // 2, BATCH, HIDDEN, generator=gen, requires_grad=True)
    passes: dict[str, list[str]] = {"forward": [], "backward": []}
    issued: list[tuple[str, tuple[int, ...]]] = []
    with ExitStack() as stack:
        stack.enter_context(_collectives(passes["forward"], issued, tp_ranks))
        stack.enter_context(_recording(layer, passes["forward"]))
        out = layer(x)
    with ExitStack() as stack:
        stack.enter_context(_collectives(passes["backward"], issued, tp_ranks))
        stack.enter_context(_recording(layer, passes["backward"]))
        out.backward(torch.randn(out.shape, generator=gen))
    return {"passes": passes, "issued": issued}


@pytest.mark.slow
def test_tp_collectives_of_the_shared_experts_run_under_the_all_to_alls_in_one_order() -> None:
    """tp 2 + SP + ep 2: the shared MLP's tp collectives (fc1's all-gather, fc2's reduce-scatter and their
    backward) are issued while the ep all-to-alls are in flight, and every group's members issue the same
    collectives in the same order (no deadlock, as the parity tests' tp2_sp_ep2 case shows end to end)."""
    results = run_scenarios({"tp_sp": scenario_tp_sp}, 4)["tp_sp"].check()
    for rank, result in enumerate(results):
        forward, backward = result["passes"]["forward"], result["passes"]["backward"]
        for events, start, end, what in ((forward, "launch dispatch", "wait dispatch", "fc1"),
                                         (forward, "launch combine", "wait combine", "fc2"),
                                         (backward, "launch combine grad", "wait combine", "fc2 grad"),
                                         (backward, "launch dispatch grad", "wait dispatch", "fc1 grad")):
            inside = _between(events, start, end)
            assert what in inside and any(e.startswith("tp ") for e in inside), f"rank {rank}: {start}: {events}"
    groups = {ranks for result in results for _, ranks in result["issued"] if ranks}
    for ranks in groups:
        orders = {rank: [name for name, g in results[rank]["issued"] if g == ranks] for rank in ranks}
        assert len({tuple(order) for order in orders.values()}) == 1, f"group {ranks}: {orders}"
