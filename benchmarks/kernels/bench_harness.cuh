// What the micro-benchmarks here share (gemv_chain.cu, cluster_layer.cu, decode_attention.cu, layer_timeline.cu,
// read_bandwidth.cu): error checks, random weights, the stand-in for the attention between a layer's QKV and O,
// launches as the runtime makes them (programmatic dependent launch, the bulk GEMV's ring, the decode attention's
// splits), output fingerprints, and timing a recorded CUDA graph.
#pragma once
#include "common.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(call)                                                                         \
    do {                                                                                 \
        cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess) {                                                         \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

#ifdef STEPLLM_TIMELINE
// The TIMELINE marks' recorder (layer_timeline.cu, decode_attention.cu): thread 0 of a block takes a ticket at its
// first mark and stamps the global timer (ns) into tl_records[ticket][point]; off while tl_records is null.
constexpr int TL_MAX_BLOCKS = 1 << 16;
__constant__ unsigned long long* tl_records;
__device__ unsigned tl_next_ticket;

__device__ void timeline_mark(int point) {
    __shared__ unsigned ticket;
    if (threadIdx.x != 0 || tl_records == nullptr) return;
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (point == TL_START) ticket = atomicAdd(&tl_next_ticket, 1u);
    if (ticket < TL_MAX_BLOCKS) tl_records[(size_t)ticket * TL_POINTS + point] = now;
}

// One run of `launch` (on `stream`) with the marks recording into `records` (tl_records must point there), its
// stamps copied into `host`: host.size() / TL_POINTS blocks in ticket order, 0 where a block made no mark.
template <typename Launch>
inline void record_marks(unsigned long long* records, cudaStream_t stream, Launch launch,
                         std::vector<unsigned long long>& host) {
    const unsigned zero = 0;
    CK(cudaMemcpyToSymbol(tl_next_ticket, &zero, 4));
    CK(cudaMemset(records, 0, host.size() * 8));
    launch();
    CK(cudaStreamSynchronize(stream));
    CK(cudaMemcpy(host.data(), records, host.size() * 8, cudaMemcpyDeviceToHost));
}
#endif

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

// A launch as the runtime makes it: with programmatic dependent launch unless `pdl` is false.
inline void launch_pdl(cudaStream_t stream, const void* f, dim3 grid, dim3 block, size_t smem, void** args,
                       bool pdl = true) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr, cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelExC(&cfg, f, args));
}

// A bulk GEMV's ring as gemv.rs bulk_stages picks it: whole weight rows (`row_bytes` each, both rows of a
// SiLU column) a stage, a multiple of the block's 8 warps when that many fit in `stage_bytes`, and as many stages
// as `ring_bytes` holds within [2, max_stages]. `fit_cols` > 0 (an experiment, not the runtime's choice): no
// more rows or stages than a block's fit_cols columns fill.
struct BulkRing {
    int stage_rows, stages;
};
inline BulkRing bulk_ring(int row_bytes, int max_stages, int stage_bytes = 48 << 10, int ring_bytes = 96 << 10,
                          int fit_cols = 0) {
    int rows = stage_bytes / row_bytes;
    rows = rows >= 8 ? rows - rows % 8 : std::max(rows, 1);
    int stages = std::min(std::max(ring_bytes / (rows * row_bytes), 2), max_stages);
    if (fit_cols > 0) {
        rows = std::min(rows, fit_cols);
        stages = std::min(stages, (fit_cols + rows - 1) / rows);
    }
    return {rows, stages};
}

// The decode attention's key splits for `rows` decode rows (backend.rs attention_splits): enough for about two
// blocks a multiprocessor, at most max_splits, and none shorter than 16 positions.
inline int decode_attention_splits(int rows, int kv_heads, int max_context, int sms, int max_splits) {
    const int wanted = 2 * sms / std::max(rows * kv_heads, 1);
    return std::max(1, std::min({wanted, max_splits, (max_context + 15) / 16}));
}

// A fingerprint (FNV-1a) of bf16 output bits: a change that keeps a kernel's arithmetic must keep it.
inline unsigned long long fingerprint(const std::vector<bf16>& out) {
    unsigned long long print = 1469598103934665603ull;
    for (bf16 x : out) print = (print ^ __bfloat16_as_ushort(x)) * 1099511628211ull;
    return print;
}
