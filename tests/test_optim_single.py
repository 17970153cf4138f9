"""Single-process optimizer tests: AdamW/LAMB math, schedules, clipping, mixed precision, loss scaling.

References are independent: torch.optim.AdamW + torch.nn.utils.clip_grad_norm_ for
AdamW, and a plain per-tensor LAMB written below. Tolerances: fp32 runs of the
same math in a different op order agree to ~1e-6 relative after a few steps.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from megascale.config import Config, OptimConfig
from megascale.distributed.data_parallel.optimizer import DistributedOptimizer
from megascale.distributed.sharding import full_spec, set_shard
from megascale.distributed.topology import ParallelContext, RankLayout
from megascale.optim import LossScaler, adamw_step, lr_at


class Tiny(nn.Module):
    """Linear -> LayerNorm -> tanh -> Linear; names mimic the GPT's global names."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16, dtype=dtype)
        self.norm = nn.LayerNorm(16, dtype=dtype)
        self.fc2 = nn.Linear(16, 3, dtype=dtype)
        for name, p in self.named_parameters():
            set_shard(p, full_spec(name, p.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def make_cfg(**optim) -> Config:
    cfg = Config()
    cfg.optim = OptimConfig(**{"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "weight_decay": 0.1,
                               "grad_clip": 0.5, **optim})
    cfg.train.steps = 6
    cfg.parallel.grad_bucket_mb = 64 * 4 / 2 ** 20  # ~64 floats: several buckets for this model
    return cfg


def data(steps: int, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)) for _ in range(steps)]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, total: int) -> torch.Tensor:
    # Sum over the micro-batch divided by the global batch: micro-batch losses add up to the mean.
    return (model(x).float() - y).pow(2).sum() / total


def ctx1() -> ParallelContext:
    return ParallelContext(RankLayout(), rank=0)


def reference_update(named: dict, opt: torch.optim.Optimizer, lamb_state: dict, step: int, lr: float,
                     o: OptimConfig) -> None:
    """One step of the independent reference: torch.optim.AdamW, or the plain per-tensor LAMB below."""
    if o.name == "adamw":
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    else:
        with torch.no_grad():
            lamb_reference(named, {n: p.grad for n, p in named.items()}, lamb_state, step, lr, o)


def lamb_reference(params: dict, grads: dict, state: dict, step: int, lr: float, o: OptimConfig) -> None:
    """Plain per-tensor LAMB; no weight decay and no layer adaptation for 1-D tensors and biases."""
    for name, w in params.items():
        g = grads[name]
        m, v = state.setdefault(name, (torch.zeros_like(w), torch.zeros_like(w)))
        m.mul_(o.beta1).add_(g, alpha=1 - o.beta1)
        v.mul_(o.beta2).add_(g * g, alpha=1 - o.beta2)
        update = (m / (1 - o.beta1 ** step)) / ((v / (1 - o.beta2 ** step)).sqrt() + o.eps)
        if w.ndim > 1 and not name.endswith("bias"):
            update = update + o.weight_decay * w
            wn, un = w.norm(), update.norm()
            ratio = (wn / un) if wn > 0 and un > 0 else 1.0
        else:
            ratio = 1.0
        w.sub_(lr * ratio * update)


def train_reference(cfg: Config, batches: list, model: nn.Module) -> list[float]:
    """Full-batch training with torch.optim.AdamW (or the reference LAMB) and clip_grad_norm_."""
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim == 1]
    o = cfg.optim
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    lamb_state: dict = {}
    norms = []
    for step, (x, y) in enumerate(batches, start=1):
        model.zero_grad()
        loss_fn(model, x, y, len(x)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip if o.grad_clip else 1e9)))
        reference_update(dict(model.named_parameters()), opt, lamb_state, step, lr_at(step, o, cfg.train.steps), o)
    return norms


def train_ours(cfg: Config, batches: list, model: nn.Module, micro: int) -> list[float]:
    opt = DistributedOptimizer([model], ctx1(), cfg)
    norms = []
    for step, (x, y) in enumerate(batches, start=1):
        opt.zero_grad()
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            opt.sync_enabled(i == micro - 1)
            opt.scale_loss(loss_fn(model, xm, ym, len(x))).backward()
        opt.finish_grad_sync()
        stats = opt.step(step - 1)
        assert not stats.skipped
        norms.append(stats.grad_norm)
    return norms


def test_adamw_step_matches_torch_adamw() -> None:
    torch.manual_seed(0)
    p_ref = torch.randn(5, 7)
    p_ours = p_ref.clone()
    opt = torch.optim.AdamW([p_ref.requires_grad_()], lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m, v = torch.zeros(35), torch.zeros(35)
    for step in range(1, 6):
        g = torch.randn(5, 7)
        p_ref.grad = g.clone()
        opt.step()
        adamw_step([p_ours.view(-1)], [g.view(-1)], [m], [v], lr=0.05, beta1=0.9, beta2=0.95, eps=1e-8,
                   weight_decay=0.1, step=step)
        torch.testing.assert_close(p_ours, p_ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m.view(5, 7), opt.state[p_ref]["exp_avg"], rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["adamw", "lamb"])
@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_single_process_matches_reference(name: str, clip: float) -> None:
    cfg = make_cfg(name=name, grad_clip=clip)
    batches = data(cfg.train.steps)
    torch.manual_seed(1)
    ref = Tiny()
    ours = Tiny()
    ours.load_state_dict(ref.state_dict())
    ref_norms = train_reference(cfg, batches, ref)
    our_norms = train_ours(cfg, batches, ours, micro=2)
    assert ref_norms[0] > 0.5 or clip == 0.0, "clipping must be active in this test"
    torch.testing.assert_close(torch.tensor(our_norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-7)
    for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_bf16_model_keeps_fp32_master() -> None:
    """bf16 params, fp32 master: the master tracks the fp32 reference closely; params are its rounding."""
    cfg = make_cfg(grad_clip=0.0)
    cfg.train.dtype = "bf16"
    batches = data(4)
    torch.manual_seed(1)
    ref = Tiny()
    ours = Tiny(torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    ref32 = Tiny()
    ref32.load_state_dict({k: v.bfloat16().float() for k, v in ref.state_dict().items()})
    train_reference(cfg, batches, ref32)
    opt = DistributedOptimizer([ours], ctx1(), cfg)
    for step, (x, y) in enumerate(batches, start=1):
        opt.zero_grad()
        loss_fn(ours, x.bfloat16(), y, len(x)).backward()
        opt.finish_grad_sync()
        opt.step(step - 1)
    masters = {s.name: s.tensor for s in opt.state_shards() if s.name.startswith("optim.master.")}
    assert set(masters) == {f"optim.master.{n}" for n, _ in ours.named_parameters()}
    for n, p in ref32.named_parameters():
        # bf16 forward/backward: gradients carry ~3 significant digits, Adam normalises them, so
        # after 4 steps of lr 1e-2 the master differs from fp32 by well under 1e-2.
        torch.testing.assert_close(masters[f"optim.master.{n}"], p.detach(), rtol=0, atol=1e-2)
        assert torch.equal(dict(ours.named_parameters())[n].detach(), masters[f"optim.master.{n}"].bfloat16())


def test_fp16_overflow_skips_step_and_halves_scale() -> None:
    cfg = make_cfg()
    cfg.train.dtype = "fp16"
    cfg.train.loss_scale = 1024.0
    model = Tiny(torch.float16)
    opt = DistributedOptimizer([model], ctx1(), cfg)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = data(1)[0]
    opt.zero_grad()
    loss = loss_fn(model, x.half(), y, len(x))
    scaled = opt.scale_loss(loss)
    assert float(scaled.detach()) == pytest.approx(float(loss.detach()) * 1024.0, rel=1e-3)
    scaled.backward()
    opt.finish_grad_sync()
    model.fc1.weight.main_grad[0, 0] = float("inf")
    stats = opt.step(0)
    assert stats.skipped and stats.loss_scale == 512.0 and not math.isfinite(stats.grad_norm)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    # A good step unscales: the reported norm equals the unscaled gradient norm.
    opt.zero_grad()
    loss_fn(model, x.half(), y, len(x)).mul(512.0).backward()
    expect = torch.cat([p.main_grad.flatten() for p in model.parameters()]).norm() / 512.0
    opt.finish_grad_sync()
    stats = opt.step(1)
    assert not stats.skipped and stats.grad_norm == pytest.approx(float(expect), rel=1e-5)
    assert not all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    assert opt.extra_state()["loss_scaler"]["scale"] == 512.0


def test_loss_scaler_grows_after_window() -> None:
    scaler = LossScaler(True, 8.0, window=3, min_scale=2.0)
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 16.0
    for _ in range(5):
        scaler.update(True)
    assert scaler.scale == 2.0  # floored at min_scale
    static = LossScaler(False)
    assert static.scale == 1.0 and float(static.scale_loss(torch.tensor(3.0))) == 3.0


def test_schedules_at_key_steps() -> None:
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(1, o, 110) == pytest.approx(0.1)
    assert lr_at(10, o, 110) == pytest.approx(1.0)
    assert lr_at(60, o, 110) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_at(110, o, 110) == pytest.approx(0.1)
    assert lr_at(500, o, 110) == pytest.approx(0.1)
    o.schedule = "linear"
    assert lr_at(35, o, 110) == pytest.approx(1.0 - 0.9 * 0.25)
    o.schedule = "constant"
    assert lr_at(100, o, 110) == 1.0 and lr_at(5, o, 110) == pytest.approx(0.5)
    o.schedule, o.wsd_decay_fraction = "wsd", 0.2  # cool-down = last 22 of 110 steps
    assert lr_at(88, o, 110) == 1.0
    assert lr_at(99, o, 110) == pytest.approx(1.0 - 0.9 * 0.5)
    assert lr_at(110, o, 110) == pytest.approx(0.1)
    o.schedule, o.decay_steps = "cosine", 50
    assert lr_at(35, o, 1000) == pytest.approx(0.55)
    assert lr_at(61, o, 1000) == pytest.approx(0.1)


def test_logged_grad_norm_accumulates_in_fp64() -> None:
    """A gradient of 4M elements: the logged norm equals the fp64 norm to ~1e-7 (fp32 sums ran ~1e-5 low)."""
    layer = nn.Linear(2048, 2048, bias=False)
    set_shard(layer.weight, full_spec("w", tuple(layer.weight.shape)))
    opt = DistributedOptimizer([layer], ctx1(), make_cfg(grad_clip=0.0))
    opt.zero_grad()
    grad = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(0)) * 1e-3 + 1e-3
    (layer.weight * grad).sum().backward()
    opt.finish_grad_sync()
    stats = opt.step(0)
    expect = float(grad.double().square().sum().sqrt())
    assert stats.grad_norm == pytest.approx(expect, rel=2e-7)
