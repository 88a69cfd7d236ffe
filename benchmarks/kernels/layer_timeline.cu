// Where a batch-1 decode layer's time goes, block by block: the runtime's own kernels of a Qwen3-0.6B layer (QKV
// bulk GEMV with its RMSNorm, the tensor-core decode attention with RoPE, q/k norm and the newest K/V written, O
// into the residual, gate/up with RMSNorm and SiLU, down into the residual), 28 layers with distinct weights and
// caches, captured in one CUDA graph with programmatic dependent launch as a decode step runs them. Thread 0 of
// every block stamps the global timer at the kernels' TIMELINE marks (kernels/common.cuh): its start, the return
// of its PDL wait, its input in shared memory (GEMV: the input rows, normalized; attention: q and the newest K/V
// rotated), its first weights ready (GEMV: ring stage 0; attention: the main loop done) and its end.
//
// Why: profilers give a kernel's start and end, not when its blocks get past their wait or what they wait on
// after it; the batch-1 step is a chain of about 145 such hand-overs (benchmarks/RESULTS.md).
//
//   nvcc -arch=sm_90 -DSTEPLLM_PDL -DSTEPLLM_TIMELINE -O3 -std=c++17 -I kernels -o /tmp/layer_timeline \
//       benchmarks/kernels/layer_timeline.cu && /tmp/layer_timeline [context]
//
// STEPLLM_BENCH_FIT_RING=1 gives each GEMV no more ring stages than its block's rows fill (the runtime's ring is
// 96 KB whatever the block needs), so that more blocks fit beside it.
// STEPLLM_BENCH_SPLITS=N gives the attention N key splits instead of the runtime's choice for the context.
//
// Blocks take a ticket at their first mark. A kernel's blocks all start before the next kernel's (the next one is
// launched only once every block of this one has passed its wait), so tickets in order of launch, each launch's
// grid in turn, say which launch a record belongs to.
#include "attention.cuh"
#include "gemv_bulk.cu"
#include "bench_harness.cuh"

#include <algorithm>
#include <cmath>
#include <vector>

constexpr int D = 128, G = 2, KV_HEADS = 8, BLOCK = 16, HIDDEN = 1024, QKV = 4096, Q = 2048, FF = 3072,
              LAYERS = 28;

ROTATING_ATTENTION_KERNEL(timeline_attention, bf16, (MmaDecode<D, G, bf16>::MIN_BLOCKS),
                          (paged_attention_mma<D, G, bf16>))

typedef void (*BulkFn)(const bf16*, const float*, float, const bf16*, const float*, bf16*, int, int, int, int);

enum Kind { K_QKV, K_ATTN, K_O, K_GU, K_DOWN, KINDS };
const char* KIND_NAMES[KINDS] = {"qkv (norm)", "attention", "o (+res)", "gate/up", "down (+res)"};

struct Launch {
    Kind kind;
    int blocks;
};

struct Chain {
    int sms;
    cudaStream_t stream;
    std::vector<Launch> launches;  // filled while recording

    void launch(Kind kind, const void* f, dim3 grid, dim3 block, size_t smem, void** args) {
        launch_pdl(stream, f, grid, block, smem, args);
        launches.push_back({kind, (int)(grid.x * grid.y * grid.z)});
    }

    // As gemv.rs launches the bulk family: one block per multiprocessor, its ring from bulk_stages.
    void gemv(Kind kind, BulkFn f, bool silu, const bf16* x, const float* norm, const bf16* w, bf16* y, int n, int k) {
        const int row_bytes = (silu ? 2 : 1) * k * 2;
        // STEPLLM_BENCH_FIT_RING=1: no more stages than the block's rows fill (so more blocks fit beside it).
        const int fit_cols = getenv("STEPLLM_BENCH_FIT_RING") ? ((silu ? n / 2 : n) + sms - 1) / sms : 0;
        const BulkRing ring = bulk_ring(row_bytes, BULK_MAX_STAGES, 48 << 10, 96 << 10, fit_cols);  // gemv.rs sizes
        int stage_rows = ring.stage_rows, stages = ring.stages;
        const size_t smem = (size_t)k * 2 + (norm ? (size_t)k * 4 : 0) + (size_t)stages * stage_rows * row_bytes;
        CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        float eps = 1e-6f;
        const float* bias = nullptr;
        void* args[] = {&x, &norm, &eps, &w, &bias, &y, &n, &k, &stage_rows, &stages};
        launch(kind, (const void*)f, dim3(sms), dim3(BULK_THREADS), smem, args);
    }
};

struct Layer {
    bf16 *qkv_w, *o_w, *gu_w, *down_w, *k_cache, *v_cache;
};

static double median(std::vector<double> v) {
    if (v.empty()) return NAN;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    const int context = argc > 1 ? atoi(argv[1]) : 136;
    Chain c = {};
    CK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));

    // One row's block table over a cache of exactly its blocks (each layer its own cache, as the runtime's).
    const int blocks = (context + BLOCK - 1) / BLOCK;
    std::vector<u32> table(blocks);
    for (int b = 0; b < blocks; b++) table[b] = (u32)((b * 5) % blocks);  // not in order, as paging leaves them
    const std::vector<u32> seq_info = {0u, 1u, (u32)(context - 1), 0u, (u32)blocks};
    const u32 position = context - 1, token_seq = 0,
              slot = table[(context - 1) / BLOCK] * BLOCK + (context - 1) % BLOCK;
    auto upload = [](const void* p, size_t bytes) {
        void* d;
        CK(cudaMalloc(&d, bytes));
        CK(cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice));
        return (u32*)d;
    };
    u32 *d_pos = upload(&position, 4), *d_seq = upload(&token_seq, 4), *d_info = upload(seq_info.data(), 20),
        *d_tab = upload(table.data(), blocks * 4), *d_slot = upload(&slot, 4), *counters;
    const size_t cache_elems = (size_t)blocks * KV_HEADS * BLOCK * D;
    std::vector<Layer> layers(LAYERS);
    for (size_t i = 0; i < layers.size(); i++) {
        Layer& l = layers[i];
        CK(cudaMalloc(&l.qkv_w, (size_t)QKV * HIDDEN * 2));
        CK(cudaMalloc(&l.o_w, (size_t)HIDDEN * Q * 2));
        CK(cudaMalloc(&l.gu_w, (size_t)2 * FF * HIDDEN * 2));
        CK(cudaMalloc(&l.down_w, (size_t)HIDDEN * FF * 2));
        CK(cudaMalloc(&l.k_cache, cache_elems * 2));
        CK(cudaMalloc(&l.v_cache, cache_elems * 2));
        const u32 s = 10 * (u32)i;
        fill_random<<<1024, 256>>>(l.qkv_w, (size_t)QKV * HIDDEN, s + 1, 0.05f);
        fill_random<<<1024, 256>>>(l.o_w, (size_t)HIDDEN * Q, s + 2, 0.05f);
        fill_random<<<1024, 256>>>(l.gu_w, (size_t)2 * FF * HIDDEN, s + 3, 0.05f);
        fill_random<<<1024, 256>>>(l.down_w, (size_t)HIDDEN * FF, s + 4, 0.05f);
        fill_random<<<256, 256>>>(l.k_cache, cache_elems, s + 5, 2.0f);
        fill_random<<<256, 256>>>(l.v_cache, cache_elems, s + 6, 2.0f);
    }
    bf16 *h, *qkv, *att, *act;
    float *norm, *partial;
    CK(cudaMalloc(&h, HIDDEN * 2));
    CK(cudaMalloc(&qkv, QKV * 2));
    CK(cudaMalloc(&att, Q * 2));
    CK(cudaMalloc(&act, FF * 2));
    CK(cudaMalloc(&norm, FF * 4));
    CK(cudaMalloc(&partial, (size_t)KV_HEADS * G * MAX_SPLITS * (D + 2) * 4));
    CK(cudaMalloc(&counters, KV_HEADS * 4));
    CK(cudaMemset(counters, 0, KV_HEADS * 4));
    fill_random<<<4, 256>>>(h, HIDDEN, 7, 1.0f);
    fill_ones<<<1, 256>>>(norm, FF);
    CK(cudaDeviceSynchronize());

    const char* splits_env = getenv("STEPLLM_BENCH_SPLITS");
    const int splits = splits_env ? atoi(splits_env) : decode_attention_splits(1, KV_HEADS, context, c.sms, MAX_SPLITS);
    auto record = [&] {
        c.launches.clear();
        for (Layer& l : layers) {
            c.gemv(K_QKV, gemv_bulk_norm_store_m1, false, h, norm, l.qkv_w, qkv, QKV, HIDDEN);
            int width = QKV, block_size = BLOCK, kv_heads = KV_HEADS;
            float scale = 1.0f / sqrtf((float)D), eps = 1e-6f, theta = 1e6f;
            const float* inv_freq = nullptr;
            void* args[] = {&qkv, &width, &d_pos, &d_seq, &d_info, &d_tab, &l.k_cache, &l.v_cache, &block_size,
                            &kv_heads, &scale, &att, &partial, &counters, &norm, &norm, &eps, &theta, &inv_freq,
                            &d_slot};
            c.launch(K_ATTN, (const void*)timeline_attention, dim3(1, KV_HEADS, splits), dim3(ATTN_THREADS), 0, args);
            c.gemv(K_O, gemv_bulk_plain_add_m1, false, att, nullptr, l.o_w, h, HIDDEN, Q);
            c.gemv(K_GU, gemv_bulk_norm_silu_m1, true, h, norm, l.gu_w, act, 2 * FF, HIDDEN);
            c.gemv(K_DOWN, gemv_bulk_plain_add_m1, false, act, nullptr, l.down_w, h, HIDDEN, FF);
        }
    };

    unsigned long long* records;
    CK(cudaMalloc(&records, (size_t)TL_MAX_BLOCKS * TL_POINTS * 8));
    const unsigned long long* off = nullptr;
    CK(cudaMemcpyToSymbol(tl_records, &off, sizeof off));
    const double plain = time_graph(c.stream, record) / LAYERS;
    CK(cudaMemcpyToSymbol(tl_records, &records, sizeof records));
    const double marked = time_graph(c.stream, record) / LAYERS;
    printf("%s, %d SMs; batch 1, context %d, %d attention splits; a layer %.2f us (%.2f us with the marks on)\n",
           prop.name, c.sms, context, splits, plain, marked);

    // Graph replays one at a time, every block's stamps of the last ones kept.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeRelaxed));
    record();
    CK(cudaStreamEndCapture(c.stream, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    int total = 0;
    for (const Launch& l : c.launches) total += l.blocks;
    if (total > TL_MAX_BLOCKS) {
        fprintf(stderr, "%d blocks a replay, more than the %d the records hold\n", total, TL_MAX_BLOCKS);
        return 1;
    }
    const int REPLAYS = 20;
    // [kind][column] samples over replays and layers 2..27 (the first and last layer see the graph's edges).
    const int COLS = 9;
    const char* col_names[COLS] = {"1st start", "last start", "1st wait", "med wait", "last wait", "med input",
                                   "med ready", "med end", "last end"};
    std::vector<std::vector<double>> samples(KINDS * COLS);
    std::vector<double> tick_resolution;
    std::vector<unsigned long long> host((size_t)total * TL_POINTS);
    for (int r = 0; r < REPLAYS + 3; r++) {
        record_marks(records, c.stream, [&] { CK(cudaGraphLaunch(exec, c.stream)); }, host);
        if (r < 3) continue;  // warm-up
        double prev_end = NAN;
        for (size_t li = 0, first = 0; li < c.launches.size(); first += c.launches[li].blocks, li++) {
            const Launch& l = c.launches[li];
            std::vector<double> at[TL_POINTS];
            for (int b = 0; b < l.blocks; b++)
                for (int p = 0; p < TL_POINTS; p++) {
                    const unsigned long long v = host[(first + b) * TL_POINTS + p];
                    if (v) at[p].push_back(v * 1e-3);  // ns to µs
                }
            auto lo = [](const std::vector<double>& v) { return v.empty() ? NAN : *std::min_element(v.begin(), v.end()); };
            auto hi = [](const std::vector<double>& v) { return v.empty() ? NAN : *std::max_element(v.begin(), v.end()); };
            const double end = hi(at[TL_END]);
            const int layer = (int)li / KINDS;
            if (layer >= 1 && layer < LAYERS - 1) {
                const double v[COLS] = {lo(at[TL_START]),    hi(at[TL_START]), lo(at[TL_WAITED]),
                                        median(at[TL_WAITED]), hi(at[TL_WAITED]), median(at[TL_INPUT]),
                                        median(at[TL_READY]), median(at[TL_END]), end};
                for (int k = 0; k < COLS; k++) samples[l.kind * COLS + k].push_back(v[k] - prev_end);
            }
            for (size_t i = 1; i < at[TL_END].size(); i++) {
                const double d = std::fabs(at[TL_END][i] - at[TL_END][i - 1]);
                if (d > 0) tick_resolution.push_back(d);
            }
            prev_end = end;
        }
    }
    printf("global timer: smallest nonzero step between two blocks' stamps %.3f us\n",
           tick_resolution.empty() ? NAN : *std::min_element(tick_resolution.begin(), tick_resolution.end()));
    printf("us after the previous kernel's last block ended (medians over %d replays x %d layers):\n", REPLAYS,
           LAYERS - 2);
    printf("%-12s", "kernel");
    for (int k = 0; k < COLS; k++) printf(" %10s", col_names[k]);
    printf("\n");
    double layer_sum = 0;
    for (int kind = 0; kind < KINDS; kind++) {
        printf("%-12s", KIND_NAMES[kind]);
        for (int k = 0; k < COLS; k++) printf(" %10.2f", median(samples[kind * COLS + k]));
        printf("\n");
        layer_sum += median(samples[kind * COLS + COLS - 1]);
    }
    printf("sum of the kernels' last ends: %.2f us a layer\n", layer_sum);

    // A fingerprint of the residual after one replay from a fixed start: a change that keeps the kernels'
    // arithmetic must keep it.
    fill_random<<<4, 256>>>(h, HIDDEN, 7, 1.0f);
    CK(cudaDeviceSynchronize());
    CK(cudaGraphLaunch(exec, c.stream));
    CK(cudaStreamSynchronize(c.stream));
    std::vector<bf16> out(HIDDEN);
    CK(cudaMemcpy(out.data(), h, HIDDEN * 2, cudaMemcpyDeviceToHost));
    printf("residual after one replay: fingerprint %016llx\n", fingerprint(out));
    return 0;
}
