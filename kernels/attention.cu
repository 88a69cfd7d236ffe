// Paged attention over a bf16 KV cache: paged_attention_d{D}_g{G} and paged_attention_rope_d{D}_g{G} for every
// supported head_dim D and query heads per KV head G (the kernel is kernels/attention.cuh).
#include "attention.cuh"

ATTENTION_SHAPES(paged_attention, bf16)
