// Shared helpers for every kernel family: bf16 vectors of 8 (one 16-byte load), warp and block reductions.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;

// Programmatic dependent launch (sm_90+, the PTX built with -DSTEPLLM_PDL): the host launches each kernel so it
// may start while the previous one is still running. `pdl_wait` blocks until that kernel has finished and its
// writes are visible, so every kernel calls it, unconditionally, before it touches anything another kernel writes
// or reads. `pdl_launch_dependents` lets the next kernel start its prologue; kernels call it right after the
// wait, except the register GEMV (kernels/gemv.cu) and the bulk GEMVs that add into the residual
// (kernels/gemv_bulk.cu), which call it first (measured faster there). Either way
// kernels run in order: a kernel's wait returns only once its predecessor is complete, and that one's wait had
// returned before. Two things may be read before the wait: constant weights, and the batch metadata (tokens,
// positions, slots, block tables). The metadata is copied in by a plain (not programmatic) dependency before the
// forward's first kernel, and a kernel can only start after its predecessor has started, so by induction the
// copy is complete. Without PDL, or in the compute_80 PTX, both calls are no-ops.
#ifdef STEPLLM_PDL
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#else
__device__ __forceinline__ void pdl_wait() {}
__device__ __forceinline__ void pdl_launch_dependents() {}
#endif

// Marks on a block's way through a decode kernel, for the benchmarks built with STEPLLM_TIMELINE
// (benchmarks/kernels/layer_timeline.cu, decode_attention.cu), whose bench_harness.cuh defines timeline_mark
// (thread 0 stamps the global timer). Elsewhere they compile to nothing.
enum TimelinePoint { TL_START, TL_WAITED, TL_INPUT, TL_READY, TL_END, TL_POINTS };
#ifdef STEPLLM_TIMELINE
__device__ void timeline_mark(int point);
#define TIMELINE(point) timeline_mark(point)
#else
#define TIMELINE(point) ((void)0)
#endif

// The start of every kernel that reads nothing before the previous kernel is done.
__device__ __forceinline__ void kernel_begin() {
    pdl_wait();
    pdl_launch_dependents();
}

// The split-K hand-over, called by every thread of a block once it has stored its partial results: whether this
// block drew the last of `splits` tickets of `counter`, in which case every other split's stores are visible to
// it. The barrier orders the block's stores before thread 0's ticket, whose release publishes them and whose
// acquire (for the last block) makes the others' visible; the barrier after it hands that on to the block's threads
// (the PTX memory model's causality order is cumulative). One acq_rel atomic costs less than a sequentially
// consistent __threadfence() on either side of a relaxed one (benchmarks/RESULTS.md, 2026-12-07 14:57 UTC).
__device__ __forceinline__ bool last_split_ticket(u32* counter, int splits) {
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 ticket;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(ticket) : "l"(counter) : "memory");
        is_last = ticket == (u32)splits - 1;
    }
    __syncthreads();
    return is_last;
}

// Unsigned division by a runtime constant (block_size) in three instructions: valid for n < 2^31.
struct FastDiv {
    u32 magic, shift;
    __device__ __forceinline__ explicit FastDiv(u32 d) {
        shift = d <= 1 ? 0u : 32u - __clz(d - 1);  // smallest s with 2^s >= d
        // A power of two (the usual block size) needs no 64-bit division: magic = 1, n >> shift.
        magic = (d & (d - 1)) == 0 ? 1u : (u32)(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
    }
    __device__ __forceinline__ u32 div(u32 n) const { return (__umulhi(n, magic) + n) >> shift; }
};

// A shared-memory pointer as the 32-bit address PTX instructions on shared memory take.
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Fragment layouts of one warp's m16n8k16 operands (PTX ISA, "Matrix fragments for mma.m16n8k16"): see
// kernels/prefill_attention.cu. c += a * b for one tile, f32 accumulation, bf16 or f16 operands.
__device__ __forceinline__ void mma_bf16(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Round through bf16: used where transformers rounds an intermediate to bf16, so our outputs match it.
__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16(x)); }

// The 8 bf16 of one 16-byte word as floats (exact: a bf16 is the top half of an f32).
__device__ __forceinline__ void unpack8(const uint4& raw, float out[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// 8 consecutive bf16 (16 bytes, must be 16-byte aligned) as floats.
__device__ __forceinline__ void load8(const bf16* p, float out[8]) {
    unpack8(__ldg(reinterpret_cast<const uint4*>(p)), out);
}

// Same, but through L2 only: for data another block of this launch may have written.
__device__ __forceinline__ void load8_cg(const bf16* p, float out[8]) {
    unpack8(__ldcg(reinterpret_cast<const uint4*>(p)), out);
}

// Larger float -> larger key, as unsigned integers; NaN maps to 0 (below everything). Sampling bisects over
// these keys, and the greedy argmax packs them above the token id.
__device__ __forceinline__ u32 order_key(float x) {
    if (isnan(x)) return 0u;
    const u32 b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Two floats as one bf16x2 word (round to nearest), `lo` in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

// Attention scales its scores by log2(e) (folded into q or the score scale) so that fast_exp2 exponentiates them.
constexpr float LOG2_E = 1.4426950408889634f;

// 2^x, flushing denormals; 2^-inf = 0. Attention keeps its scores in the log2 domain (log2(e) folded into q).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void store8(bf16* p, const float v[8]) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block, returned to every thread. `scratch` holds 32 floats; blockDim.x is a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // the previous use of scratch is finished
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? scratch[lane] : 0.0f);
}

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = lane < warps ? scratch[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? scratch[lane] : -INFINITY);
}

__device__ __forceinline__ unsigned long long block_max_u64(unsigned long long v, unsigned long long* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();  // the previous use of scratch is finished
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    unsigned long long t = lane < warps ? scratch[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = max(t, __shfl_xor_sync(0xffffffffu, t, o));
    return t;
}

__device__ __forceinline__ u32 block_sum_u32(u32 v, u32* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    u32 t = lane < warps ? scratch[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}
