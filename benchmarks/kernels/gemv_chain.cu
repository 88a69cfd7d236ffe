// Micro-benchmark of the decode GEMV chain at batch 1, outside the runtime: the four projections of a
// Qwen3-0.6B layer (QKV with its norm, O adding into the residual, gate/up with norm and SiLU, down adding into
// the residual) for 28 layers with distinct weights (840 MB, so nothing is served from L2), captured in one
// CUDA graph and launched the way the runtime launches them (programmatic dependent launch). It compares the
// two GEMV families, kernels/gemv.cu (weights through registers, one-wave grids, capped at 1..4 blocks per
// multiprocessor) and kernels/gemv_bulk.cu (weights bulk-copied into shared memory; stage and ring sizes
// varied): µs per layer and per kernel against the bandwidth floor, and whether the two agree on each
// projection's output at batch 1 and 4. Also the floor of a chain of kernels that do nothing, and the
// projection-chain experiment (projection_chain.cu here: a layer's O, gate/up, down and the next QKV as one
// kernel with grid barriers, against the four bulk kernels, both behind a stand-in for the attention). With
// the argument `mlp`, only the MLP as one kernel (mlp_fused.cu here) against its two bulk GEMVs: agreement,
// determinism, and µs per layer. With `l2`, the L2 experiment (l2_section below). Built and run on the GPU
// machine:
//
//   nvcc -arch=sm_90 -DSTEPLLM_PDL -O3 -std=c++17 -I kernels -o /tmp/gemv_chain benchmarks/kernels/gemv_chain.cu
//   /tmp/gemv_chain [mlp | l2]
#include "gemv.cu"
#include "gemv_bulk.cu"
#include "projection_chain.cu"
#include "mlp_fused.cu"
#include "bench_harness.cuh"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

typedef void (*GemvFn)(const bf16*, const float*, float, const bf16*, const float*, bf16*, int, int, int);

extern "C" __global__ void nothing() { kernel_begin(); }

struct Gpu {
    int sms;
    bool pdl;
    int cap;           // most register-GEMV blocks per multiprocessor in a grid
    bool bulk;         // the bulk-copy family instead
    int stage_bytes;   // its stage size target
    int ring_bytes;    // and ring size
    bool fit;          // the ring no larger than the block's rows need (measured no faster; not in the runtime)
    cudaStream_t stream;
};

void launch(const Gpu& g, const void* f, dim3 grid, dim3 block, size_t smem, void** args) {
    launch_pdl(g.stream, f, grid, block, smem, args, g.pdl);
}

typedef void (*BulkFn)(const bf16*, const float*, float, const bf16*, const float*, bf16*, int, int, int, int);

// One projection kind in both families, batch rows 1 and 4.
struct Kind {
    GemvFn reg1, reg4;
    BulkFn bulk1, bulk4;
    bool silu;
};
const Kind NORM_STORE = {gemv_norm_store_m1, gemv_norm_store_m4, gemv_bulk_norm_store_m1, gemv_bulk_norm_store_m4, false};
const Kind PLAIN_ADD = {gemv_plain_add_m1, gemv_plain_add_m4, gemv_bulk_plain_add_m1, gemv_bulk_plain_add_m4, false};
const Kind NORM_SILU = {gemv_norm_silu_m1, gemv_norm_silu_m4, gemv_bulk_norm_silu_m1, gemv_bulk_norm_silu_m4, true};

// The runtime's choice for the register family (backend.rs gemv_split and launch_gemv).
void gemv_reg(const Gpu& g, GemvFn f, bool silu, int m, const bf16* x, const float* norm, const bf16* w, bf16* y, int n, int k) {
    const int cols = silu ? n / 2 : n, chunks = k / 8, target = 16 * g.sms;
    int wpr = 1;
    while (wpr < GEMV_WARPS && cols * wpr < target && chunks >= 64 * (2 * wpr)) wpr *= 2;
    const int groups = (cols + GEMV_WARPS / wpr - 1) / (GEMV_WARPS / wpr);
    int per_sm = 0;
    const size_t smem = (size_t)m * k * 2;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, (const void*)f, GEMV_THREADS, smem));
    if (per_sm > g.cap) per_sm = g.cap;
    const int resident = per_sm * g.sms;
    const int grid = (groups + (groups + resident - 1) / resident - 1) / ((groups + resident - 1) / resident);
    float eps = 1e-6f;
    const float* bias = nullptr;
    void* args[] = {&x, &norm, &eps, &w, &bias, &y, &n, &k, &wpr};
    launch(g, (const void*)f, dim3(grid), dim3(GEMV_THREADS), smem, args);
}

void gemv_bulk_launch(const Gpu& g, BulkFn f, bool silu, int m, const bf16* x, const float* norm, const bf16* w, bf16* y,
                      int n, int k) {
    const int r = silu ? 2 : 1;
    const BulkRing ring = bulk_ring(r * k * 2, BULK_MAX_STAGES, g.stage_bytes, g.ring_bytes,
                                    g.fit ? (n / r + g.sms - 1) / g.sms : 0);
    int stage_rows = ring.stage_rows, stages = ring.stages;
    const int stage = r * stage_rows * k * 2;
    // The IN_NORM kinds stage the norm weights beside the input rows.
    const size_t smem = (size_t)m * k * 2 + (norm ? (size_t)k * 4 : 0) + (size_t)stages * stage;
    CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    float eps = 1e-6f;
    const float* bias = nullptr;
    void* args[] = {&x, &norm, &eps, &w, &bias, &y, &n, &k, &stage_rows, &stages};
    launch(g, (const void*)f, dim3(g.sms), dim3(BULK_THREADS), smem, args);
}

void gemv(const Gpu& g, const Kind& kind, int m, const bf16* x, const float* norm, const bf16* w, bf16* y, int n, int k) {
    if (g.bulk)
        gemv_bulk_launch(g, m == 1 ? kind.bulk1 : kind.bulk4, kind.silu, m, x, norm, w, y, n, k);
    else
        gemv_reg(g, m == 1 ? kind.reg1 : kind.reg4, kind.silu, m, x, norm, w, y, n, k);
}

// One phase of the projection chain: as many whole output columns as fit a slot (a multiple of 8 when 8 fit).
ChainPhase chain_phase(const Gpu& g, const bf16* x, const float* norm, const bf16* w, bf16* y, int n, int k, int in,
                       int out, int slot_bytes) {
    const int r = out == OUT_SILU ? 2 : 1, cols = n / r, block_cols = (cols + g.sms - 1) / g.sms;
    int stage_cols = slot_bytes / (r * k * 2);
    if (stage_cols >= 8) stage_cols -= stage_cols % 8;
    if (stage_cols > block_cols) stage_cols = block_cols;
    return ChainPhase{x, norm, w, nullptr, y, n, k, in, out, stage_cols};
}

void chain_launch(const Gpu& g, int m, Chain c) {
    int widest = 0;
    for (int p = 0; p < c.phases; p++) widest = widest > c.phase[p].k ? widest : c.phase[p].k;
    const size_t smem = ((size_t)m * widest * 2 + 15) / 16 * 16 + (size_t)c.slots * c.slot_bytes;
    const void* f = m == 1 ? (const void*)projection_chain_m1 : (const void*)projection_chain_m4;
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    void* args[] = {&c};
    launch(g, f, dim3(g.sms), dim3(BULK_THREADS), smem, args);
}

// bench_harness.cuh's stand-in attention, releasing the next kernel before it waits, so O's weights load while
// QKV still runs (tried in the decode attention too: the runtime got slower, benchmarks/RESULTS.md).
extern "C" __global__ void standin_attention_releasing_first(const bf16* qkv, bf16* att, int n) {
    pdl_launch_dependents();
    pdl_wait();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) att[i] = qkv[i];
}

struct Layer {
    bf16 *qkv, *o, *gu, *down;
};

const int HIDDEN = 1024, QKV = 4096, Q = 2048, FF = 3072, LAYERS = 28;

void mlp_section(Gpu& g, std::vector<Layer>& layers, bf16* h, float* norm);
void l2_section(Gpu& g, std::vector<Layer>& layers, bf16* h, float* norm);

int main(int argc, char** argv) {
    Gpu g = {};
    CK(cudaDeviceGetAttribute(&g.sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking));
    std::vector<Layer> layers(LAYERS);
    for (auto& l : layers) {
        CK(cudaMalloc(&l.qkv, (size_t)QKV * HIDDEN * 2));
        CK(cudaMalloc(&l.o, (size_t)HIDDEN * Q * 2));
        CK(cudaMalloc(&l.gu, (size_t)2 * FF * HIDDEN * 2));
        CK(cudaMalloc(&l.down, (size_t)HIDDEN * FF * 2));
        fill_random<<<1024, 256>>>(l.qkv, (size_t)QKV * HIDDEN, 1, 0.05f);
        fill_random<<<1024, 256>>>(l.o, (size_t)HIDDEN * Q, 2, 0.05f);
        fill_random<<<1024, 256>>>(l.gu, (size_t)2 * FF * HIDDEN, 3, 0.05f);
        fill_random<<<1024, 256>>>(l.down, (size_t)HIDDEN * FF, 4, 0.05f);
    }
    bf16 *h, *qkv, *act;
    float* norm;
    CK(cudaMalloc(&h, HIDDEN * 2));
    CK(cudaMalloc(&qkv, QKV * 2));
    CK(cudaMalloc(&act, FF * 2));
    CK(cudaMalloc(&norm, FF * 4));
    fill_random<<<4, 256>>>(h, HIDDEN, 5, 1.0f);
    fill_ones<<<1, 256>>>(norm, FF);
    CK(cudaDeviceSynchronize());

    if (argc > 1 && std::string(argv[1]) == "mlp") {
        mlp_section(g, layers, h, norm);
        return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "l2") {
        l2_section(g, layers, h, norm);
        return 0;
    }
    const double bytes_layer = 2.0 * ((double)QKV * HIDDEN + (double)HIDDEN * Q + 2.0 * FF * HIDDEN + (double)HIDDEN * FF);
    printf("GPU: %d SMs; one layer's weights %.1f MB, %.2f us at 4.8 TB/s\n", g.sms, bytes_layer / 1e6, bytes_layer / 4.8e6);

    // Agreement: each projection kind at batch 1 and 4, both families, same inputs (bf16 outputs compared).
    {
        bf16 *xin, *out_a, *out_b;
        const size_t most = 4 * (size_t)2 * FF;
        CK(cudaMalloc(&xin, 4 * FF * 2));
        CK(cudaMalloc(&out_a, most * 2));
        CK(cudaMalloc(&out_b, most * 2));
        fill_random<<<16, 256>>>(xin, 4 * FF, 9, 2.0f);
        struct Case { const char* name; const Kind* kind; const bf16* w; int n, k; };
        const Case cases[] = {{"qkv", &NORM_STORE, layers[0].qkv, QKV, HIDDEN}, {"o", &PLAIN_ADD, layers[0].o, HIDDEN, Q},
                              {"gate/up", &NORM_SILU, layers[0].gu, 2 * FF, HIDDEN}, {"down", &PLAIN_ADD, layers[0].down, HIDDEN, FF}};
        for (const Case& c : cases) {
            for (int m : {1, 4}) {
                const int out_n = c.kind->silu ? c.n / 2 : c.n;
                std::vector<bf16> a(m * out_n), b(m * out_n);
                g.pdl = false, g.cap = 4, g.stage_bytes = 49152, g.ring_bytes = 98304, g.fit = false;
                for (int fam = 0; fam < 2; fam++) {
                    bf16* out = fam ? out_b : out_a;
                    fill_random<<<16, 256>>>(out, m * out_n, 11, 1.0f);  // OUT_ADD adds into it
                    g.bulk = fam;
                    gemv(g, *c.kind, m, xin, norm, c.w, out, c.n, c.k);
                    CK(cudaStreamSynchronize(g.stream));
                    CK(cudaMemcpy((fam ? b : a).data(), out, m * out_n * 2, cudaMemcpyDeviceToHost));
                }
                int differ = 0;
                float worst = 0;
                for (int i = 0; i < m * out_n; i++) {
                    const float va = __bfloat162float(a[i]), vb = __bfloat162float(b[i]);
                    const float d = fabsf(va - vb) / fmaxf(1e-3f, fabsf(va));
                    differ += va != vb;
                    worst = fmaxf(worst, d);
                }
                printf("agreement %s m%d: %d of %d outputs differ, worst relative difference %.2e\n", c.name, m, differ,
                       m * out_n, worst);
            }
        }
    }

    // The projection chain (projection_chain.cu here): a layer as the runtime runs it at decode, attention
    // (a stand-in kernel) then O, gate/up, down and the next layer's QKV, either as four bulk GEMV kernels or as
    // one chain kernel; batch rows 1 and 4. First whether the chain's outputs equal the separate kernels'.
    {
        unsigned long long* arrivals;
        bf16 *h4, *h_ref, *qkv4, *qkv_ref, *att4, *act4;
        CK(cudaMalloc(&arrivals, 8));
        CK(cudaMemset(arrivals, 0, 8));
        CK(cudaMalloc(&h4, 4 * HIDDEN * 2));
        CK(cudaMalloc(&h_ref, 4 * HIDDEN * 2));
        CK(cudaMalloc(&qkv4, 4 * QKV * 2));
        CK(cudaMalloc(&qkv_ref, 4 * QKV * 2));
        CK(cudaMalloc(&att4, 4 * Q * 2));
        CK(cudaMalloc(&act4, 4 * FF * 2));
        g.bulk = true, g.fit = false, g.stage_bytes = 49152, g.ring_bytes = 98304, g.cap = 4;
        auto chain_of = [&](int m, int l, int slot_bytes, int slots, bf16* h_, bf16* qkv_) {
            Chain c = {};
            c.phase[0] = chain_phase(g, att4, nullptr, layers[l].o, h_, HIDDEN, Q, IN_PLAIN, OUT_ADD, slot_bytes);
            c.phase[1] = chain_phase(g, h_, norm, layers[l].gu, act4, 2 * FF, HIDDEN, IN_NORM, OUT_SILU, slot_bytes);
            c.phase[2] = chain_phase(g, act4, nullptr, layers[l].down, h_, HIDDEN, FF, IN_PLAIN, OUT_ADD, slot_bytes);
            c.phase[3] = chain_phase(g, h_, norm, layers[(l + 1) % LAYERS].qkv, qkv_, QKV, HIDDEN, IN_NORM, OUT_STORE, slot_bytes);
            c.phases = 4, c.eps = 1e-6f, c.arrivals = arrivals, c.slot_bytes = slot_bytes, c.slots = slots;
            return c;
        };
        auto separate_tail = [&](int m, int l, bf16* h_, bf16* qkv_) {
            gemv(g, PLAIN_ADD, m, att4, nullptr, layers[l].o, h_, HIDDEN, Q);
            gemv(g, NORM_SILU, m, h_, norm, layers[l].gu, act4, 2 * FF, HIDDEN);
            gemv(g, PLAIN_ADD, m, act4, nullptr, layers[l].down, h_, HIDDEN, FF);
            gemv(g, NORM_STORE, m, h_, norm, layers[(l + 1) % LAYERS].qkv, qkv_, QKV, HIDDEN);
        };
        for (int m : {1, 4}) {
            g.pdl = false;
            fill_random<<<16, 256>>>(att4, 4 * Q, 21, 2.0f);
            fill_random<<<16, 256>>>(h4, 4 * HIDDEN, 22, 2.0f);
            CK(cudaMemcpy(h_ref, h4, 4 * HIDDEN * 2, cudaMemcpyDeviceToDevice));
            separate_tail(m, 0, h_ref, qkv_ref);
            chain_launch(g, m, chain_of(m, 0, 49152, 4, h4, qkv4));
            CK(cudaDeviceSynchronize());
            std::vector<bf16> a(m * QKV), b(m * QKV), ha(m * HIDDEN), hb(m * HIDDEN);
            CK(cudaMemcpy(a.data(), qkv_ref, m * QKV * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(b.data(), qkv4, m * QKV * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(ha.data(), h_ref, m * HIDDEN * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(hb.data(), h4, m * HIDDEN * 2, cudaMemcpyDeviceToHost));
            int differ = 0;
            for (int i = 0; i < m * QKV; i++) differ += __bfloat162float(a[i]) != __bfloat162float(b[i]);
            for (int i = 0; i < m * HIDDEN; i++) differ += __bfloat162float(ha[i]) != __bfloat162float(hb[i]);
            printf("agreement chain m%d: %d of %d outputs (qkv and residual) differ from the separate kernels\n", m, differ,
                   m * (QKV + HIDDEN));
        }
        g.pdl = true;
        int q_width = Q;
        void* standin_args[] = {&qkv4, &att4, &q_width};
        // µs per layer of 28: the first QKV, then per layer the stand-in attention and the rest of the layer.
        auto per_layer = [&](int m, const void* standin, auto rest_of_layer) {
            return time_graph(g.stream, [&] {
                       gemv(g, NORM_STORE, m, h4, norm, layers[0].qkv, qkv4, QKV, HIDDEN);
                       for (int l = 0; l < LAYERS; l++) {
                           launch(g, standin, dim3(8), dim3(256), 0, standin_args);
                           rest_of_layer(l);
                       }
                   }) /
                   LAYERS;
        };
        for (int m : {1, 4}) {
            auto separate = [&](int l) { separate_tail(m, l, h4, qkv4); };
            printf("m%d separate bulk kernels (attention stand-in + 4 GEMVs): layer %.2f us\n", m,
                   per_layer(m, (const void*)standin_attention, separate));
            for (int fit : {0, 1}) {
                g.fit = fit;
                printf("m%d separate bulk kernels, the stand-in releasing O before its wait%s: layer %.2f us\n", m,
                       fit ? ", rings fitted to the block" : "",
                       per_layer(m, (const void*)standin_attention_releasing_first, separate));
            }
            g.fit = false;
            for (auto ring : {std::pair{49152, 4}, std::pair{40960, 5}, std::pair{32768, 6}, std::pair{24576, 8},
                              std::pair{65536, 3}, std::pair{32768, 4}}) {
                const int slot = ring.first, slots = ring.second;
                const double chained = per_layer(m, (const void*)standin_attention, [&](int l) {
                    chain_launch(g, m, chain_of(m, l, slot, slots, h4, qkv4));
                });
                printf("m%d chain, %d slots of %d KB: layer %.2f us\n", m, slots, slot / 1024, chained);
            }
        }
    }

    auto measure = [&](const char* label) {
        const double layer = time_graph(g.stream, [&] {
            for (auto& l : layers) {
                gemv(g, NORM_STORE, 1, h, norm, l.qkv, qkv, QKV, HIDDEN);
                gemv(g, PLAIN_ADD, 1, qkv, nullptr, l.o, h, HIDDEN, Q);
                gemv(g, NORM_SILU, 1, h, norm, l.gu, act, 2 * FF, HIDDEN);
                gemv(g, PLAIN_ADD, 1, act, nullptr, l.down, h, HIDDEN, FF);
            }
        }) / LAYERS;
        printf("%s pdl %d: layer %.2f us (%.0f%% of 4.8 TB/s)", label, g.pdl, layer, 100.0 * bytes_layer / 4.8e6 / layer);
        // Each projection alone, 28 times in a row (distinct weights).
        struct One { const char* name; const Kind* kind; const bf16* x; bf16* y; int n, k; };
        const One ones[] = {{"qkv", &NORM_STORE, h, qkv, QKV, HIDDEN},
                            {"o", &PLAIN_ADD, qkv, h, HIDDEN, Q},
                            {"gate/up", &NORM_SILU, h, act, 2 * FF, HIDDEN},
                            {"down", &PLAIN_ADD, act, h, HIDDEN, FF}};
        for (const One& o : ones) {
            const double us = time_graph(g.stream, [&] {
                for (auto& l : layers) {
                    const bf16* w = o.n == QKV ? l.qkv : o.n == HIDDEN && o.k == Q ? l.o : o.kind->silu ? l.gu : l.down;
                    gemv(g, *o.kind, 1, o.x, o.kind == &PLAIN_ADD ? nullptr : norm, w, o.y, o.n, o.k);
                }
            }) / LAYERS;
            printf("  %s %.2f (%.2f MB)", o.name, us, 2.0 * o.n * o.k / 1e6);
        }
        printf("\n");
    };
    for (int pdl = 1; pdl >= 0; pdl--) {
        g.pdl = pdl;
        g.bulk = false;
        for (int cap : {4, 2}) {
            g.cap = cap;
            char label[64];
            snprintf(label, sizeof label, "registers, cap %d blocks/SM,", cap);
            measure(label);
        }
        g.bulk = true;
        for (int fit : {0, 1}) {
            for (auto [stage, ring] : {std::pair{49152, 98304}, std::pair{32768, 65536}}) {
                g.stage_bytes = stage, g.ring_bytes = ring, g.fit = fit;
                char label[96];
                snprintf(label, sizeof label, "bulk, stage %d KB, ring %d KB%s,", stage / 1024, ring / 1024,
                         fit ? " (fit to the block)" : "");
                measure(label);
            }
        }
        for (int blocks : {1, g.sms, 4 * g.sms}) {
            const double us = time_graph(g.stream, [&] {
                for (int i = 0; i < 4 * LAYERS; i++) launch(g, (const void*)nothing, dim3(blocks), dim3(256), 0, nullptr);
            }) / (4 * LAYERS);
            printf("pdl %d: empty kernel of %d blocks: %.2f us each\n", pdl, blocks, us);
        }
    }
    return 0;
}

// The MLP as one kernel (mlp_fused.cu here) against gate/up and down as two bulk GEMVs, at batch 1.
void mlp_launch(const Gpu& g, bf16* h, const float* norm, const bf16* gu, const bf16* down, MlpAccumulator acc) {
    const int groups = FF / 8, grid = g.sms < groups ? g.sms : groups, words = (groups + grid - 1) / grid;
    const int rpt = (HIDDEN + MLP_THREADS - 1) / MLP_THREADS;
    if (words != 3 || rpt != 4 || grid > MLP_MAX_BLOCKS) {
        fprintf(stderr, "this benchmark instantiates W = 3, RPT = 4 for at most %d blocks (got %d, %d, %d)\n",
                MLP_MAX_BLOCKS, words, rpt, grid);
        exit(1);
    }
    const size_t smem = (size_t)HIDDEN * 6 + 2ull * 8 * words * HIDDEN * 2 + 8 * words * 2;
    const void* f = (const void*)mlp_bulk_w3_r4;
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    float eps = 1e-6f;
    int H = HIDDEN, I = FF;
    void* args[] = {&h, &norm, &eps, &gu, &down, &acc.sums, &acc.not_finite, &acc.arrived, &H, &I};
    launch(g, f, dim3(grid), dim3(MLP_THREADS), smem, args);
}

void mlp_section(Gpu& g, std::vector<Layer>& layers, bf16* h, float* norm) {
    MlpAccumulator acc;
    CK(cudaMalloc(&acc.sums, HIDDEN * 8));
    CK(cudaMalloc(&acc.not_finite, HIDDEN * 4));
    CK(cudaMalloc(&acc.arrived, 4));
    CK(cudaMemset(acc.sums, 0, HIDDEN * 8));
    CK(cudaMemset(acc.not_finite, 0, HIDDEN * 4));
    CK(cudaMemset(acc.arrived, 0, 4));
    bf16 *h_ref, *act, *att, *qkv;
    CK(cudaMalloc(&h_ref, HIDDEN * 2));
    CK(cudaMalloc(&act, FF * 2));
    CK(cudaMalloc(&att, Q * 2));
    CK(cudaMalloc(&qkv, QKV * 2));
    g.bulk = true, g.fit = false, g.stage_bytes = 49152, g.ring_bytes = 98304, g.cap = 4;

    // Agreement over the 28 layers' weights, each from the same residual: the two GEMVs against the one kernel
    // (twice, to see it deterministic).
    int differ = 0, unequal_runs = 0;
    float worst = 0;
    for (int l = 0; l < LAYERS; l++) {
        g.pdl = false;
        // Everything on the kernels' stream (non-blocking: it does not wait for the legacy default stream).
        fill_random<<<4, 256, 0, g.stream>>>(h_ref, HIDDEN, 100 + l, 2.0f);
        std::vector<bf16> ref(HIDDEN), got(HIDDEN), again(HIDDEN);
        gemv(g, NORM_SILU, 1, h_ref, norm, layers[l].gu, act, 2 * FF, HIDDEN);
        gemv(g, PLAIN_ADD, 1, act, nullptr, layers[l].down, h_ref, HIDDEN, FF);
        CK(cudaMemcpyAsync(ref.data(), h_ref, HIDDEN * 2, cudaMemcpyDeviceToHost, g.stream));
        for (int run = 0; run < 2; run++) {
            fill_random<<<4, 256, 0, g.stream>>>(h, HIDDEN, 100 + l, 2.0f);
            mlp_launch(g, h, norm, layers[l].gu, layers[l].down, acc);
            CK(cudaMemcpyAsync((run ? again : got).data(), h, HIDDEN * 2, cudaMemcpyDeviceToHost, g.stream));
        }
        CK(cudaStreamSynchronize(g.stream));
        for (int i = 0; i < HIDDEN; i++) {
            const float a = __bfloat162float(ref[i]), b = __bfloat162float(got[i]);
            differ += a != b;
            worst = fmaxf(worst, fabsf(a - b) / fmaxf(1e-3f, fabsf(a)));
            unequal_runs += __bfloat162float(again[i]) != b;
        }
    }
    printf("agreement mlp m1: %d of %d residual values differ from the two GEMVs (worst relative %.2e); "
           "%d differ between two runs of the one kernel\n", differ, LAYERS * HIDDEN, worst, unequal_runs);

    g.pdl = true;
    int q_width = Q;
    void* standin_args[] = {&qkv, &att, &q_width};
    for (int round = 0; round < 2; round++) {
        for (int fused = 0; fused < 2; fused++) {
            const double layer = time_graph(g.stream, [&] {
                gemv(g, NORM_STORE, 1, h, norm, layers[0].qkv, qkv, QKV, HIDDEN);
                for (int l = 0; l < LAYERS; l++) {
                    launch(g, (const void*)standin_attention, dim3(8), dim3(256), 0, standin_args);
                    gemv(g, PLAIN_ADD, 1, att, nullptr, layers[l].o, h, HIDDEN, Q);
                    if (fused) {
                        mlp_launch(g, h, norm, layers[l].gu, layers[l].down, acc);
                    } else {
                        gemv(g, NORM_SILU, 1, h, norm, layers[l].gu, act, 2 * FF, HIDDEN);
                        gemv(g, PLAIN_ADD, 1, act, nullptr, layers[l].down, h, HIDDEN, FF);
                    }
                    gemv(g, NORM_STORE, 1, h, norm, layers[(l + 1) % LAYERS].qkv, qkv, QKV, HIDDEN);
                }
            }) / LAYERS;
            const double mlp = time_graph(g.stream, [&] {
                for (int l = 0; l < LAYERS; l++) {
                    if (fused) {
                        mlp_launch(g, h, norm, layers[l].gu, layers[l].down, acc);
                    } else {
                        gemv(g, NORM_SILU, 1, h, norm, layers[l].gu, act, 2 * FF, HIDDEN);
                        gemv(g, PLAIN_ADD, 1, act, nullptr, layers[l].down, h, HIDDEN, FF);
                    }
                }
            }) / LAYERS;
            printf("round %d, %s: layer (stand-in attention, O, MLP, next QKV) %.2f us; MLP alone %.2f us\n", round,
                   fused ? "MLP as one kernel" : "gate/up + down GEMVs", layer, mlp);
        }
    }
}

// The L2 experiment: is the batch-1 chain waiting on DRAM or on its own round trips? The same layer chain as the
// runtime's (a stand-in attention, then O, gate/up, down and the next QKV as bulk GEMVs), timed three ways: with
// 28 layers of distinct weights (as the runtime), with every layer reading layer 0's weights (31 MB, so they stay
// in L2: the chain's bound if weights arrived at no cost), and with distinct weights plus a side kernel that
// prefetches the coming weights into L2 (cp.async.bulk.prefetch.L2), paced by the layer the chain has reached,
// which the stand-in attention publishes. (The same prefetcher inside the runtime, paced by marks the bulk GEMVs
// publish, with its form here too, is l2_prefetch_runtime.patch beside this file, `git apply` on main;
// benchmarks/RESULTS.md has both: slower.)
extern "C" __global__ void standin_attention_marking(const bf16* qkv, bf16* att, int n, unsigned* progress, unsigned layer) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicMax(progress, layer + 1);
    kernel_begin();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) att[i] = qkv[i];
}

struct PrefetchItem {
    const unsigned char* p;
    unsigned bytes;
    unsigned after;  // issued once the chain's progress is at least this
};

extern "C" __global__ void l2_prefetcher(const PrefetchItem* items, int count, const unsigned* progress) {
    const unsigned CHUNK = 16384;
    for (int i = 0; i < count; i++) {
        const PrefetchItem it = items[i];
        while (*(volatile const unsigned*)progress < it.after) __nanosleep(256);
        for (unsigned off = (blockIdx.x * blockDim.x + threadIdx.x) * CHUNK; off < it.bytes;
             off += gridDim.x * blockDim.x * CHUNK) {
            const unsigned n = it.bytes - off < CHUNK ? it.bytes - off : CHUNK;
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(it.p + off), "r"(n) : "memory");
        }
    }
}

void l2_section(Gpu& g, std::vector<Layer>& layers, bf16* h, float* norm) {
    int l2 = 0;
    CK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    printf("GPU: %d SMs, L2 %d MB\n", g.sms, l2 >> 20);
    g.bulk = true, g.fit = false, g.stage_bytes = 49152, g.ring_bytes = 98304, g.cap = 4, g.pdl = true;
    bf16 *qkv, *att, *act;
    unsigned* progress;
    PrefetchItem* items_dev;
    CK(cudaMalloc(&qkv, QKV * 2));
    CK(cudaMalloc(&att, Q * 2));
    CK(cudaMalloc(&act, FF * 2));
    CK(cudaMalloc(&progress, 4));
    CK(cudaMalloc(&items_dev, 8 * LAYERS * sizeof(PrefetchItem)));
    fill_random<<<16, 256>>>(att, Q, 21, 2.0f);
    cudaStream_t side;
    CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaEvent_t fork, join;
    CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    const std::vector<Layer> same(LAYERS, layers[0]);
    int q_width = Q;
    const size_t QKV_B = (size_t)QKV * HIDDEN * 2, O_B = (size_t)HIDDEN * Q * 2, GU_B = (size_t)2 * FF * HIDDEN * 2,
                 DOWN_B = (size_t)HIDDEN * FF * 2;
    // Prefetch plans. "next layer": when the attention of layer l - 1 starts, all of layer l. "rolling": when the
    // attention of layer l starts, its gate/up and down, then the next layer's QKV and O.
    auto plan = [&](int kind) {
        std::vector<PrefetchItem> it;
        auto add = [&](const bf16* p, size_t b, unsigned after) { it.push_back({(const unsigned char*)p, (unsigned)b, after}); };
        if (kind == 0) {
            for (int l = 0; l < LAYERS; l++) {
                add(layers[l].qkv, QKV_B, l), add(layers[l].o, O_B, l), add(layers[l].gu, GU_B, l), add(layers[l].down, DOWN_B, l);
            }
        } else {
            add(layers[0].qkv, QKV_B, 0), add(layers[0].o, O_B, 0);
            for (int l = 0; l < LAYERS; l++) {
                add(layers[l].gu, GU_B, l + 1), add(layers[l].down, DOWN_B, l + 1);
                if (l + 1 < LAYERS) add(layers[l + 1].qkv, QKV_B, l + 1), add(layers[l + 1].o, O_B, l + 1);
            }
        }
        return it;
    };
    auto chain = [&](const std::vector<Layer>& ls, int prefetch_kind, int prefetch_blocks) {
        int count = 0;
        if (prefetch_kind >= 0) {
            const std::vector<PrefetchItem> it = plan(prefetch_kind);
            count = (int)it.size();
            CK(cudaMemcpy(items_dev, it.data(), it.size() * sizeof(PrefetchItem), cudaMemcpyHostToDevice));
        }
        return time_graph(g.stream, [&] {
                   CK(cudaMemsetAsync(progress, 0, 4, g.stream));
                   if (prefetch_kind >= 0) {
                       CK(cudaEventRecord(fork, g.stream));
                       CK(cudaStreamWaitEvent(side, fork, 0));
                       l2_prefetcher<<<prefetch_blocks, 32, 0, side>>>(items_dev, count, progress);
                       CK(cudaGetLastError());
                   }
                   gemv(g, NORM_STORE, 1, h, norm, ls[0].qkv, qkv, QKV, HIDDEN);
                   for (int l = 0; l < LAYERS; l++) {
                       unsigned layer = l;
                       void* args[] = {&qkv, &att, &q_width, &progress, &layer};
                       launch(g, (const void*)standin_attention_marking, dim3(8), dim3(256), 0, args);
                       gemv(g, PLAIN_ADD, 1, att, nullptr, ls[l].o, h, HIDDEN, Q);
                       gemv(g, NORM_SILU, 1, h, norm, ls[l].gu, act, 2 * FF, HIDDEN);
                       gemv(g, PLAIN_ADD, 1, act, nullptr, ls[l].down, h, HIDDEN, FF);
                       gemv(g, NORM_STORE, 1, h, norm, ls[(l + 1) % LAYERS].qkv, qkv, QKV, HIDDEN);
                   }
                   if (prefetch_kind >= 0) {
                       CK(cudaEventRecord(join, side));
                       CK(cudaStreamWaitEvent(g.stream, join, 0));
                   }
               }) /
               LAYERS;
    };
    for (int round = 0; round < 2; round++) {
        printf("round %d, us per layer: distinct %.2f | shared (L2-resident) %.2f", round, chain(layers, -1, 0),
               chain(same, -1, 0));
        for (int kind : {0, 1})
            for (int blocks : {4, 16, 64})
                printf(" | prefetch %s x%d %.2f", kind ? "rolling" : "next-layer", blocks, chain(layers, kind, blocks));
        printf("\n");
    }
}
