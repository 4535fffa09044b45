"""How the model's GEMMs compute: the precision recipe every linear and expert layer calls (gemm.py), and the
FP8 recipes (fp8.py) with their quantisers (fp8_quant.py)."""
from megalite.precision.gemm import DEFAULT_RECIPE, RECIPES, GemmPrecision, build_gemm_precision

__all__ = ["DEFAULT_RECIPE", "RECIPES", "GemmPrecision", "build_gemm_precision"]
