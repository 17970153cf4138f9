"""Vocab-parallel cross entropy (Megatron-style), per-token loss in fp32.

Each tensor-parallel rank holds logits for its vocab shard
[vocab_start, vocab_start + V_local). The loss of a token is
lse - logit[label] with lse = log sum_v exp(logit_v) over the whole vocab:
ranks all-reduce the max and the sum of exps over `tp_group`, and the target
logit comes from the rank owning it. Labels < 0 are ignored (loss 0, no
gradient), like F.cross_entropy's ignore_index=-100.

The reference keeps the softmax for the backward (memory n x V_local fp32);
the fused CUDA path keeps only the logits and one fp32 lse per token and
recomputes the softmax in the backward kernel.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def _all_reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType, group: Optional[Any]) -> Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _flatten(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim "
                         f"{tuple(logits.shape[:-1])}")
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


class _ReferenceCrossEntropy(torch.autograd.Function):
    """Plain PyTorch vocab-parallel cross entropy with torch.distributed all-reduces.

    Few passes over the n x V_local logits, because on CPU each pass costs about as much as a
    layer's matmul at demo shapes: one max, one fused softmax (torch's row-wise kernel, which keeps
    a row in cache), one multiply in the backward. The shard's log-sum-exp comes from the softmax
    at the row's argmax (a probability >= 1/V_local, so its log is exact to fp32 rounding), ranks
    combine their log-sum-exps with two n-sized all-reduces, and the backward rescales the local
    softmax by exp(local_lse - lse) instead of recomputing it.
    """

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, vocab_start: int, group: Optional[Any]) -> Tensor:
        vocab = logits.shape[-1]
        x = logits.float()
        row_max, argmax = x.max(dim=-1)
        softmax = torch.softmax(x, dim=-1)
        local_lse = row_max - softmax.gather(-1, argmax.unsqueeze(-1)).squeeze(-1).log()
        if group is None:
            lse = local_lse
        else:
            global_max = _all_reduce(local_lse.clone(), dist.ReduceOp.MAX, group)
            lse = global_max + _all_reduce((local_lse - global_max).exp(), dist.ReduceOp.SUM, group).log()
        local = labels - vocab_start
        owned = (labels >= 0) & (local >= 0) & (local < vocab)
        index = torch.where(owned, local, torch.zeros_like(local))
        target = _all_reduce(x.gather(-1, index.unsqueeze(-1)).squeeze(-1) * owned, dist.ReduceOp.SUM, group)
        valid = labels >= 0
        loss = torch.where(valid, lse - target, torch.zeros_like(target))
        # softmax of the whole vocab = local softmax * exp(local_lse - lse); 1 at tp=1
        ctx.save_for_backward(softmax, (local_lse - lse).exp(), index, owned, valid)
        ctx.logits_dtype = logits.dtype
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        if ctx.used:
            raise RuntimeError("backward ran twice through vocab_parallel_cross_entropy_reference: its saved "
                               "softmax becomes the gradient in place; recompute the loss for a second backward")
        ctx.used = True
        softmax, rescale, index, owned, valid = ctx.saved_tensors
        coeff = grad.float() * valid
        # In place: the softmax is this function's own buffer, and a fresh n x V_local one would cost a
        # full pass of page faults on CPU.
        dlogits = softmax.mul_((rescale * coeff).unsqueeze(-1))
        dlogits.scatter_add_(-1, index.unsqueeze(-1), -(coeff * owned).unsqueeze(-1))
        return dlogits.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy_reference(logits: Tensor, labels: Tensor, vocab_start: int = 0,
                                           tp_group: Optional[Any] = None) -> Tensor:
    """Per-token fp32 loss, shape labels.shape; tp_group None = the whole vocab is local."""
    flat_logits, flat_labels = _flatten(logits, labels)
    loss = _ReferenceCrossEntropy.apply(flat_logits, flat_labels, int(vocab_start), tp_group)
    return loss.view(labels.shape)


class _FusedCrossEntropy(torch.autograd.Function):
    """csrc/cross_entropy.cu: one pass over the shard forward, softmax recomputed backward."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, vocab_start: int, group: Optional[Any],
                ext: ModuleType) -> Tensor:
        logits, labels = logits.contiguous(), labels.contiguous()
        local_max, local_sum, target = ext.cross_entropy_forward(logits, labels, vocab_start)
        if group is not None:
            global_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
            # Rescale each rank's sum to the global max, then one all-reduce
            # carries both the sums and the (single-owner) target logits.
            stats = torch.stack((local_sum * torch.exp(local_max - global_max), target))
            stats = _all_reduce(stats, dist.ReduceOp.SUM, group)
            sum_exp, target = stats[0], stats[1]
        else:
            global_max, sum_exp = local_max, local_sum
        lse = global_max + sum_exp.log()
        loss = torch.where(labels >= 0, lse - target, torch.zeros_like(lse))
        ctx.save_for_backward(logits, labels, lse)
        ctx.vocab_start, ctx.ext = vocab_start, ext
        return loss

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        logits, labels, lse = ctx.saved_tensors
        # The kernel takes fp32 grads (lse is fp32 there); the emulation keeps float64.
        grad = grad.to(lse.dtype).contiguous()
        dlogits = ctx.ext.cross_entropy_backward(logits, labels, lse, grad, ctx.vocab_start)
        return dlogits, None, None, None, None


def vocab_parallel_cross_entropy_cuda(ext: ModuleType, logits: Tensor, labels: Tensor, vocab_start: int = 0,
                                      tp_group: Optional[Any] = None) -> Tensor:
    """Fused per-token fp32 loss through the csrc kernels."""
    flat_logits, flat_labels = _flatten(logits, labels)
    loss = _FusedCrossEntropy.apply(flat_logits, flat_labels.long(), int(vocab_start), tp_group, ext)
    return loss.view(labels.shape)
