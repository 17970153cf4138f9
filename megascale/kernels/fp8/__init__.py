"""FP8 GEMMs: recipes, layout-independent quantisation and the scaled GEMM front.

    from megascale.kernels.fp8 import recipe_of, quantize, scaled_gemm
    recipe = recipe_of("rowwise")
    y = scaled_gemm(quantize(x, recipe.act, recipe.act_scaling), quantize(w, recipe.weight, recipe.weight_scaling),
                    out_dtype=torch.bfloat16)

The tensor-parallel linears (megascale.distributed.tensor_parallel.fp8_linear) and the
routed experts run their GEMMs through this front when `train.fp8` names a recipe.
"""

from megascale.kernels.fp8.gemm import GemmPath, gemm_path, reference_gemm, scaled_gemm
from megascale.kernels.fp8.quantize import LOCAL, Axis, Fp8Tensor, amax_of, block_ids, quantize, requantize_t
from megascale.kernels.fp8.recipes import BLOCK, E4M3, E5M2, RECIPES, Fp8Recipe, Scaling, max_of, recipe_of

__all__ = ["BLOCK", "E4M3", "E5M2", "LOCAL", "RECIPES", "Axis", "Fp8Recipe", "Fp8Tensor", "GemmPath", "Scaling",
           "amax_of", "block_ids", "gemm_path", "max_of", "quantize", "recipe_of", "reference_gemm",
           "requantize_t", "scaled_gemm"]
