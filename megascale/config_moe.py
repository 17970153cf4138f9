"""`model.moe.*`: the Mixture-of-Experts section of the config tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megascale.config_fields import _f

RouterKind = Literal["softmax", "sigmoid"]


@dataclass
class MoEConfig:
    """model.moe.*: Mixture-of-Experts MLPs (num_experts = 0 keeps every layer dense)."""

    num_experts: int = _f(0, "routed experts per MoE layer; 0 = a dense model")
    top_k: int = _f(2, "experts each token is routed to")
    ffn_hidden_size: Optional[int] = _f(None, "width of one routed expert's MLP; null = model.ffn_hidden_size "
                                              "(resolved)")
    shared_experts: int = _f(0, "always-active shared experts (DeepSeek style), run as one dense MLP beside "
                                "the routed ones")
    shared_ffn_hidden_size: Optional[int] = _f(None, "width of the shared-expert MLP; null = shared_experts x "
                                                     "the routed expert width")
    first_dense: int = _f(0, "the first k layers stay dense (DeepSeek-V3: 3)")
    frequency: int = _f(1, "after the first_dense layers, every n-th layer is an MoE layer (1 = all of them)")
    router: RouterKind = _f("softmax", "softmax: softmax over all experts, then top-k (Mixtral, Qwen); sigmoid: "
                                       "sigmoid affinities, top-k on affinity + bias (DeepSeek-V3)", RouterKind)
    norm_topk_prob: bool = _f(True, "renormalise the top-k gate weights of each token to sum to 1")
    routed_scaling: float = _f(1.0, "factor on the routed experts' combined output (DeepSeek-V3: 2.5)")
    bias_update_rate: float = _f(0.0, "sigmoid router: aux-loss-free balancing, each expert's selection bias "
                                      "moves by this much per step towards the mean load (DeepSeek-V3: 0.001); "
                                      "0 = off")
    aux_loss_coeff: float = _f(0.0, "coefficient of the load-balancing loss N * sum_i f_i * P_i; 0 = off")
    z_loss_coeff: float = _f(0.0, "coefficient of the router z-loss mean(logsumexp(logits)^2); 0 = off")
    capacity_factor: Optional[float] = _f(None, "tokens an expert takes per micro-batch, as a multiple of the "
                                                "balanced share (tokens * top_k / num_experts); the rest are "
                                                "dropped. null = dropless")

    @property
    def enabled(self) -> bool:
        """True when the model has MoE layers."""
        return self.num_experts > 0


__all__ = ["MoEConfig", "RouterKind"]
