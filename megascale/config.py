"""One typed config tree: YAML file + dotted ``key=value`` overrides, validated up front.

Every field has a docstring-like ``help`` in its metadata. A user error raises
`ConfigError` with one message naming the key and the fix; the CLI prints it
without a traceback. Unknown keys suggest the nearest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from megascale.config_fault import FaultConfig
from megascale.config_fields import _f
from megascale.config_fields import choices_of as choices_of
from megascale.config_moe import MoEConfig
from megascale.errors import ConfigError
from megascale.layout_rules import check_expert_tensor_parallel, check_layout, check_moe

# The values a choice field accepts. Each alias is the one source of its choices: the field is
# annotated with it, `_coerce` validates against it, and code that takes the value uses it too.
Norm = Literal["layernorm", "rmsnorm"]
Activation = Literal["gelu", "gelu_exact", "swiglu"]
Position = Literal["learned", "rope"]
AttentionVariant = Literal["causal", "sliding_window"]
CpMode = Literal["ulysses", "ring", "hybrid"]
ZeroStage = Literal[0, 1, 2, 3]
PipelineScheduleName = Literal["auto", "1f1b", "interleaved", "gpipe", "zb-h1", "zbv"]
DtypeName = Literal["fp32", "bf16", "fp16"]
Fp8RecipeName = Literal["off", "tensorwise", "rowwise", "blockwise"]
DeviceName = Literal["auto", "cpu", "cuda"]
Recompute = Literal["none", "full", "selective"]
OptimizerName = Literal["adamw", "lamb"]
LrScheduleName = Literal["cosine", "linear", "constant", "wsd"]
LogLevel = Literal["debug", "info", "warning"]
KernelBackend = Literal["auto", "cuda", "torch"]
AttentionBackend = Literal["auto", "sdpa", "flex", "flash_attn", "torch"]
SaveFailurePolicy = Literal["continue", "stop"]
WandbMode = Literal["online", "offline", "disabled"]


@dataclass
class ModelConfig:
    """Shape and variant of the GPT model."""

    num_layers: int = _f(12, "number of transformer blocks")
    hidden_size: int = _f(768, "model width h")
    num_heads: int = _f(12, "attention (query) heads")
    num_kv_heads: Optional[int] = _f(None, "key/value heads for grouped-query attention; null = num_heads (MHA)")
    ffn_hidden_size: Optional[int] = _f(None, "MLP width; null = 4h for gelu, 8h/3 rounded up to 64 for swiglu")
    vocab_size: int = _f(50257, "tokenizer vocabulary size (padded internally, see vocab_pad_multiple)")
    vocab_pad_multiple: int = _f(128, "embedding rows are padded to a multiple of this; must be divisible by "
                                      "parallel.tp")
    seq_length: int = _f(1024, "training sequence length in tokens")
    norm: Norm = _f("layernorm", "normalisation layer", Norm)
    norm_eps: float = _f(1e-5, "epsilon of the norm layers")
    activation: Activation = _f("gelu", "MLP activation: gelu (tanh approximation, GPT-2/Megatron), gelu_exact "
                                        "(erf form, HF 'gelu'), swiglu", Activation)
    position: Position = _f("learned", "position encoding", Position)
    rope_theta: float = _f(10000.0, "RoPE base frequency")
    attention: AttentionVariant = _f("causal", "attention variant", AttentionVariant)
    window_size: int = _f(0, "sliding-window width in tokens (attention=sliding_window)")
    lfa: bool = _f(False, "Yuan 2.0 Localized Filtering-based Attention: q and k come from the attention input "
                          "after two causal kernel-2 convolutions along the sequence (h -> h/2 -> h) and "
                          "RMSNorm(conv_out + x); v from the unfiltered input")
    lfa_norm_eps: float = _f(1e-6, "epsilon of LFA's filter RMSNorm (model.lfa); Yuan 2.0 uses 1e-6 there "
                                   "whatever the other norms use")
    parallel_block: bool = _f(False, "PaLM parallel block: y = x + attn(ln(x)) + mlp(ln(x))")
    bias: bool = _f(True, "biases in linear layers and norms")
    tie_embeddings: bool = _f(True, "share input embedding and output projection")
    dropout: float = _f(0.0, "hidden dropout probability")
    attention_dropout: float = _f(0.0, "attention-probability dropout")
    init_std: float = _f(0.02, "std of the normal weight init (output projections scaled by 1/sqrt(2*layers))")
    moe: MoEConfig = field(default_factory=MoEConfig, metadata={"help": "Mixture-of-Experts layers"})
    qk_norm: bool = _f(False, "RMSNorm over each head's query and key (per-head width, one weight shared by "
                              "all heads, epsilon model.norm_eps) before RoPE, as in Qwen3 and OLMo 2")
    kv_channels: Optional[int] = _f(None, "width of one attention head; null = hidden_size / num_heads "
                                          "(Qwen3 sets it apart: 128 with hidden 2048 and 32 heads)")

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (global, from 0) has a routed-expert MLP."""
        moe = self.moe
        return moe.enabled and index >= moe.first_dense and (index - moe.first_dense) % moe.frequency == 0

    @property
    def expert_ffn_size(self) -> int:
        """Resolved width of one routed expert."""
        return self.moe.ffn_hidden_size or self.ffn_size

    @property
    def shared_ffn_size(self) -> int:
        """Resolved width of the shared-expert MLP (0 without shared experts)."""
        if self.moe.shared_ffn_hidden_size:
            return self.moe.shared_ffn_hidden_size
        return self.moe.shared_experts * self.expert_ffn_size

    @property
    def kv_heads(self) -> int:
        """Resolved number of key/value heads."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        """Per-head width: model.kv_channels, else hidden_size / num_heads."""
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """Resolved MLP width."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            return 64 * -(-(8 * self.hidden_size // 3) // 64)
        return 4 * self.hidden_size

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to vocab_pad_multiple (layout-independent)."""
        m = self.vocab_pad_multiple
        return m * -(-self.vocab_size // m)


@dataclass
class ParallelConfig:
    """Parallel layout; world size must equal tp * pp * dp * cp."""

    tp: int = _f(1, "tensor-parallel size")
    pp: int = _f(1, "pipeline-parallel size")
    dp: Optional[int] = _f(None, "data-parallel size; null = world_size / (tp*pp*cp)")
    cp: int = _f(1, "context-parallel size")
    ep: int = _f(1, "expert-parallel size: routed experts split over this many ranks, taken from the dp x cp ranks")
    etp: int = _f(1, "expert tensor parallelism: 1 = every tp rank holds its local experts whole and routes its own "
                     "tokens through them; parallel.tp = each expert's MLP is split over the tp ranks like the dense "
                     "MLP, and the tp ranks' dispatched tokens are gathered for it")
    ep_overlap: bool = _f(True, "MoE: run the shared experts while the expert-parallel all-to-alls are in flight "
                                "(the up half under the dispatch, the down half under the combine; the backward's "
                                "all-to-alls under their backward); false runs everything in order")
    vpp: int = _f(1, "virtual pipeline stages (model chunks) per pipeline rank")
    order: str = _f("tp-cp-dp-pp", "rank order, fastest-varying axis first")
    sequence_parallel: bool = _f(False, "shard norms/dropout/residual over the sequence inside tp groups")
    tp_overlap: bool = _f(False, "chunk and pipeline tp all-gather/reduce-scatter with the GEMMs")
    sp_regather_input: bool = _f(True, "sequence parallel: column-parallel GEMMs save only this rank's 1/tp of "
                                       "their input and re-gather it in the backward under the input-gradient "
                                       "GEMM; false saves the whole gathered input")
    cp_mode: CpMode = _f("ulysses", "context-parallel algorithm", CpMode)
    ulysses_size: Optional[int] = _f(None, "hybrid cp: ranks in each Ulysses group (the rest is ring); null = "
                                                   "the largest divisor of cp dividing the kv heads per tp rank")
    zero: ZeroStage = _f(0, "0 = replicated optimizer, 1 = ZeRO-1 (optimizer state sharded over dp x cp), "
                            "2 = ZeRO-2 (gradients sharded too: reduce-scattered after every micro-batch), "
                            "3 = ZeRO-3 (parameters sharded too: each layer gathered just before use)", ZeroStage)
    dp_shard: Optional[int] = _f(None, "zero>=1: shard within groups of this many data-parallel ranks (x cp) and "
                                       "replicate across the groups, whose gradient shards are all-reduced "
                                       "(hybrid sharding, HSDP; a node's ranks, typically); null = dp")
    reshard_after_forward: bool = _f(True, "zero=3: free a layer's gathered parameters after its forward and "
                                           "gather them again for its backward; false keeps them until the "
                                           "backward (less traffic, more memory)")
    pipeline_schedule: PipelineScheduleName = _f("auto", "pipeline schedule; auto = interleaved when vpp>1 else "
                                                 "1f1b; zb-h1 / zbv (vpp=2) split the backward into input- and "
                                                 "weight-gradient passes (zero bubble)", PipelineScheduleName)
    # YAML gives a list (or null); code may also set the string 'auto'.
    pipeline_layers: Union[list, str, None] = _f(None, "explicit layers per pipeline stage (per virtual stage "
                                                        "with vpp), or 'auto'")
    grad_bucket_mb: float = _f(25.0, "gradient bucket size for the overlapped data-parallel reduction, MiB")
    overlap_grad_reduce: bool = _f(True, "start each bucket's reduction as soon as its gradients are ready")
    overlap_param_gather: bool = _f(True, "zero=1/2: all-gather updated params bucket by bucket under the "
                                          "next forward; zero=3: prefetch the next layer's gather under this "
                                          "layer's compute")


@dataclass
class TrainConfig:
    """Run length, batch, precision and output."""

    steps: int = _f(100, "optimizer steps to run")
    seed: int = _f(1234, "seed for weights, data order and dropout")
    global_batch_size: int = _f(8, "sequences per optimizer step over all data-parallel ranks")
    micro_batch_size: int = _f(1, "sequences per forward pass per rank")
    dtype: DtypeName = _f("fp32", "compute precision", DtypeName)
    fp8: Fp8RecipeName = _f("off", "FP8 GEMMs in the transformer blocks (qkv, attention output, fc1, fc2, experts): "
                                   "off, tensorwise (per-tensor current scaling), rowwise (per-row scaling) or "
                                   "blockwise (1x128 activation tiles, 128x128 weight blocks); everything else stays "
                                   "in train.dtype", Fp8RecipeName)
    fp8_exclude: list = _f([], "glob patterns of linear-layer names kept in train.dtype under train.fp8, e.g. "
                               "['layers.0.*', '*.fc2'] (names as in the checkpoint, without .weight)")
    device: DeviceName = _f("auto", "auto picks cuda when available", DeviceName)
    output_dir: str = _f("runs/default", "run directory (config.yaml, metrics.jsonl, checkpoints/)")
    eval_interval: int = _f(0, "steps between validation-loss evaluations; 0 = never")
    eval_iters: int = _f(2, "global batches per validation evaluation (the same samples every time)")
    recompute: Recompute = _f("none", "activation recomputation", Recompute)
    recompute_layers: Optional[int] = _f(None, "recompute only the first k layers of each stage; null = all")
    compile: bool = _f(False, "torch.compile each transformer block")
    peak_tflops: Optional[float] = _f(None, "device dense peak TFLOP/s for MFU when the device is not in the table")
    loss_scale: float = _f(65536.0, "fp16: initial dynamic loss scale")


@dataclass
class OptimConfig:
    """Optimizer, schedule and clipping."""

    name: OptimizerName = _f("adamw", "optimizer", OptimizerName)
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(3e-5, "final learning rate of the decay")
    weight_decay: float = _f(0.1, "decoupled weight decay (norms and biases excluded)")
    beta1: float = _f(0.9, "first-moment decay")
    beta2: float = _f(0.95, "second-moment decay")
    eps: float = _f(1e-8, "denominator epsilon")
    grad_clip: float = _f(1.0, "global gradient-norm clip; 0 = off")
    schedule: LrScheduleName = _f("cosine", "lr schedule after warmup", LrScheduleName)
    warmup_steps: int = _f(10, "linear warmup steps")
    decay_steps: Optional[int] = _f(None, "steps of the decay phase; null = train.steps - warmup")
    wsd_decay_fraction: float = _f(0.1, "wsd: fraction of the run spent in the final decay")
    loss_scale_window: int = _f(1000, "fp16: consecutive finite steps before the dynamic loss scale doubles")
    min_loss_scale: float = _f(1.0, "fp16: the dynamic loss scale never halves below this")


@dataclass
class DataConfig:
    """Training data: indexed datasets, blending, split and loader."""

    paths: list = _f([], "dataset prefixes (X for X.bin/X.idx); may be given as 'weight prefix weight prefix ...'")
    weights: Optional[list] = _f(None, "blend weights, one per path; null = proportional to size")
    split: str = _f("98,2,0", "train,valid,test split of documents, in parts")
    tokenizer: Optional[str] = _f(None, "SentencePiece .model, HF tokenizer.json, or a directory holding either "
                                        "(checked against model.vocab_size; used by generate and convert)")
    cache_dir: Optional[str] = _f(None, "where sample indices are cached; null = beside the data")
    prefetch: int = _f(2, "batches prepared ahead by the background loader")
    demo: bool = _f(False, "build the demo corpus from the Python standard library if paths are missing")


@dataclass
class CheckpointConfig:
    """Saving, loading and resuming."""

    interval: int = _f(0, "steps between checkpoints; 0 = only at the end if save_final")
    save_final: bool = _f(True, "save a checkpoint after the last step")
    async_save: bool = _f(True, "snapshot to host memory, then write in the background", alias="async")
    keep_last: int = _f(3, "complete checkpoints to keep; 0 = keep all")
    dir: Optional[str] = _f(None, "where checkpoints are kept: a local or NAS path, or s3://bucket/prefix (saved to "
                                  "<output_dir>/checkpoints first, then uploaded in the background; endpoint and "
                                  "credentials from the AWS_* variables or ~/.aws, never this file); "
                                  "null = <output_dir>/checkpoints")
    load: Optional[str] = _f(None, "checkpoint directory to start from; null = resume from output_dir if present")
    resume: bool = _f(True, "resume automatically from the latest checkpoint in output_dir")
    broadcast_load: bool = _f(False, "one data-parallel replica reads, then broadcasts to the others")
    allow_fresh_start: bool = _f(False, "when checkpoints exist in output_dir but none is usable, start from step 0 "
                                        "instead of refusing (the unusable step dirs are kept, never overwritten)")
    on_save_failure: SaveFailurePolicy = _f("continue", "when a periodic save fails (disk full, failing file "
                                                        "system): continue training on the last good checkpoint, "
                                                        "or stop (exit non-zero); a failed final save always exits "
                                                        "non-zero", SaveFailurePolicy)


@dataclass
class WandbConfig:
    """Weights & Biases: metrics.jsonl scalars mirrored to a W&B run by the logging rank."""

    project: Optional[str] = _f(None, "W&B project; null = W&B off")
    entity: Optional[str] = _f(None, "W&B entity (user or team); null = the account's default")
    name: Optional[str] = _f(None, "W&B run name; null = the run directory's name")
    mode: WandbMode = _f("online", "online, offline (written locally, `wandb sync` later) or disabled", WandbMode)


@dataclass
class LogConfig:
    """Logging and metrics."""

    interval: int = _f(1, "steps between log lines and metrics records")
    tensorboard: Optional[bool] = _f(None, "TensorBoard events: null = write them when tensorboard is installed "
                                           "(silently skipped when not); true = write them, with a warning when "
                                           "tensorboard is not installed; false = never")
    level: LogLevel = _f("info", "log level", LogLevel)
    timers: bool = _f(True, "always-on per-rank phase timers (forward, backward, each collective, optimizer, "
                            "data wait, checkpoint blocking, pipeline bubble) gathered into timers.jsonl every "
                            "log interval, with straggler detection; see docs/observability.md")
    straggler_threshold: float = _f(0.1, "name a rank as a straggler when its median compute or step time over "
                                         "the straggler window exceeds the median rank's by more than this fraction "
                                         "(0.1 = 10%); 0 = off")
    straggler_window: int = _f(16, "steps (the most recent, every rank) the straggler medians are taken over")
    profile_steps: Optional[str] = _f(None, "torch.profiler trace of steps N..M on every rank, as 'N-M' (or 'N'), "
                                            "written to profile/rank_R.json in the run directory")
    wandb: WandbConfig = field(default_factory=lambda: WandbConfig(),
                               metadata={"help": "Weights & Biases sink (optional extra megascale[wandb])"})


@dataclass
class KernelsConfig:
    """Which implementation serves the fused ops."""

    backend: KernelBackend = _f("auto", "auto prefers csrc CUDA, then TE/apex/flash-attn, then torch", KernelBackend)
    attention: AttentionBackend = _f("auto", "attention kernel: auto (GPU: flash-attn if installed and fp16/bf16, "
                                             "else SDPA for plain causal and FlexAttention for windows; CPU: SDPA for "
                                             "plain causal, the exact blockwise torch kernel for windows and attention "
                                             "dropout), sdpa, flex (GPU only), flash_attn, torch (the exact blockwise "
                                             "kernel, any device); see docs/attention.md", AttentionBackend)
    build_dir: Optional[str] = _f(None, "where the csrc CUDA extension is JIT-built and cached; null = torch's default "
                                         "extensions dir (~/.cache/torch_extensions)")


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def to_dict(self) -> dict:
        """Plain nested dict using the YAML key names."""
        return _to_dict(self)


# ----------------------------------------------------------------------------- building


def _yaml_name(f: dataclasses.Field) -> str:
    return f.metadata.get("alias", f.name)


def _fields_by_yaml_name(cls: type) -> dict[str, dataclasses.Field]:
    return {_yaml_name(f): f for f in dataclasses.fields(cls)}


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_yaml_name(f): _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [_to_dict(x) for x in obj]
    return obj


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    leaf = key.rsplit(".", 1)
    prefix = leaf[0] + "." if len(leaf) == 2 else ""
    close = difflib.get_close_matches(leaf[-1], valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert value to the field's type, raising ConfigError naming the key."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if annotation is Any:
        return value
    if origin is Literal:
        return _coerce_choice(key, value, args)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{key}={value!r} must be true or false")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, (int, str, float)):
            raise ConfigError(f"{key}={value!r} must be an integer")
        try:
            as_float = float(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} must be an integer") from None
        if not as_float.is_integer():
            raise ConfigError(f"{key}={value!r} must be an integer")
        return int(as_float)
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} must be a number") from None
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {type(value).__name__}")
        return str(value)
    if annotation is list or origin is list:
        if isinstance(value, str):
            try:
                parsed = yaml.safe_load(value) if value.strip().startswith("[") else value.split(",")
            except yaml.YAMLError:
                raise ConfigError(f"{key}={value!r} is not a valid YAML list; write the items comma-separated "
                                  f"without brackets ({key}=a,b) or quote them ({key}='[\"a\", \"b\"]')") from None
            value = parsed if isinstance(parsed, list) else [parsed]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return list(value)
    return value


def _coerce_choice(key: str, value: Any, choices: tuple) -> Any:
    """Convert value to the type of a `Literal` field's choices, then check it is one of them."""
    kinds = {type(choice) for choice in choices}
    if value is False and "off" in choices:  # YAML 1.1 reads a bare `off` (and `no`, `false`) as false
        value = "off"
    value = _coerce(key, value, kinds.pop()) if len(kinds) == 1 else value
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        section = prefix.rstrip(".") or "top level"
        raise ConfigError(f"section '{section}' must be a mapping, got {type(data).__name__}")
    fields = _fields_by_yaml_name(cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(prefix + str(key), list(fields))
        f = fields[key]
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[f.name] = _build(hint, value, prefix + key + ".")
            continue
        kwargs[f.name] = _coerce(prefix + key, value, hint)
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ['a.b=1', 'c=x'] into a nested dict; values are parsed as YAML scalars."""
    nested: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value, e.g. train.steps=100")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' sets a key below a value")
        node[parts[-1]] = value
    return nested


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """Load YAML (optional), apply dotted overrides, validate; raises ConfigError."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' not found; pass --config with an existing YAML file "
                              "(see configs/)")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", err)
            raise ConfigError(f"config file '{path}' is not valid YAML{where}: {problem}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of sections (model:, train:, ...)")
        data = loaded or {}
    data = _merge(data, parse_overrides(overrides or []))
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def config_from_dict(data: dict, overrides: Optional[list[str]] = None) -> Config:
    """Build and validate a Config from a nested dict (e.g. a checkpoint's saved config) and dotted overrides."""
    cfg = _build(Config, _merge(data, parse_overrides(overrides or [])), "")
    validate(cfg)
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the fully resolved config as YAML."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ----------------------------------------------------------------------------- validation


def parse_profile_steps(spec: Optional[str]) -> Optional[tuple[int, int]]:
    """'N-M' or 'N' -> (N, M) with 1 <= N <= M; None for no profiling; ConfigError otherwise."""
    if spec is None or not str(spec).strip():
        return None
    first, sep, last = str(spec).strip().partition("-")
    try:
        start, end = int(first), int(last if sep else first)
    except ValueError:
        raise ConfigError(f"log.profile_steps={spec!r} must be 'N-M' or 'N' (steps as the log numbers them), "
                          "e.g. log.profile_steps=5-7") from None
    if not 1 <= start <= end:
        raise ConfigError(f"log.profile_steps={spec!r}: need 1 <= N <= M, e.g. log.profile_steps=5-7")
    return start, end


def _positive(key: str, value: int) -> None:
    if value is None or value < 1:
        raise ConfigError(f"{key}={value} must be >= 1")


def validate(cfg: Config) -> None:
    """Checks that need no world size; `megascale.run_plan.resolve_plan` adds those that do."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for key in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length", "vocab_pad_multiple"):
        _positive(f"model.{key}", getattr(m, key))
    for key in ("tp", "pp", "cp", "vpp"):
        _positive(f"parallel.{key}", getattr(p, key))
    if p.dp is not None:
        _positive("parallel.dp", p.dp)
    for key in ("steps", "global_batch_size", "micro_batch_size"):
        _positive(f"train.{key}", getattr(t, key))
    if m.kv_channels is not None:
        _positive("model.kv_channels", m.kv_channels)
    elif m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
                          "set model.kv_channels for a head width of its own")
    if m.num_heads % m.kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.kv_heads}")
    if m.position == "rope" and m.head_dim % 2:
        raise ConfigError(f"rotary positions need an even head dim; model.kv_channels or hidden_size/num_heads "
                          f"= {m.head_dim}")
    if m.attention == "sliding_window" and m.window_size < 1:
        raise ConfigError("model.attention=sliding_window needs model.window_size >= 1")
    if m.lfa and m.hidden_size % 2:
        raise ConfigError(f"model.lfa halves the hidden size in its first convolution; "
                          f"model.hidden_size={m.hidden_size} must be even")
    if not 0.0 <= m.dropout < 1.0 or not 0.0 <= m.attention_dropout < 1.0:
        raise ConfigError("model.dropout and model.attention_dropout must be in [0, 1)")
    check_moe(m, p.ep)
    check_expert_tensor_parallel(m, p.tp, p.etp)
    # The world-free layout checks (tp, sequence and context parallelism); the run plan repeats
    # them with the world size. Running them here reports them as soon as the file is read.
    check_layout(cfg)
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                          f"train.micro_batch_size={t.micro_batch_size}")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be > 0")
    if cfg.optim.warmup_steps < 0:
        raise ConfigError("optim.warmup_steps must be >= 0")
    if cfg.log.interval < 1:
        raise ConfigError(f"log.interval={cfg.log.interval} must be >= 1")
    _positive("log.straggler_window", cfg.log.straggler_window)
    if cfg.log.straggler_threshold < 0:
        raise ConfigError(f"log.straggler_threshold={cfg.log.straggler_threshold} must be >= 0 (0 = off)")
    if cfg.log.profile_steps is not None:
        parse_profile_steps(cfg.log.profile_steps)

