"""`megascale bench fp8`: a preset's block GEMMs in bf16 and in each FP8 recipe: time, kernel and error.

For each GEMM shape of the model (qkv, the attention output projection `proj`,
fc1, fc2 of the dense MLP; for Mixture-of-Experts presets the shared experts'
and one routed expert's fc1 / fc2) and each recipe (the bf16 baseline,
tensorwise, rowwise, blockwise), the three GEMMs of a linear layer are timed:

    fwd    y  = x  @ W^T    [tokens, in]  x [out, in]^T
    dgrad  dx = dy @ W      [tokens, out] x [out, in]
    wgrad  dW = dy^T @ x    [out, tokens] x [tokens, in]

An FP8 GEMM's time includes quantising its activation or gradient operands the
way the layers do (the GemmSite of the tensor-parallel linears, the routed
experts' per-row scales; wgrad reuses the forward's float8 x as the layers
do); the weight's quantisation (W and W^T) is reported apart, since it runs
once per optimizer step. Each output is compared with the fp64 product of the
same bf16 operands: the relative Frobenius error ||C - C64|| / ||C64||, and that
error divided by the bf16 GEMM's. The kernel column is `gemm_path`:
scaled_mm (torch._scaled_mm), scaled_mm_blockwise (block scales on CUDA) or
reference (dequantised operands, fp32 GEMM).

Shapes: tokens = micro_batch_size x seq_length / cp (`--tokens` overrides);
widths split over `--tp` (default: the config's parallel.tp) as the layers cut
them; a routed expert gets (tokens / tp) x top_k x ep / experts rows (balanced
routing: each tp rank routes its share of the tokens, each ep rank sends its rows),
or tokens x top_k x ep / experts with its widths split under expert tensor
parallelism (parallel.etp = tp pools the tp ranks' rows).

    megascale bench fp8                                            # llama3-8b's shapes, CUDA
    megascale bench fp8 --config configs/mixtral-8x7b.yaml --json fp8.json
    megascale bench fp8 --device cpu --config configs/tiny.yaml --tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from megascale.config import Config, ModelConfig, load_config
from megascale.distributed.sharding import full_spec, set_shard
from megascale.distributed.tensor_parallel.fp8_linear import Fp8Settings, GemmSite
from megascale.errors import UserError
from megascale.kernels.fp8 import RECIPES, Fp8Recipe, Fp8Tensor, gemm_path, quantize, requantize_t, scaled_gemm
from megascale.model.experts_fp8 import ExpertGemmSite

Tensor = torch.Tensor

BASELINE = "bf16"
GEMMS = ("fwd", "dgrad", "wgrad")
DEFAULT_CONFIG = "configs/llama3-8b.yaml"


@dataclass(frozen=True)
class GemmShape:
    """One linear layer's GEMM problem on one rank: tokens (rows of x), in and out features."""

    name: str
    tokens: int
    in_features: int
    out_features: int
    expert: bool = False

    def flops(self) -> int:
        """Multiply-adds x 2 of one of its three GEMMs (all three have the same count)."""
        return 2 * self.tokens * self.in_features * self.out_features


def _split(width: int, parts: int, what: str) -> int:
    if width % parts:
        raise UserError(f"{what} width {width} is not divisible by tp {parts}; pick a --tp that divides it")
    return width // parts


def expert_rows(model: ModelConfig, tokens: int, tp: int, etp: int, ep: int) -> int:
    """Rows one routed expert multiplies under balanced routing: each tp rank routes its 1/tp of the tokens
    (pooled again over the etp ranks under expert tensor parallelism), every ep rank sends top_k rows per
    token, spread evenly over the experts."""
    routed = tokens * etp // tp
    return max(1, -(-routed * model.moe.top_k * ep // model.moe.num_experts))


def _mlp_shapes(prefix: str, tokens: int, hidden: int, ffn: int, swiglu: bool, split: int,
                expert: bool = False) -> list[GemmShape]:
    up = (2 if swiglu else 1) * ffn  # gate and up are one fused GEMM
    return [GemmShape(f"{prefix}fc1", tokens, hidden, _split(up, split, f"{prefix}fc1"), expert),
            GemmShape(f"{prefix}fc2", tokens, _split(ffn, split, f"{prefix}fc2"), hidden, expert)]


def gemm_shapes(model: ModelConfig, tokens: int, tp: int, etp: int = 1, ep: int = 1) -> list[GemmShape]:
    """The distinct block GEMMs of `model` on one rank: qkv and proj, the dense MLP (when some layer is
    dense), the shared experts and one routed expert (MoE). tp splits the attention and dense widths,
    etp the routed experts'."""
    h, d = model.hidden_size, model.head_dim
    swiglu = model.activation == "swiglu"
    shapes = [GemmShape("qkv", tokens, h, _split((model.num_heads + 2 * model.kv_heads) * d, tp, "qkv")),
              GemmShape("proj", tokens, _split(model.num_heads * d, tp, "proj"), h)]
    if not all(model.is_moe_layer(i) for i in range(model.num_layers)):
        shapes += _mlp_shapes("", tokens, h, model.ffn_size, swiglu, tp)
    if model.moe.enabled and model.shared_ffn_size:
        shapes += _mlp_shapes("shared_", tokens, h, model.shared_ffn_size, swiglu, tp)
    if model.moe.enabled:
        rows = expert_rows(model, tokens, tp, etp, ep)
        shapes += _mlp_shapes("expert_", rows, h, model.expert_ffn_size, swiglu, etp, expert=True)
    return shapes


# ----------------------------------------------------------------------------- operands and quantisation


@dataclass
class Operands:
    """A GEMM shape's bf16 operands: x [tokens, in], the weight [out, in] (with a ShardSpec, as the
    layers' sites read it) and an output gradient dy [tokens, out]."""

    x: Tensor
    weight: Tensor
    dy: Tensor


def make_operands(shape: GemmShape, device: torch.device, seed: int = 0) -> Operands:
    """Normal x and dy, a weight of std 1/sqrt(in) (unit-scale outputs), all bf16, drawn on the device from a
    seeded generator (a preset's operands are 10^8 numbers: too many to draw on the host and copy)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    t, k, n = shape.tokens, shape.in_features, shape.out_features
    x = torch.randn(t, k, generator=gen, device=device).bfloat16()
    weight = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).bfloat16()
    dy = torch.randn(t, n, generator=gen, device=device).bfloat16()
    return Operands(x, weight, dy)


class DenseQuant:
    """The operands of a tensor-parallel linear's FP8 GEMMs, quantised by its own GemmSite (one rank)."""

    def __init__(self, recipe: Fp8Recipe, weight: Tensor) -> None:
        """weight: [out, in]; it gets a whole-tensor ShardSpec, as the site reads its layout from one."""
        self.site = GemmSite(Fp8Settings(recipe), None, None)
        self.weight = weight
        set_shard(weight, full_spec("bench.weight", weight.shape))

    def weights(self) -> tuple[Fp8Tensor, Fp8Tensor]:
        """(W for fwd, W^T for dgrad), remade when the weight's version moved."""
        return self.site.weights([self.weight])

    def fwd_a(self, x: Tensor) -> Fp8Tensor:
        """fwd's x [tokens, in]."""
        return self.site.activation(x)

    def dgrad_a(self, dy: Tensor) -> Fp8Tensor:
        """dgrad's dy [tokens, out]."""
        return self.site.grad_for_dgrad(dy)

    def wgrad_ab(self, dy: Tensor, dy_q: Fp8Tensor, x_q: Fp8Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
        """wgrad's (dy^T [out, tokens], x^T [in, tokens]) from dy, dgrad's float8 dy and fwd's float8 x."""
        return self.site.grad_for_wgrad(dy, dy_q), self.site.input_for_wgrad(x_q)


class ExpertQuant:
    """The operands of one routed expert's FP8 GEMMs, scaled as megascale.model.experts_fp8 does (per row
    or per 1 x 128 tile for x and dy, per row or 128 x 128 block for the weight), one rank."""

    def __init__(self, recipe: Fp8Recipe, weight: Tensor) -> None:
        """weight: [out, in], seen by the experts' site as the only expert of [1, out, in]."""
        self.recipe = recipe
        self.site = ExpertGemmSite(Fp8Settings(recipe), None, None)
        self.weight = weight.view(1, *weight.shape)
        set_shard(self.weight, full_spec("bench.experts.weight", self.weight.shape))

    def weights(self) -> tuple[Fp8Tensor, Fp8Tensor]:
        """(W for fwd, W^T for dgrad), remade when the weight's version moved."""
        return self.site.weights(self.weight)[0]

    def fwd_a(self, x: Tensor) -> Fp8Tensor:
        """fwd's x [rows, in]."""
        r = self.recipe
        return quantize(x, r.act, r.expert_act_scaling, pow2=r.pow2)

    def dgrad_a(self, dy: Tensor) -> Fp8Tensor:
        """dgrad's dy [rows, out]."""
        r = self.recipe
        return quantize(dy, r.grad, r.expert_act_scaling, pow2=r.pow2)

    def wgrad_ab(self, dy: Tensor, dy_q: Fp8Tensor, x_q: Fp8Tensor) -> tuple[Fp8Tensor, Fp8Tensor]:
        """wgrad's (dy^T [out, rows], x^T [in, rows]); x^T from fwd's float8 x."""
        r = self.recipe
        return (quantize(dy.t(), r.grad, r.expert_act_scaling, pow2=r.pow2),
                requantize_t(x_q, r.act, r.expert_act_scaling, pow2=r.pow2))


def quantizer(recipe: Fp8Recipe, shape: GemmShape, weight: Tensor) -> DenseQuant | ExpertQuant:
    """The quantisation of `shape`'s layer kind (a dense linear or a routed expert) in `recipe`."""
    return ExpertQuant(recipe, weight) if shape.expert else DenseQuant(recipe, weight)


# ----------------------------------------------------------------------------- measuring


@dataclass
class RecipeResult:
    """One recipe on one shape: ms per GEMM (operand quantisation included), the weight's quantisation
    (W and W^T, once per step), TFLOP/s, speed-up of fwd + dgrad + wgrad over bf16, kernel, errors."""

    recipe: str
    ms: dict[str, float]
    weight_quant_ms: Optional[float]
    tflops: dict[str, float]
    paths: dict[str, str]
    rel_err: dict[str, float]
    err_vs_bf16: dict[str, float] = field(default_factory=dict)
    speedup: float = 1.0


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of one call over `iters` calls after `warmup` untimed ones (CUDA: events
    around each call on the current stream; CPU: the wall clock)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def relative_error(got: Tensor, want: Tensor) -> float:
    """||got - want||_F / ||want||_F in fp64."""
    want = want.double()
    return float(torch.linalg.vector_norm(got.double() - want) / torch.linalg.vector_norm(want))


def _references(ops: Operands) -> dict[str, Tensor]:
    x, w, dy = ops.x.double(), ops.weight.double(), ops.dy.double()
    return {"fwd": x @ w.t(), "dgrad": dy @ w, "wgrad": dy.t() @ x}


def _bf16_calls(ops: Operands) -> dict[str, Callable[[], Tensor]]:
    x, w, dy = ops.x, ops.weight, ops.dy
    return {"fwd": lambda: torch.mm(x, w.t()), "dgrad": lambda: torch.mm(dy, w), "wgrad": lambda: torch.mm(dy.t(), x)}


def operand_pairs(quant: DenseQuant | ExpertQuant, ops: Operands) -> dict[str, tuple[Fp8Tensor, Fp8Tensor]]:
    """The float8 (a, b) of each GEMM (fwd, dgrad, wgrad), quantised once."""
    w_fwd, w_dgrad = quant.weights()
    x_q, dy_q = quant.fwd_a(ops.x), quant.dgrad_a(ops.dy)
    return {"fwd": (x_q, w_fwd), "dgrad": (dy_q, w_dgrad), "wgrad": quant.wgrad_ab(ops.dy, dy_q, x_q)}


def _fp8_calls(quant: DenseQuant | ExpertQuant, ops: Operands) -> tuple[dict[str, Callable[[], Tensor]],
                                                                        dict[str, str]]:
    """The three FP8 GEMMs (each quantising its x / dy operands) and the kernel each runs."""
    out = torch.bfloat16
    pairs = operand_pairs(quant, ops)
    (x_q, w_fwd), (dy_q, w_dgrad) = pairs["fwd"], pairs["dgrad"]
    calls: dict[str, Callable[[], Tensor]] = {
        "fwd": lambda: scaled_gemm(quant.fwd_a(ops.x), w_fwd, out),
        "dgrad": lambda: scaled_gemm(quant.dgrad_a(ops.dy), w_dgrad, out),
        "wgrad": lambda: scaled_gemm(*quant.wgrad_ab(ops.dy, dy_q, x_q), out),
    }
    return calls, {gemm: gemm_path(a, b, out) for gemm, (a, b) in pairs.items()}


def _weight_quant_ms(quant: DenseQuant | ExpertQuant, device: torch.device, warmup: int, iters: int) -> float:
    def fresh() -> None:
        torch.autograd.graph.increment_version(quant.weight)  # what an optimizer step does: the cache goes stale
        quant.weights()

    return time_ms(fresh, device, warmup, iters)


def measure(calls: dict[str, Callable[[], Tensor]], refs: dict[str, Tensor], shape: GemmShape,
            device: torch.device, warmup: int, iters: int) -> tuple[dict[str, float], dict[str, float],
                                                                     dict[str, float]]:
    """(ms, TFLOP/s, relative error) of each GEMM call."""
    ms = {gemm: time_ms(calls[gemm], device, warmup, iters) for gemm in GEMMS}
    tflops = {gemm: shape.flops() / (ms[gemm] * 1e-3) / 1e12 for gemm in GEMMS}
    errors = {gemm: relative_error(calls[gemm](), refs[gemm]) for gemm in GEMMS}
    return ms, tflops, errors


def run_shape(shape: GemmShape, recipes: list[str], device: torch.device, warmup: int, iters: int,
              seed: int = 0) -> list[RecipeResult]:
    """bf16 and each FP8 recipe on one shape (the bf16 result first)."""
    ops = make_operands(shape, device, seed)
    refs = _references(ops)
    ms, tflops, errors = measure(_bf16_calls(ops), refs, shape, device, warmup, iters)
    base = RecipeResult(BASELINE, ms, None, tflops, dict.fromkeys(GEMMS, "torch.mm"), errors)
    results = [base]
    for name in recipes:
        quant = quantizer(RECIPES[name], shape, ops.weight)
        calls, paths = _fp8_calls(quant, ops)
        ms, tflops, errors = measure(calls, refs, shape, device, warmup, iters)
        result = RecipeResult(name, ms, _weight_quant_ms(quant, device, warmup, iters), tflops, paths, errors)
        result.err_vs_bf16 = {g: errors[g] / base.rel_err[g] if base.rel_err[g] > 0 else float("inf")
                              for g in GEMMS}
        result.speedup = sum(base.ms.values()) / sum(ms.values())
        results.append(result)
    return results


# ----------------------------------------------------------------------------- report


def _kernel(paths: dict[str, str]) -> str:
    names = [paths[g] for g in GEMMS]
    return names[0] if len(set(names)) == 1 else "/".join(names)


def _error_cell(result: RecipeResult, gemm: str) -> str:
    if result.recipe == BASELINE:
        return f"{result.rel_err[gemm]:.1e}"
    return f"{result.rel_err[gemm]:.1e} x{result.err_vs_bf16[gemm]:.0f}"


def format_shape(shape: GemmShape, results: list[RecipeResult]) -> str:
    """One shape's table: a row per recipe."""
    lines = [f"{shape.name}: tokens {shape.tokens}, in {shape.in_features}, out {shape.out_features}",
             f"  {'recipe':<12}{'fwd ms':>9}{'dgrad ms':>10}{'wgrad ms':>10}{'speed-up':>10}{'W quant ms':>12}"
             f"{'err fwd':>15}{'err dgrad':>15}{'err wgrad':>15}  kernel"]
    for r in results:
        quant = f"{r.weight_quant_ms:.3f}" if r.weight_quant_ms is not None else "-"
        errors = "".join(f"{_error_cell(r, g):>15}" for g in GEMMS)
        lines.append(f"  {r.recipe:<12}{r.ms['fwd']:>9.3f}{r.ms['dgrad']:>10.3f}{r.ms['wgrad']:>10.3f}"
                     f"{r.speedup:>9.2f}x{quant:>12}{errors}  {_kernel(r.paths)}")
    return "\n".join(lines)


def device_name(device: torch.device) -> str:
    """The CUDA device's name, or 'cpu'."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is visible; use --device cpu")
    return torch.device(name)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="megascale bench fp8", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="preset whose model shapes are timed "
                        f"(default {DEFAULT_CONFIG}); dotted key=value overrides may follow")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size the widths are split by "
                        "(default: the config's parallel.tp)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per GEMM (default: micro_batch_size x "
                        "seq_length / cp)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="FP8 recipes, comma-separated")
    parser.add_argument("--shapes", default=None, help="subset of shapes, comma-separated (e.g. qkv,fc1)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5 on CUDA, 1 on CPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls, median reported (default 20 on "
                        "CUDA, 3 on CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", default=None, help="also write the numbers to this file")
    return parser.parse_known_args(argv)


def _shapes_of(cfg: Config, args: argparse.Namespace) -> list[GemmShape]:
    tp = args.tp if args.tp is not None else cfg.parallel.tp
    tokens = args.tokens if args.tokens is not None else \
        cfg.train.micro_batch_size * cfg.model.seq_length // cfg.parallel.cp
    if tp < 1 or tokens < 1:
        raise UserError("--tp and --tokens must be >= 1")
    etp = tp if cfg.parallel.etp > 1 else 1
    shapes = gemm_shapes(cfg.model, tokens, tp, etp, cfg.parallel.ep)
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = sorted(set(wanted) - {s.name for s in shapes})
        if unknown:
            raise UserError(f"--shapes: no shape {', '.join(unknown)} here; choose from "
                            f"{', '.join(s.name for s in shapes)}")
        shapes = [s for s in shapes if s.name in wanted]
    return shapes


def run_all(shapes: list[GemmShape], recipes: list[str], device: torch.device, warmup: int, iters: int,
            seed: int = 0) -> list[dict]:
    """Every shape's results, each table printed as it is done; JSON-ready."""
    report: list[dict] = []
    for shape in shapes:
        results = run_shape(shape, recipes, device, warmup, iters, seed)
        print(format_shape(shape, results))
        report.append({**asdict(shape), "results": [asdict(r) for r in results]})
    return report


def main(argv: list[str]) -> int:
    """Parse arguments, time every shape in bf16 and each recipe, print the tables, optionally write JSON."""
    args, overrides = _parse(argv)
    recipes = [name for name in args.recipes.split(",") if name]
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        raise UserError(f"--recipes: {', '.join(unknown)} not one of {', '.join(RECIPES)}")
    shapes = _shapes_of(load_config(args.config, overrides), args)
    device = _resolve_device(args.device)
    on_cuda = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 1)
    iters = args.iters if args.iters is not None else (20 if on_cuda else 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        cpu_threads = f" ({torch.get_num_threads()} threads)" if device.type == "cpu" else ""
        print(f"device {device_name(device)}{cpu_threads}, torch {torch.__version__}, config {args.config}, "
              f"bf16 operands; ms: median of {iters} calls; err: relative Frobenius error against fp64 "
              "(x: FP8 error / bf16 error)")
        report = run_all(shapes, recipes, device, warmup, iters, args.seed)
    finally:
        torch.set_num_threads(threads)  # an in-process caller keeps its own setting
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"device": device_name(device), "torch": torch.__version__, "config": args.config,
                       "overrides": overrides, "warmup": warmup, "iters": iters, "shapes": report}, fh, indent=2)
    return 0
