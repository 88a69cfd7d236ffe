// Paged attention over an fp8 (e4m3) KV cache: paged_attention_fp8_d{D}_g{G} and its _rope variant, the same
// shapes as attention.cu. A module of its own so that models with a bf16 cache never load it.
#include "attention.cuh"

ATTENTION_SHAPES(paged_attention_fp8, fp8)
