"""Which linears `train.fp8` puts in float8, and the checks of an FP8 run's settings.

The FP8 linears are the GEMMs of the transformer blocks: each layer's attention qkv and
output projection, and its MLP's fc1 and fc2 (the routed experts' and the shared experts'
in an MoE layer; an LFA layer's qkv as two GEMMs, its q/k rows over the filtered input and
its v rows over the unfiltered one). Everything else (embedding, output layer, router, norms,
attention core, LFA's convolutions) stays in train.dtype. Names are the layers' global
names, as in the checkpoint without `.weight` (`layers.3.mlp.fc2`); `train.fp8_exclude`
matches them with shell-style globs.
"""

from __future__ import annotations

import fnmatch
import re

import torch

from megascale.config import Config, ConfigError

_FP8_LINEAR = re.compile(r"layers\.\d+\.(attention\.(qkv|proj)|mlp\.((shared|experts)\.)?fc[12])")

# FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer.
MIN_CAPABILITY = (8, 9)


def fp8_layer_names(cfg: Config) -> list[str]:
    """The global names of the linears that run in float8 when train.fp8 names a recipe (before exclusion)."""
    from megascale.model.params import param_table

    names = [entry.name.removesuffix(".weight") for entry in param_table(cfg.model).entries
             if entry.name.endswith(".weight")]
    return [name for name in names if _FP8_LINEAR.fullmatch(name)]


def check_fp8(cfg: Config, device: torch.device) -> None:
    """ConfigError (one line) for an FP8 setting that cannot work: a device without FP8 tensor cores, or a
    train.fp8_exclude pattern that names no FP8 linear (a typo would silently keep every layer in FP8)."""
    if cfg.train.fp8 == "off":
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ConfigError(f"train.fp8={cfg.train.fp8} needs FP8 tensor cores (compute capability 8.9 or newer: "
                              f"Ada, Hopper, Blackwell); {name} is {capability[0]}.{capability[1]}: set train.fp8=off")
    patterns = [str(p) for p in cfg.train.fp8_exclude]
    if not patterns:
        return
    names = fp8_layer_names(cfg)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            examples = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise ConfigError(f"train.fp8_exclude pattern {pattern!r} matches no FP8 linear; their names look like "
                              f"{examples} (shell-style globs, e.g. 'layers.0.*' or '*.fc2')")


__all__ = ["MIN_CAPABILITY", "check_fp8", "fp8_layer_names"]
