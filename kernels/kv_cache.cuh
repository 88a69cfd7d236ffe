// The element types of the paged KV cache and their vectors of 8 or 16 values. bf16 is the default; fp8 (e4m3, selected by
// Config(kv_cache_dtype="fp8")) halves the bytes every decode step reads. fp8 values are stored unscaled,
// rounded to nearest and saturated at +-448 (vLLM's fp8 cache without calibrated scales does the same): K and V
// of these models are well inside that range, and what is lost is precision (3 mantissa bits), not range.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include "common.cuh"

typedef __nv_fp8_storage_t fp8;  // one e4m3 byte

// A decode step's read of past K/V, which no block of the launch writes (a block writes only its own row's newest
// position, which it never loads): through the non-coherent path, allocating nothing in L1, with L2 asked to
// fetch whole 128-byte lines. Against __ldcg, __ldg or either hint alone, the tensor-core decode attention read
// 2% faster on mixed rows and up to 10% on long split rows (benchmarks/kernels/decode_attention.cu, H100,
// benchmarks/RESULTS.md 2026-12-07). The asm declares no memory effects, so the compiler may move it as it moves
// __ldg: fine for data that stays constant while the kernel runs.
__device__ __forceinline__ uint4 kv_stream_load(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 kv_stream_load(const uint2* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.L2::128B.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// The 8 values of one vector as floats (exact for both: every bf16 and e4m3 value is an f32).
__device__ __forceinline__ void kv_unpack8(const uint4& raw, float out[8]) { unpack8(raw, out); }
__device__ __forceinline__ void kv_unpack8(const uint2& raw, float out[8]) {
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3);
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// VALS values of one position's head as one load: 16 bytes (8 bf16 or 16 fp8) or 8 bytes (8 fp8).
template <typename KV, int VALS>
struct KvLoad {
    static_assert(VALS * sizeof(KV) == 16 || VALS * sizeof(KV) == 8, "a load is 8 or 16 bytes");
    typedef typename std::conditional<VALS * sizeof(KV) == 16, uint4, uint2>::type type;
};

// Eight cache elements as one vector: 16 bytes of bf16, 8 bytes of fp8.
template <typename KV>
using KvVec8 = typename KvLoad<KV, 8>::type;

// The VALS values of one load as floats.
template <typename KV, int VALS>
__device__ __forceinline__ void kv_unpack(const typename KvLoad<KV, VALS>::type& raw, float (&out)[VALS]) {
    if constexpr (sizeof(KV) == 2 || VALS == 8) {
        kv_unpack8(raw, out);
    } else {
        const uint2* halves = reinterpret_cast<const uint2*>(&raw);
        kv_unpack8(halves[0], out);
        kv_unpack8(halves[1], out + 8);
    }
}

// One bf16 value as a cache element.
template <typename KV>
__device__ __forceinline__ KV kv_from_bf16(bf16 v);
template <>
__device__ __forceinline__ bf16 kv_from_bf16<bf16>(bf16 v) { return v; }
template <>
__device__ __forceinline__ fp8 kv_from_bf16<fp8>(bf16 v) {
    return __nv_cvt_float_to_fp8(__bfloat162float(v), __NV_SATFINITE, __NV_E4M3);
}

// Eight bf16 values (one 16-byte word) as one cache vector.
template <typename KV>
__device__ __forceinline__ KvVec8<KV> kv_pack8(const uint4& raw);
template <>
__device__ __forceinline__ uint4 kv_pack8<bf16>(const uint4& raw) { return raw; }
template <>
__device__ __forceinline__ uint2 kv_pack8<fp8>(const uint4& raw) {
    float f[8];
    unpack8(raw, f);
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 pair = __nv_cvt_float2_to_fp8x2(make_float2(f[2 * i], f[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
        w[i] = pair & 0xffffu;
    }
    return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// The mma operand type of a cache element type, and the products on it.
template <typename KV>
struct MmaOperand;

template <>
struct MmaOperand<bf16> {
    __device__ static __forceinline__ u32 pack(float lo, float hi) { return pack_bf16(lo, hi); }
    __device__ static __forceinline__ void mma(float c[4], const u32 a[4], u32 b0, u32 b1) { mma_bf16(c, a, b0, b1); }
    // Two bf16 values (a q pair) as operands.
    __device__ static __forceinline__ u32 from_bf16x2(u32 w) { return w; }
};

template <>
struct MmaOperand<fp8> {
    __device__ static __forceinline__ u32 pack(float lo, float hi) {
        const __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const u32*>(&h);
    }
    __device__ static __forceinline__ void mma(float c[4], const u32 a[4], u32 b0, u32 b1) { mma_f16(c, a, b0, b1); }
    // Two bf16 values as f16 (exact in f16 range).
    __device__ static __forceinline__ u32 from_bf16x2(u32 w) {
        return pack(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    }
    // The four e4m3 values of a word as two f16 pairs: bytes 0, 1 in `lo`, bytes 2, 3 in `hi`, the first of each in
    // its low half. On sm_89 and newer one conversion each, the high half read in place rather than after a shift.
    __device__ static __forceinline__ void pairs(u32 bytes, u32& lo, u32& hi) {
#if __CUDA_ARCH__ >= 890
        asm("{.reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;}"
            : "=r"(lo), "=r"(hi)
            : "r"(bytes));
#else
        const __half2_raw l = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(bytes & 0xffffu), __NV_E4M3);
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(bytes >> 16), __NV_E4M3);
        lo = (u32)l.x | ((u32)l.y << 16);
        hi = (u32)h.x | ((u32)h.y << 16);
#endif
    }
    // Eight e4m3 values as eight f16 (one 16-byte word), in order.
    __device__ static __forceinline__ uint4 widen8(const uint2& raw) {
        uint4 w;
        pairs(raw.x, w.x, w.y);
        pairs(raw.y, w.z, w.w);
        return w;
    }
};
