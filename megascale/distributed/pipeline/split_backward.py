"""Split backward for zero-bubble schedules: input gradients now (B), weight gradients later (W).

A stage's backward does two kinds of work: the chain of input gradients that the
previous stage is waiting for, and the weight gradients that nobody needs before
the optimizer step. `backward_input` runs only the first and returns a
`DeferredWeightGrad` whose `run()` does the second, later, when the schedule has
a gap to fill.

It works on the autograd graph itself, so every layer with weights (tensor-parallel
linears, the embedding and logit GEMMs, norms, the LFA convolutions, custom
autograd functions) splits without wrapping:

* B is ``torch.autograd.grad`` with respect to the stage input only. The engine
  then skips every gradient edge that leads only to parameters, so a GEMM node
  computes its input gradient and not its weight gradient. Pre-hooks record the
  incoming gradient of each *frontier* node: a node on the input-gradient path
  with an edge into a parameter-only subgraph (the GEMM, the norm, the bias add).
* W restarts autograd at those nodes, from the recorded gradients, with the
  parameters as the only inputs (``torch.autograd.backward(GradientEdge, inputs=)``):
  each frontier node now computes only its weight-side outputs, accumulated into
  ``.grad`` by the parameters' own AccumulateGrad nodes, so gradient hooks (the
  data-parallel bucket reduction) fire as in an ordinary backward.

Parameters are grouped by the frontier nodes they hang off (one W call per
group), so a group's W never walks into another group's frontier and nothing is
counted twice. Where one group has several frontier nodes on one path (a weight
used twice in sequence), the recorded gradient replaces whatever arrives at the
later node (the same rule as torch.distributed.pipelining's split backward).
The result equals an ordinary ``backward()`` up to the order of floating-point
sums of gradients that reach one tensor along several paths.

The first stage has no input gradient to compute: its B does nothing and its W
is the whole ordinary backward, which no other stage waits for.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["DeferredWeightGrad", "backward_input"]


@dataclass
class _WeightGroup:
    """Parameters whose gradients start at the same frontier nodes, and the gradients recorded there."""

    params: list[Tensor]
    nodes: list[Node]
    grads: dict[int, tuple[Optional[Tensor], ...]] = field(default_factory=dict)  # node index -> grad_outputs


class DeferredWeightGrad:
    """The weight-gradient pass (W) of one stage and micro-batch, created by `backward_input`."""

    def __init__(self, groups: list[_WeightGroup], whole: Optional[tuple[Tensor, Optional[Tensor]]] = None) -> None:
        self._groups = groups
        self._whole = whole  # (output, grad): the first stage runs its ordinary backward here

    def run(self) -> None:
        """Accumulate this micro-batch's weight gradients into ``.grad``; the graph is released after."""
        if self._whole is not None:
            output, grad = self._whole
            torch.autograd.backward(output, grad_tensors=grad)
        for group in self._groups:
            _run_group(group)
        self._groups, self._whole = [], None


def _run_group(group: _WeightGroup) -> None:
    roots: list[GradientEdge] = []
    grads: list[Tensor] = []
    for index, node in enumerate(group.nodes):
        for output_nr, grad in enumerate(group.grads.get(index, ())):
            if grad is not None:
                roots.append(GradientEdge(node, output_nr))
                grads.append(grad)
    if not roots:
        return
    clamps = []
    if len(group.nodes) > 1:
        # A later frontier node of the same group must see its recorded gradient, not a partial
        # one walked down from an earlier frontier node.
        for index, node in enumerate(group.nodes):
            recorded = group.grads.get(index)
            if recorded is not None:
                clamps.append(node.register_prehook(lambda _grad_outputs, kept=recorded: kept))
    try:
        # retain_graph: groups may share parameter-side nodes; the graph goes when W drops it.
        torch.autograd.backward(roots, grad_tensors=grads, inputs=group.params, retain_graph=True)
    finally:
        for handle in clamps:
            handle.remove()


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below `root`: node -> the nodes whose gradients flow into it."""
    consumers: dict[Node, list[Node]] = collections.defaultdict(list)
    seen = {root}
    queue = collections.deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _upward(start: Node, consumers: dict[Node, list[Node]], stop: frozenset[Node] = frozenset(),
            ) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from `start` towards the root, not entering `stop`; also the `stop` nodes met."""
    closure, met = {start}, set()
    queue = collections.deque([start])
    while queue:
        for parent in consumers.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in closure:
                closure.add(parent)
                queue.append(parent)
    return closure, met


def _weight_groups(root: Node, input_node: Node, params: Iterable[Tensor]) -> list[_WeightGroup]:
    """Group the parameters under `root` by the frontier nodes where their gradients leave the input path."""
    consumers = _consumers(root)
    input_path = frozenset(_upward(input_node, consumers)[0])
    by_node: dict[Node, _WeightGroup] = {}
    for param in params:
        accumulator = get_gradient_edge(param).node
        if accumulator not in consumers:
            continue  # unused by this micro-batch: no gradient, as in an ordinary backward
        _, frontier = _upward(accumulator, consumers, stop=input_path)
        groups = {id(by_node[n]): by_node[n] for n in frontier if n in by_node}
        merged = _WeightGroup(params=[param], nodes=sorted(frontier - by_node.keys(), key=id))
        for group in groups.values():
            merged.params += group.params
            merged.nodes += group.nodes
        for node in merged.nodes:
            by_node[node] = merged
    unique = {id(g): g for g in by_node.values()}
    return list(unique.values())


def backward_input(output: Tensor, grad_output: Optional[Tensor], stage_input: Optional[Tensor],
                   params: Iterable[Tensor]) -> DeferredWeightGrad:
    """B: backpropagate `output` (with `grad_output`; None for a scalar loss) to `stage_input` only.

    Sets ``stage_input.grad`` and returns the W pass for `params`. Without a stage input
    that requires grad (the first stage), nothing runs now and W is the whole backward.
    """
    root = output.grad_fn
    if stage_input is None or not stage_input.requires_grad or root is None:
        return DeferredWeightGrad([], whole=(output, grad_output))
    input_node = get_gradient_edge(stage_input).node
    groups = _weight_groups(root, input_node, [p for p in params if p.requires_grad])
    handles = []
    for group in groups:
        for index, node in enumerate(group.nodes):
            def record(grad_outputs: tuple, group: _WeightGroup = group, index: int = index) -> None:
                group.grads[index] = tuple(grad_outputs)
            handles.append(node.register_prehook(record))
    try:
        (grad_input,) = torch.autograd.grad(output, stage_input, grad_outputs=grad_output, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    stage_input.grad = grad_input if stage_input.grad is None else stage_input.grad + grad_input
    return DeferredWeightGrad(groups)
