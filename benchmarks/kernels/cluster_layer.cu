// Micro-benchmark, not part of the runtime: the decode layers of a batch-1 step run by ONE thread-block cluster
// (4, 8 or 16 multiprocessors) as one persistent kernel, against the runtime's chain of separate bulk GEMV kernels
// (kernels/gemv_bulk.cu, launched with programmatic dependent launch as the runtime does).
//
// Why: at batch 1 the runtime's layer is five dependent kernels, and each boundary costs a few microseconds of
// round trips (benchmarks/RESULTS.md: the SmolLM2-135M shape's layer moves 7 MB in ~17 µs, about 2 µs of traffic;
// the Qwen3-0.6B shape's 30 MB in ~26 µs). A grid-wide barrier in one kernel cost more than the kernel boundary it
// replaced (projection_chain.cu). A cluster's barrier is the hardware's, and its blocks can read each other's
// shared memory, so the all-to-all points of a layer (after QKV, O, the MLP's gate/up and down) cost a cluster
// barrier and a few distributed-shared-memory reads instead of a kernel boundary. The price: only the cluster's
// multiprocessors stream the weights. So the question is per shape: does one cluster's weight stream plus its
// barriers beat the chain of kernels? For a tiny model (7 MB a layer) it may; for 30 MB a layer the stream of 8-16
// multiprocessors may not keep up.
//
// The layer: QKV of rms_norm(h); a stand-in for the attention (its output is the q part of QKV, as in
// gemv_chain.cu); O adding into h; gate and up of rms_norm(h) with SiLU; down adding into h. Norm weights are
// ones. Each block owns a contiguous run of each projection's output rows; its weight rows stream through one
// ring of shared-memory stages by bulk copies (cp.async.bulk), in the order the block consumes them across all
// projections and layers, so the next projection's weights are in flight while the cluster meets at a barrier.
// After a projection each block publishes its output rows in its own shared memory; after the cluster barrier
// every block gathers the whole vector from its peers' shared memory (double-buffered, so one barrier a step).
//
// Result (H200, 2026-12-07, benchmarks/RESULTS.md): far slower. The chain took 11.6 µs a SmolLM2 layer and 17.6 µs a
// Qwen3 layer; the best cluster (16 blocks, 32 KB stages) took 64.9 and 136.4 µs, and 45.3 and 90.8 µs with the
// products left out, so neither the weight stream of 16 multiprocessors (0.16-0.35 TB/s here) nor the barrier and
// peer gathers come near a chain of kernels over the whole GPU. Kept as the record of that measurement.
//
// Built and run on the GPU machine:
//
//   nvcc -arch=sm_90 -DSTEPLLM_PDL -O3 -std=c++17 -I kernels -o /tmp/cluster_layer benchmarks/kernels/cluster_layer.cu
//   /tmp/cluster_layer
#include "gemv_bulk.cu"
#include "bench_harness.cuh"

#include <cooperative_groups.h>

#include <vector>

namespace cg = cooperative_groups;

#define CL_THREADS 256
#define CL_WARPS 8
#define CL_MAX_SLICE 1024  // most output rows of one projection a block owns
#define CL_MAX_K 3072      // widest projection input
#define CL_MAX_H 1024
#define CL_MAX_STAGES 16

enum { P_QKV, P_O, P_GATE, P_UP, P_DOWN, P_COUNT };

struct LayerWeights {
    const bf16 *qkv, *o, *gu, *down;  // gu: [gate | up], F rows each
};

struct Dims {
    int H, QKV, Q, F, L;
};

struct Proj {
    const bf16* w;
    int n, k;
};

__device__ __forceinline__ Proj proj_of(const LayerWeights* lw, const Dims& d, int l, int p) {
    const LayerWeights w = lw[l];
    switch (p) {
        case P_QKV: return {w.qkv, d.QKV, d.H};
        case P_O: return {w.o, d.H, d.Q};
        case P_GATE: return {w.gu, d.F, d.H};
        case P_UP: return {w.gu + (size_t)d.F * d.H, d.F, d.H};
        default: return {w.down, d.H, d.F};
    }
}

__device__ __forceinline__ int first_row(int n, int rank, int cs) { return (int)((long long)rank * n / cs); }

// One bulk copy of the sequence a block streams: chunk c of projection p of layer l.
struct Cursor {
    int l, p, c;
};

__device__ __forceinline__ int rows_per_stage(int k, int stage_bytes) { return max(1, stage_bytes / (k * 2)); }

__device__ __forceinline__ int chunks_of(const Proj& pr, int rank, int cs, int stage_bytes) {
    const int rows = first_row(pr.n, rank + 1, cs) - first_row(pr.n, rank, cs);
    const int rps = rows_per_stage(pr.k, stage_bytes);
    return (rows + rps - 1) / rps;
}

__device__ __forceinline__ void cursor_next(Cursor& cur, const LayerWeights* lw, const Dims& d, int rank, int cs,
                                            int stage_bytes) {
    if (++cur.c < chunks_of(proj_of(lw, d, cur.l, cur.p), rank, cs, stage_bytes)) return;
    cur.c = 0;
    if (++cur.p < P_COUNT) return;
    cur.p = 0;
    cur.l++;
}

// rms_norm(h) (weights of ones, the runtime's roundings) into xs.
__device__ void norm_into(const bf16* hs, bf16* xs, int H, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float v = __bfloat162float(hs[i]);
        ss += v * v;
    }
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < CL_WARPS; w++) total += red[w];
    const float inv = rsqrtf(total / H + 1e-6f);
    for (int i = threadIdx.x; i < H; i += blockDim.x) xs[i] = __float2bfloat16(__bfloat162float(hs[i]) * inv);
    __syncthreads();
}

extern __shared__ __align__(16) unsigned char cl_smem[];

// grid: one cluster of cs blocks; block CL_THREADS. Dynamic shared memory: the ring, `stages` stages of stage_bytes.
extern "C" __global__ void __launch_bounds__(CL_THREADS, 1)
    cluster_layers(const LayerWeights* lw, Dims d, const bf16* h_in, bf16* h_out, int stage_bytes, int stages,
                   int compute) {
#if __CUDA_ARCH__ >= 900
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = (int)cluster.block_rank(), cs = (int)cluster.num_blocks();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ __align__(16) bf16 xs[CL_MAX_K];
    __shared__ __align__(16) bf16 hs[CL_MAX_H];
    __shared__ float res[2][CL_MAX_SLICE];
    __shared__ __align__(16) bf16 outb[2][CL_MAX_SLICE];
    __shared__ unsigned long long full[CL_MAX_STAGES];
    __shared__ float red[CL_WARPS];
    unsigned char* ring = cl_smem;

    // Thread 0 is the producer: it walks the block's copy sequence, `stages` copies ahead of the consumers.
    Cursor prod = {0, 0, 0};
    int issued = 0;
    auto issue = [&]() {
        const Proj pr = proj_of(lw, d, prod.l, prod.p);
        const int r0 = first_row(pr.n, rank, cs), r1 = first_row(pr.n, rank + 1, cs);
        const int rps = rows_per_stage(pr.k, stage_bytes);
        const int row = r0 + prod.c * rps, rows = min(rps, r1 - row);
        const u32 bytes = (u32)rows * pr.k * 2;
        const int slot = issued % stages;
        mbar_expect_bytes(&full[slot], bytes);
        bulk_copy(ring + (size_t)slot * stage_bytes, pr.w + (size_t)row * pr.k, bytes, &full[slot]);
        issued++;
        cursor_next(prod, lw, d, rank, cs, stage_bytes);
    };
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; i++) mbar_init(&full[i], 1);
        fence_barrier_init();
        for (int i = 0; i < stages && prod.l < d.L; i++) issue();
    }
    for (int i = threadIdx.x; i < d.H; i += blockDim.x) hs[i] = h_in[i];
    __syncthreads();
    norm_into(hs, xs, d.H, red);

    int consumed = 0, buf = 0;
    for (int l = 0; l < d.L; l++) {
        for (int p = 0; p < P_COUNT; p++) {
            const Proj pr = proj_of(lw, d, l, p);
            const int r0 = first_row(pr.n, rank, cs), r1 = first_row(pr.n, rank + 1, cs);
            const int rps = rows_per_stage(pr.k, stage_bytes), chunks8 = pr.k / 8;
            float* out = res[p == P_UP ? 1 : 0];
            const uint4* xv = reinterpret_cast<const uint4*>(xs);
            for (int row = r0; row < r1; row += rps) {
                const int rows = min(rps, r1 - row), slot = consumed % stages;
                mbar_wait(&full[slot], (consumed / stages) & 1);
                if (compute) {
                    const uint4* st = reinterpret_cast<const uint4*>(ring + (size_t)slot * stage_bytes);
                    for (int r = warp; r < rows; r += CL_WARPS) {
                        float acc = 0.0f;
                        for (int c = lane; c < chunks8; c += 32) acc += dot8(st[r * chunks8 + c], xv[c]);
                        acc = warp_sum(acc);
                        if (lane == 0) out[row - r0 + r] = acc;
                    }
                }
                consumed++;
                __syncthreads();  // every warp is done with the stage
                if (threadIdx.x == 0 && prod.l < d.L) {
                    fence_async_shared();
                    issue();
                }
            }
            if (p == P_GATE) continue;  // its results wait for up's
            // This block's output rows, published in its own shared memory.
            bf16* mine = outb[buf];
            for (int i = threadIdx.x; i < r1 - r0; i += blockDim.x) {
                float v;
                if (p == P_QKV) {
                    v = res[0][i];
                } else if (p == P_UP) {
                    const float g = bf16r(res[0][i]), u = bf16r(res[1][i]);
                    v = g / (1.0f + __expf(-g)) * u;
                } else {
                    v = __bfloat162float(hs[r0 + i]) + res[0][i];
                }
                mine[i] = __float2bfloat16(v);
            }
            cluster.sync();
            // Gather the whole output from the peers: q into xs (the stand-in attention), h, or the activation.
            bf16* dst = p == P_QKV || p == P_UP ? xs : hs;
            const int limit = p == P_QKV ? d.Q : pr.n;
            for (int r = 0; r < cs; r++) {
                const bf16* peer = cluster.map_shared_rank(mine, r);
                const int a = first_row(pr.n, r, cs), b = min(first_row(pr.n, r + 1, cs), limit);
                for (int j = threadIdx.x; j < b - a; j += blockDim.x) dst[a + j] = peer[j];
            }
            __syncthreads();
            buf ^= 1;
            if (p == P_O || p == P_DOWN) norm_into(hs, xs, d.H, red);
        }
    }
    if (rank == 0)
        for (int i = threadIdx.x; i < d.H; i += blockDim.x) h_out[i] = hs[i];
    cluster.sync();  // no block leaves while a peer may still read its shared memory
#endif
}

// ---- host ----

static cudaStream_t stream;
static int sms;

void launch(const void* f, dim3 grid, dim3 block, size_t smem, void** args, bool pdl, int cluster = 0) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    int n = 0;
    if (pdl) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster) {
        attr[n].id = cudaLaunchAttributeClusterDimension;
        attr[n].val.clusterDim.x = cluster, attr[n].val.clusterDim.y = 1, attr[n++].val.clusterDim.z = 1;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    CK(cudaLaunchKernelExC(&cfg, f, args));
}

typedef void (*BulkFn)(const bf16*, const float*, float, const bf16*, const float*, bf16*, int, int, int, int);

// The runtime's bulk GEMV launch (gemv.rs bulk_stages: 48 KB stages, a 96 KB ring, one block per multiprocessor).
void bulk(BulkFn f, bool silu, const bf16* x, const float* norm, const bf16* w, bf16* y, int n, int k) {
    const int r = silu ? 2 : 1;
    const BulkRing ring = bulk_ring(r * k * 2, BULK_MAX_STAGES);
    int stage_rows = ring.stage_rows, stages = ring.stages;
    const size_t smem = (size_t)k * 2 + (norm ? (size_t)k * 4 : 0) + (size_t)stages * r * stage_rows * k * 2;
    CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    float eps = 1e-6f;
    const float* bias = nullptr;
    void* args[] = {&x, &norm, &eps, &w, &bias, &y, &n, &k, &stage_rows, &stages};
    launch((const void*)f, dim3(sms), dim3(BULK_THREADS), smem, args, true);
}

struct Shape {
    const char* name;
    Dims d;
};

void run_shape(const Shape& s) {
    const Dims d = s.d;
    const size_t per_layer = (size_t)d.QKV * d.H + (size_t)d.H * d.Q + 2 * (size_t)d.F * d.H + (size_t)d.H * d.F;
    std::vector<LayerWeights> host(d.L);
    for (int l = 0; l < d.L; l++) {
        bf16* w;
        CK(cudaMalloc(&w, per_layer * 2));
        fill_random<<<264, 256>>>(w, per_layer, 1000 + l, 0.1f);
        host[l].qkv = w;
        host[l].o = w + (size_t)d.QKV * d.H;
        host[l].gu = host[l].o + (size_t)d.H * d.Q;
        host[l].down = host[l].gu + 2 * (size_t)d.F * d.H;
    }
    LayerWeights* lw;
    CK(cudaMalloc(&lw, d.L * sizeof(LayerWeights)));
    CK(cudaMemcpy(lw, host.data(), d.L * sizeof(LayerWeights), cudaMemcpyHostToDevice));
    bf16 *h0, *h, *h_cluster, *qkv, *act;
    float* norm;
    CK(cudaMalloc(&h0, d.H * 2));
    CK(cudaMalloc(&h, d.H * 2));
    CK(cudaMalloc(&h_cluster, d.H * 2));
    CK(cudaMalloc(&qkv, d.QKV * 2));
    CK(cudaMalloc(&act, d.F * 2));
    CK(cudaMalloc(&norm, CL_MAX_K * 4));
    fill_random<<<4, 256>>>(h0, d.H, 7, 2.0f);
    fill_ones<<<1, 256>>>(norm, CL_MAX_K);
    CK(cudaDeviceSynchronize());
    const double mb = per_layer * 2 / 1e6;

    // The runtime's chain: QKV, then per layer the stand-in attention, O, gate/up, down and the next QKV.
    auto chain = [&] {
        bulk(gemv_bulk_norm_store_m1, false, h, norm, host[0].qkv, qkv, d.QKV, d.H);
        for (int l = 0; l < d.L; l++) {
            bf16* att = act;  // the attention output (Q wide) in the activation buffer, as O's input
            int q = d.Q;
            void* sargs[] = {&qkv, &att, &q};
            launch((const void*)standin_attention, dim3(8), dim3(256), 0, sargs, true);
            bulk(gemv_bulk_plain_add_m1, false, att, nullptr, host[l].o, h, d.H, d.Q);
            bulk(gemv_bulk_norm_silu_m1, true, h, norm, host[l].gu, act, 2 * d.F, d.H);
            bulk(gemv_bulk_plain_add_m1, false, act, nullptr, host[l].down, h, d.H, d.F);
            if (l + 1 < d.L) bulk(gemv_bulk_norm_store_m1, false, h, norm, host[l + 1].qkv, qkv, d.QKV, d.H);
        }
    };
    CK(cudaMemcpy(h, h0, d.H * 2, cudaMemcpyDeviceToDevice));
    chain();
    CK(cudaStreamSynchronize(stream));
    std::vector<bf16> ref(d.H);
    CK(cudaMemcpy(ref.data(), h, d.H * 2, cudaMemcpyDeviceToHost));
    const double chain_us = time_graph(stream, chain) / d.L;
    printf("%s: %d layers of %.2f MB; separate bulk kernels (stand-in attention + 4 GEMVs, PDL): %.2f us a layer "
           "(%.2f TB/s)\n",
           s.name, d.L, mb, chain_us, mb / chain_us);

    for (int cs : {4, 8, 16}) {
        const void* f = (const void*)cluster_layers;
        CK(cudaFuncSetAttribute(f, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        for (int stage_bytes : {16384, 32768}) {
            const int stages = 163840 / stage_bytes;
            const size_t smem = (size_t)stages * stage_bytes;
            CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(cs);
            cfg.blockDim = dim3(CL_THREADS);
            cfg.dynamicSmemBytes = smem;
            cudaLaunchAttribute attr;
            attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = cs, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            int clusters = 0;
            if (cudaOccupancyMaxActiveClusters(&clusters, f, &cfg) != cudaSuccess || clusters < 1) {
                cudaGetLastError();
                printf("%s: cluster of %d with %d KB stages: cannot be resident\n", s.name, cs, stage_bytes / 1024);
                continue;
            }
            for (int compute : {1, 0}) {
                auto one = [&] {
                    void* args[] = {&lw, (void*)&d, &h0, &h_cluster, &stage_bytes, (void*)&stages, &compute};
                    launch(f, dim3(cs), dim3(CL_THREADS), smem, args, false, cs);
                };
                one();
                CK(cudaStreamSynchronize(stream));
                if (compute) {
                    // Against the chain's h after the same layers (the roundings of the norm differ slightly).
                    const std::vector<bf16>& a = ref;
                    std::vector<bf16> b(d.H);
                    CK(cudaMemcpy(b.data(), h_cluster, d.H * 2, cudaMemcpyDeviceToHost));
                    float worst = 0, scale = 0;
                    for (int i = 0; i < d.H; i++) scale = fmaxf(scale, fabsf(__bfloat162float(a[i])));
                    for (int i = 0; i < d.H; i++)
                        worst = fmaxf(worst, fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i])) / scale);
                    printf("%s: cluster of %d agrees with the chain to %.2e of max |h| (%.3g)\n", s.name, cs, worst,
                           scale);
                }
                const double us = time_graph(stream, one) / d.L;
                printf("%s: one cluster of %d, %d stages of %d KB%s: %.2f us a layer (%.2f TB/s), %.0f%% of the chain\n",
                       s.name, cs, stages, stage_bytes / 1024, compute ? "" : ", weights streamed only (no products)",
                       us, mb / us, 100.0 * us / chain_us);
            }
        }
    }
    for (auto& l : host) CK(cudaFree((void*)l.qkv));
    CK(cudaFree(lw));
}

int main() {
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    sms = prop.multiProcessorCount;
    printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
    const Shape shapes[] = {{"smollm2", {576, 960, 576, 1536, 30}}, {"qwen3", {1024, 4096, 2048, 3072, 28}}};
    for (const auto& s : shapes) run_shape(s);
    return 0;
}
