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

The first stage has no stage input. Its input-gradient path is the *spine* instead:
the nodes above any node where the gradients of two or more parameters part ways
(a GEMM: its input and its weight; a norm: its input, weight and bias), widened
by the embedding stream that the first layer both normalizes and adds back (else
W would walk the first layer from the residual add down to the norm). Below the
lowest spine nodes hang only parameter-side subgraphs (the embedding lookup, a
norm's weight), which W runs. B captures the gradients arriving at those lowest
nodes (``torch.autograd.grad`` with their gradient edges as inputs), so the first
stage's B and W split the work as every other stage's do.

Memory (`SavedActivations`): B keeps the graph (W restarts from its nodes), but not
what the graph saved for B alone. Run the forward under a `SavedActivations`'
hooks and pass it to `backward_input`: every saved tensor is boxed, and B empties
each box it reads outside a frontier node as it reads it (the memory goes when the
reading node is done, as in an ordinary backward). What stays
until W is what W reads: the frontier nodes' saved tensors (a GEMM's input, a
norm's normalized input or statistics), the parameter-side nodes' (never read in
B), those of the input-path nodes W walks between two uses of one weight, the
recorded incoming gradients, and the inputs of recomputed regions that hold
weights (`kept_for_weights`; W replays them once more). The boxes hold detached
tensors: a saved output boxed with its history would hold its own node, a cycle
through C++ that no collector breaks; W empties them when it is done.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["DeferredWeightGrad", "SavedActivations", "backward_input", "kept_for_weights"]


# Set while a recomputed region whose replay W needs is saving its inputs (see `kept_for_weights`).
_KEPT_FOR_WEIGHTS: contextvars.ContextVar[bool] = contextvars.ContextVar("kept_for_weights", default=False)


@contextlib.contextmanager
def kept_for_weights() -> Iterator[None]:
    """Tensors saved inside stay until W, whoever reads them in B.

    For the inputs an activation-recomputation region saves when the region holds
    weights: B's replay reads them from a node that is not a frontier node, yet W
    replays the region again to reach its weight gradients.
    """
    token = _KEPT_FOR_WEIGHTS.set(True)
    try:
        yield
    finally:
        _KEPT_FOR_WEIGHTS.reset(token)


class _Box:
    """One saved tensor; emptied after B when only B needed it."""

    __slots__ = ("pinned", "tensor")

    def __init__(self, tensor: Tensor, pinned: bool) -> None:
        self.tensor: Optional[Tensor] = tensor
        self.pinned = pinned


class SavedActivations:
    """What autograd saves during one micro-batch's forward of one chunk, boxed so B can release its part.

    Use ``with saved.hooks(): output = chunk(...)`` and pass `saved` to `backward_input`.
    """

    def __init__(self) -> None:
        self._boxes: list[_Box] = []
        self._recording = False
        self._thread = threading.local()  # in_weight_node: a frontier node runs on this (engine) thread

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks to run the forward under."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> _Box:
        # Detached: a saved output would otherwise hold its own node through the box (node -> saved
        # variable -> unpack hook -> box -> tensor -> node), a cycle through C++ no collector breaks.
        # Autograd rebuilds the unpacked tensor's history from its own records.
        box = _Box(tensor.detach(), _KEPT_FOR_WEIGHTS.get())
        self._boxes.append(box)
        return box

    def _unpack(self, box: _Box) -> Tensor:
        if box.tensor is None:
            raise RuntimeError("split backward: the weight pass W read a saved tensor that the input-gradient pass "
                               "B released; a recomputed region that holds weights must save its inputs under "
                               "split_backward.kept_for_weights()")
        tensor = box.tensor
        if self._recording and not box.pinned and not getattr(self._thread, "in_weight_node", False):
            box.tensor = None  # B alone reads it: gone once the reading node is done, as in an ordinary backward
        return tensor

    @contextlib.contextmanager
    def recording(self, frontier: Iterable[Node]) -> Iterator[None]:
        """While B runs, empty the boxes it reads outside the given nodes (the frontier nodes, which W
        runs again, and the nodes W walks between them)."""
        def enter(_grad_outputs: tuple) -> None:
            self._thread.in_weight_node = True

        def leave(_grad_inputs: tuple, _grad_outputs: tuple) -> None:
            self._thread.in_weight_node = False

        handles = []
        for node in frontier:
            handles += [node.register_prehook(enter), node.register_hook(leave)]
        self._recording = True
        try:
            yield
        finally:
            self._recording = False
            for handle in handles:
                handle.remove()

    def release_input_only(self) -> None:
        """Forget the boxes B emptied as it read them: after B, only W's part stays."""
        self._boxes = [box for box in self._boxes if box.tensor is not None]

    def clear(self) -> None:
        """Empty every box (after W: nothing reads them again)."""
        for box in self._boxes:
            box.tensor = None
        self._boxes = []

    def held(self) -> list[Tensor]:
        """The saved tensors still held (all of them before B, W's part after)."""
        return [box.tensor for box in self._boxes if box.tensor is not None]


@dataclass
class _WeightGroup:
    """Parameters whose gradients start at the same frontier nodes, and the gradients recorded there."""

    params: list[Tensor]
    nodes: list[Node]
    grads: dict[int, tuple[Optional[Tensor], ...]] = field(default_factory=dict)  # node index -> grad_outputs


class DeferredWeightGrad:
    """The weight-gradient pass (W) of one stage and micro-batch, created by `backward_input`."""

    def __init__(self, groups: list[_WeightGroup], whole: Optional[tuple[Tensor, Optional[Tensor]]] = None,
                 saved: Optional[SavedActivations] = None) -> None:
        self._groups = groups
        self._whole = whole  # (output, grad): nothing to split, W runs the ordinary backward
        self._saved = saved

    def held_gradients(self) -> list[Tensor]:
        """The gradients recorded at the frontier nodes, kept for this W (plus the whole backward's seed)."""
        grads = [g for group in self._groups for recorded in group.grads.values() for g in recorded if g is not None]
        if self._whole is not None and self._whole[1] is not None:
            grads.append(self._whole[1])
        return grads

    def run(self) -> None:
        """Accumulate this micro-batch's weight gradients into ``.grad``; the graph is released after."""
        if self._whole is not None:
            output, grad = self._whole
            torch.autograd.backward(output, grad_tensors=grad)
        for group in self._groups:
            _run_group(group)
        if self._saved is not None:
            self._saved.clear()
        self._groups, self._whole, self._saved = [], None, None


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


def _post_order(root: Node) -> list[Node]:
    """Every node below `root`, each after all of its children (iterative: graphs are deep)."""
    order: list[Node] = []
    expanded: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            order.append(node)
            continue
        if node in expanded:
            continue  # a stale entry: the node was reached again by another path and finished there
        expanded.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in expanded)
    return order


def _spine(root: Node, accumulators: set[Node], consumers: dict[Node, list[Node]]) -> frozenset[Node]:
    """The first stage's input-gradient path: nodes from which a node is reached where the gradients of
    two or more parameters part ways (two of its children lead to parameters), widened by `_merge_points`."""
    reaches_param: dict[Node, bool] = {}
    on_spine: dict[Node, bool] = {}
    for node in _post_order(root):
        children = [child for child, _ in node.next_functions if child is not None]
        leading = sum(1 for child in children if reaches_param[child])
        reaches_param[node] = node in accumulators or leading > 0
        on_spine[node] = leading >= 2 or any(on_spine[child] for child in children)
    spine = {node for node, kept in on_spine.items() if kept}
    if spine:
        while merged := _merge_points(spine, consumers):
            spine |= merged
    return frozenset(spine)


def _merge_points(spine: set[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """Off-spine nodes (not parameter accumulators) whose gradient gathers from two spine nodes one above
    the other, with the off-spine nodes between: the stream the first layer both normalizes and adds
    back (the embedding output). Left off the spine, W would walk the spine from the residual add down
    to the norm. (Weight slices read by two side-by-side GEMMs stay off it: W walks nothing there.)"""
    found: set[Node] = set()
    stop = frozenset(spine)
    for node in consumers:
        if node in spine or node in found or not node.next_functions:
            continue
        closure, met = _upward(node, consumers, stop=stop)
        if len(met) >= 2 and any(met & (_upward(lower, consumers)[0] - {lower}) for lower in met):
            found |= closure
    return found


def _weight_groups(consumers: dict[Node, list[Node]], input_path: frozenset[Node],
                   params: Iterable[Tensor]) -> list[_WeightGroup]:
    """Group the parameters in the graph of `consumers` by the frontier nodes where their gradients leave
    the input path."""
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


def _walked_by_weight(groups: list[_WeightGroup], input_path: frozenset[Node],
                      consumers: dict[Node, list[Node]]) -> set[Node]:
    """Input-path nodes W runs too: those between two frontier nodes of one group (a weight used twice in
    sequence), which W walks from the upper frontier node to reach the weight through the lower one."""
    walked: set[Node] = set()
    for group in groups:
        if len(group.nodes) < 2:
            continue
        above: set[Node] = set()
        for node in group.nodes:
            above |= _upward(node, consumers)[0]
        below: set[Node] = set()
        queue = collections.deque(group.nodes)
        while queue:
            for child, _ in queue.popleft().next_functions:
                if child is not None and child in input_path and child not in below:
                    below.add(child)
                    queue.append(child)
        walked |= (above & below) - set(group.nodes)
    return walked


def _record(groups: list[_WeightGroup]) -> list:
    """Pre-hooks that record the gradient arriving at every frontier node."""
    handles = []
    for group in groups:
        for index, node in enumerate(group.nodes):
            def record(grad_outputs: tuple, group: _WeightGroup = group, index: int = index) -> None:
                group.grads[index] = tuple(grad_outputs)
            handles.append(node.register_prehook(record))
    return handles


def _lowest_edges(groups: list[_WeightGroup], spine: frozenset[Node],
                  consumers: dict[Node, list[Node]]) -> list[tuple[_WeightGroup, int, int, Node]]:
    """(group, node index, output number, node) of every gradient edge into a frontier node none of whose
    children is on the spine: B needs no output of such a node, so it captures what arrives there."""
    edges = []
    for group in groups:
        for index, node in enumerate(group.nodes):
            if any(child in spine for child, _ in node.next_functions if child is not None):
                continue
            numbers = {nr for parent in consumers.get(node, ()) for child, nr in parent.next_functions
                       if child is node}
            edges += [(group, index, nr, node) for nr in sorted(numbers)]
    return edges


def _input_pass(output: Tensor, grad_output: Optional[Tensor], inputs: list, groups: list[_WeightGroup],
                input_path: frozenset[Node], consumers: dict[Node, list[Node]], saved: Optional[SavedActivations],
                allow_unused: bool = False) -> tuple[Optional[Tensor], ...]:
    """Run B: the gradients of `output` at `inputs` (tensors or gradient edges), recording what arrives at
    every frontier node for W; under `saved`, what only B reads is released as it is read."""
    handles = _record(groups)
    frontier = [node for group in groups for node in group.nodes]
    frontier += _walked_by_weight(groups, input_path, consumers)
    try:
        with saved.recording(frontier) if saved is not None else contextlib.nullcontext():
            grads = torch.autograd.grad(output, inputs, grad_outputs=grad_output, retain_graph=True,
                                        allow_unused=allow_unused)
    finally:
        for handle in handles:
            handle.remove()
    if saved is not None:
        saved.release_input_only()
    return grads


def _backward_first_stage(output: Tensor, grad_output: Optional[Tensor], params: list[Tensor],
                          saved: Optional[SavedActivations]) -> DeferredWeightGrad:
    """B and W of the first stage (no stage input): B walks the spine, W the parameter-side subgraphs."""
    root = output.grad_fn
    assert root is not None
    consumers = _consumers(root)
    spine = _spine(root, {get_gradient_edge(p).node for p in params}, consumers)
    groups = _weight_groups(consumers, spine, params) if spine else []
    edges = _lowest_edges(groups, spine, consumers)
    if not edges:  # nothing parts ways: no input path to walk, W is the whole backward
        return DeferredWeightGrad([], whole=(output, grad_output), saved=saved)
    captured = _input_pass(output, grad_output, [GradientEdge(node, nr) for _, _, nr, node in edges], groups,
                           spine, consumers, saved, allow_unused=True)
    arriving: dict[tuple[int, int], dict[int, Tensor]] = collections.defaultdict(dict)
    for (group, index, nr, _), grad in zip(edges, captured):
        if grad is not None:
            arriving[(id(group), index)][nr] = grad
    for group in groups:
        for index in range(len(group.nodes)):
            got = arriving.get((id(group), index))
            if got:
                group.grads[index] = tuple(got.get(nr) for nr in range(max(got) + 1))
    return DeferredWeightGrad(groups, saved=saved)


def backward_input(output: Tensor, grad_output: Optional[Tensor], stage_input: Optional[Tensor],
                   params: Iterable[Tensor], saved: Optional[SavedActivations] = None) -> DeferredWeightGrad:
    """B: backpropagate `output` (with `grad_output`; None for a scalar loss) to `stage_input` only.

    Sets ``stage_input.grad`` and returns the W pass for `params`. The first stage (no
    stage input that requires grad) walks its spine instead (see the module docstring).
    saved: the `SavedActivations` the forward ran under; what only B read is released.
    """
    root = output.grad_fn
    wanted = [p for p in params if p.requires_grad]
    if root is None:
        return DeferredWeightGrad([], whole=(output, grad_output), saved=saved)
    if stage_input is None or not stage_input.requires_grad:
        return _backward_first_stage(output, grad_output, wanted, saved)
    input_node = get_gradient_edge(stage_input).node
    consumers = _consumers(root)
    input_path = frozenset(_upward(input_node, consumers)[0])
    groups = _weight_groups(consumers, input_path, wanted)
    (grad_input,) = _input_pass(output, grad_output, [stage_input], groups, input_path, consumers, saved)
    assert grad_input is not None  # not allow_unused: autograd raises for an input the output does not use
    stage_input.grad = grad_input if stage_input.grad is None else stage_input.grad + grad_input
    return DeferredWeightGrad(groups, saved=saved)
