// What the layer-chain micro-benchmarks here share (gemv_chain.cu, cluster_layer.cu): error checks, random
// weights, the stand-in for the attention between a layer's QKV and O, and timing a recorded CUDA graph.
#pragma once
#include "common.cuh"

#include <cstdio>
#include <cstdlib>

#define CK(call)                                                                         \
    do {                                                                                 \
        cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

// A reproducible pseudo-random word for element i of a fill.
__device__ __forceinline__ u32 bench_hash(size_t i, u32 seed) {
    u32 h = (u32)i * 2654435761u ^ seed;
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    return h;
}

// Reproducible values uniform in [-scale / 2, scale / 2).
__global__ void fill_random(bf16* p, size_t n, u32 seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(((bench_hash(i, seed) & 0xffff) / 65536.0f - 0.5f) * scale);
}

__global__ void fill_ones(float* p, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = 1.0f;
}

// Stands in for the attention between a layer's QKV and O: a small kernel that reads qkv and writes the O input.
extern "C" __global__ void standin_attention(const bf16* qkv, bf16* att, int n) {
    kernel_begin();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) att[i] = qkv[i];
}

// µs per replay of what `record` launches on `stream`, captured as one graph (20 warm-up replays, then `reps`).
template <typename Record>
double time_graph(cudaStream_t stream, Record record, int reps = 200) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
    record();
    CK(cudaStreamEndCapture(stream, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 20; i++) CK(cudaGraphLaunch(exec, stream));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a, stream));
    for (int i = 0; i < reps; i++) CK(cudaGraphLaunch(exec, stream));
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    return ms * 1e3 / reps;
}
