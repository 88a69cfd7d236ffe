// The runtime's tensor-core decode attention (kernels/attention.cuh paged_attention_mma, with RoPE, q/k norm and
// the newest K/V written, as in a decode step) on its own, over a paged cache of the Qwen3-0.6B shape (8 KV heads,
// 2 query heads each, head_dim 128, blocks of 16 positions), to see how close each launch comes to the device's
// bandwidth without the rest of a step around it, and to try changes to the kernel in seconds (edit kernels/ on
// the device, rebuild this file) instead of a wheel build and a whole workload.
//
// Why: the mixed workload's decode steps are 60% this kernel, which reads the cache at about 70% of the H200's
// data-sheet bandwidth (benchmarks/RESULTS.md). Each case below times one launch as a decode step makes it (grid:
// rows × KV heads × the host's split count, backend.rs attention_splits) and reports the K/V bytes it must read
// per microsecond.
//
//   nvcc -arch=sm_90 -DSTEPLLM_PDL -O3 -std=c++17 -I kernels -o /tmp/decode_attention \
//       benchmarks/kernels/decode_attention.cu && /tmp/decode_attention [fp8|bf16] [--sweep] [reference prefix]
//
// With -DSTEPLLM_TIMELINE each case also prints where its blocks' time goes (the kernel's TIMELINE marks).
//
// STEPLLM_BENCH_BLOCKS=N pads each block's shared memory so that at most N blocks share a multiprocessor.
//
// Each case prints a fingerprint of its output bits: a change that keeps the kernel's arithmetic must keep it. A
// change that reorders the arithmetic (benchmarks/kernels/qk_chains.patch) is checked against a reference prefix
// instead: the first run writes its outputs there, later runs print their largest difference from them.
#include "attention.cuh"
#include "bench_harness.cuh"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

// Positions per cache block: the runtime's default 16; -DSTEPLLM_BENCH_BLOCK_SIZE=32 (or 64) for larger blocks,
// whose K and V of one head are larger contiguous chunks.
#ifndef STEPLLM_BENCH_BLOCK_SIZE
#define STEPLLM_BENCH_BLOCK_SIZE 16
#endif
constexpr int D = 128, G = 2, KV_HEADS = 8, BLOCK = STEPLLM_BENCH_BLOCK_SIZE;

ROTATING_ATTENTION_KERNEL(bench_attention_fp8, fp8, (MmaDecode<D, G, fp8>::MIN_BLOCKS),
                          (paged_attention_mma<D, G, fp8>))
ROTATING_ATTENTION_KERNEL(bench_attention_bf16, bf16, (MmaDecode<D, G, bf16>::MIN_BLOCKS),
                          (paged_attention_mma<D, G, bf16>))

// Cache bytes that are finite values of either type (the kernel's speed does not depend on them, but NaNs would
// hide a broken run): the low 7 bits of every byte below 0x38.
__global__ void fill_cache(unsigned char* p, size_t n, u32 seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const u32 h = bench_hash(i, seed);
        p[i] = (unsigned char)((h % 0x38) | (h & 0x80));
    }
}

struct Case {
    std::string name;
    std::vector<int> contexts;  // one decode row each
};

// Unused dynamic shared memory that leaves room for only STEPLLM_BENCH_BLOCKS blocks a multiprocessor (0 when
// unset): to compare kernels at the same occupancy when one of them uses fewer registers.
template <typename Kernel>
static int padding_smem(Kernel kernel) {
    const char* env = getenv("STEPLLM_BENCH_BLOCKS");
    if (!env) return 0;
    const int wanted = atoi(env);
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
    for (int bytes = 0; bytes <= 200 << 10; bytes += 1024) {
        int n = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, ATTN_THREADS, bytes));
        if (n <= wanted) return bytes;
    }
    return 200 << 10;
}

// Blocks of `kernel` a multiprocessor holds in this run.
template <typename Kernel>
static int resident_blocks(Kernel kernel) {
    int n = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, ATTN_THREADS, padding_smem(kernel)));
    return n;
}

// With a reference prefix: the first run of a case writes its output to `<prefix>.<case>`, later runs (a changed
// kernel whose arithmetic differs, so its fingerprint does too) report how far they are from it.
static std::string against_reference(const std::vector<bf16>& out, const char* prefix, int case_index) {
    if (!prefix) return "";
    const std::string path = std::string(prefix) + "." + std::to_string(case_index);
    std::vector<bf16> ref(out.size());
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) {
        f = fopen(path.c_str(), "wb");
        if (!f || fwrite(out.data(), sizeof(bf16), out.size(), f) != out.size()) return "  (reference not written)";
        fclose(f);
        return "  (reference written)";
    }
    const size_t got = fread(ref.data(), sizeof(bf16), ref.size(), f);
    fclose(f);
    if (got != ref.size()) return "  (reference of another size)";
    float diff = 0.0f, peak = 0.0f;
    for (size_t i = 0; i < out.size(); i++) {
        diff = std::max(diff, std::fabs(__bfloat162float(out[i]) - __bfloat162float(ref[i])));
        peak = std::max(peak, std::fabs(__bfloat162float(ref[i])));
    }
    char text[96];
    snprintf(text, sizeof text, "  max |diff| %.3g of max |ref| %.3g", diff, peak);
    return text;
}

#ifdef STEPLLM_TIMELINE
// Built with -DSTEPLLM_TIMELINE: a few launches with the kernel's TIMELINE marks on, to see where its blocks' time
// goes (before the wait: metadata, the first K/V loads and the RoPE angles; q and the newest K/V rotated; the main
// loop; the merge and store) and how busy the launch keeps the multiprocessors' block slots.
template <typename Launch>
static void block_phases(cudaStream_t stream, Launch launch, int blocks, int slots) {
    if (blocks > TL_MAX_BLOCKS) {
        printf("  timeline: %d blocks, more than the %d the records hold\n", blocks, TL_MAX_BLOCKS);
        return;
    }
    unsigned long long* records;
    CK(cudaMalloc(&records, (size_t)blocks * TL_POINTS * 8));
    CK(cudaMemcpyToSymbol(tl_records, &records, sizeof records));
    const int REPS = 5;
    double phase[4] = {}, busy = 0, span = 0;
    long counted = 0;
    std::vector<unsigned long long> host((size_t)blocks * TL_POINTS);
    for (int r = 0; r < REPS + 1; r++) {
        record_marks(records, stream, launch, host);
        if (r == 0) continue;  // warm-up
        unsigned long long first = ~0ull, last = 0;
        for (int b = 0; b < blocks; b++) {
            const unsigned long long* t = &host[(size_t)b * TL_POINTS];
            if (!t[TL_START] || !t[TL_END]) continue;  // a split past its row's context returns at once
            first = std::min(first, t[TL_START]), last = std::max(last, t[TL_END]);
            for (int p = 0; p < 4; p++) phase[p] += (t[p + 1] - t[p]) * 1e-3;
            busy += (t[TL_END] - t[TL_START]) * 1e-3;
            counted++;
        }
        span += (last - first) * 1e-3;
    }
    const unsigned long long* off = nullptr;
    CK(cudaMemcpyToSymbol(tl_records, &off, sizeof off));
    CK(cudaFree(records));
    const double n = std::max<long>(counted, 1);
    printf("  a block, us: before wait %.2f, q + newest K/V %.2f, loop %.2f, merge %.2f; slots busy %.0f%% of %.2f us\n",
           phase[0] / n, phase[1] / n, phase[2] / n, phase[3] / n, 100.0 * busy / (span * slots), span / REPS);
}
#endif

template <typename KV>
static void run_case(const Case& c, void (*kernel)(const bf16*, int, const u32*, const u32*, const u32*, const u32*,
                                                   KV*, KV*, int, int, float, bf16*, float*, u32*, const float*,
                                                   const float*, float, float, const float*, const u32*),
                     int sms, [[maybe_unused]] int block_slots, const char* reference, int case_index) {
    const int rows = (int)c.contexts.size();
    // Every row's blocks, shuffled over the cache as paging leaves them.
    std::vector<u32> tables, seq_info, positions(rows), token_seq(rows), slots(rows);
    int blocks = 0;
    for (int ctx : c.contexts) blocks += (ctx + BLOCK - 1) / BLOCK;
    std::vector<u32> order(blocks);
    for (int i = 0; i < blocks; i++) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(7));
    size_t kv_bytes = 0;
    for (int r = 0, next = 0; r < rows; r++) {
        const int ctx = c.contexts[r], n = (ctx + BLOCK - 1) / BLOCK;
        const u32 start = (u32)tables.size();
        for (int b = 0; b < n; b++) tables.push_back(order[next++]);
        seq_info.insert(seq_info.end(), {(u32)r, 1u, (u32)(ctx - 1), start, (u32)n});
        positions[r] = ctx - 1, token_seq[r] = r;
        slots[r] = tables[start + (ctx - 1) / BLOCK] * BLOCK + (ctx - 1) % BLOCK;
        kv_bytes += (size_t)ctx * KV_HEADS * D * sizeof(KV) * 2;
    }
    const int width = (KV_HEADS * G + 2 * KV_HEADS) * D;
    const size_t cache_elems = (size_t)blocks * KV_HEADS * BLOCK * D;
    const int max_ctx = *std::max_element(c.contexts.begin(), c.contexts.end());
    const int splits = decode_attention_splits(rows, KV_HEADS, max_ctx, sms, MAX_SPLITS);

    auto upload = [](const std::vector<u32>& v) {
        u32* p;
        CK(cudaMalloc(&p, std::max<size_t>(v.size(), 1) * 4));
        CK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
        return p;
    };
    u32 *d_pos = upload(positions), *d_seq = upload(token_seq), *d_info = upload(seq_info), *d_tab = upload(tables),
        *d_slots = upload(slots), *d_counters;
    KV *k_cache, *v_cache;
    bf16 *qkv, *out;
    float *partial, *norm;
    CK(cudaMalloc(&k_cache, cache_elems * sizeof(KV)));
    CK(cudaMalloc(&v_cache, cache_elems * sizeof(KV)));
    CK(cudaMalloc(&qkv, (size_t)rows * width * sizeof(bf16)));
    CK(cudaMalloc(&out, (size_t)rows * KV_HEADS * G * D * sizeof(bf16)));
    CK(cudaMalloc(&partial, (size_t)rows * KV_HEADS * G * MAX_SPLITS * (D + 2) * sizeof(float)));
    CK(cudaMalloc(&d_counters, (size_t)rows * KV_HEADS * 4));
    CK(cudaMalloc(&norm, D * sizeof(float)));
    CK(cudaMemset(d_counters, 0, (size_t)rows * KV_HEADS * 4));
    fill_cache<<<1024, 256>>>(reinterpret_cast<unsigned char*>(k_cache), cache_elems * sizeof(KV), 1);
    fill_cache<<<1024, 256>>>(reinterpret_cast<unsigned char*>(v_cache), cache_elems * sizeof(KV), 2);
    fill_random<<<256, 256>>>(qkv, (size_t)rows * width, 3, 2.0f);
    fill_ones<<<1, 128>>>(norm, D);
    CK(cudaDeviceSynchronize());

    cudaStream_t stream;
    CK(cudaStreamCreate(&stream));
    const int smem = padding_smem(kernel);
    const dim3 grid(rows, KV_HEADS, splits);
    const float scale = 1.0f / sqrtf((float)D);
    const auto launch = [&] {
        kernel<<<grid, ATTN_THREADS, smem, stream>>>(qkv, width, d_pos, d_seq, d_info, d_tab, k_cache, v_cache, BLOCK,
                                                  KV_HEADS, scale, out, partial, d_counters, norm, norm, 1e-6f, 1e6f,
                                                  nullptr, d_slots);
    };
    constexpr int LAUNCHES = 20;  // per graph replay, back to back as a step's layers are (without the rest)
    const double us = time_graph(stream, [&] {
        for (int i = 0; i < LAUNCHES; i++) launch();
    }, 20) / LAUNCHES;
    CK(cudaGetLastError());
    // A fingerprint of the output's bits: a change to the kernel that keeps its arithmetic (the order of its
    // sub-steps, its registers, its schedule) must leave it as it was.
    std::vector<bf16> host_out((size_t)rows * KV_HEADS * G * D);
    CK(cudaMemcpy(host_out.data(), out, host_out.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
    printf("%-34s rows %4d  splits %2d  K/V %8.2f MB  %8.2f us  %6.3f TB/s  output %016llx%s\n", c.name.c_str(), rows,
           splits, kv_bytes / 1e6, us, kv_bytes / us / 1e6, fingerprint(host_out),
           against_reference(host_out, reference, case_index).c_str());
#ifdef STEPLLM_TIMELINE
    block_phases(stream, launch, rows * KV_HEADS * splits, block_slots);
#endif
    for (void* p : std::initializer_list<void*>{d_pos, d_seq, d_info, d_tab, d_slots, d_counters, k_cache, v_cache,
                                                qkv, out, partial, norm})
        CK(cudaFree(p));
    CK(cudaStreamDestroy(stream));
}

// The default cases: the mixed workload early and late (contexts of a prompt in [100, 1024] plus up to 1,024
// generated tokens; the runtime hands its rows to the kernel longest context first), fixed contexts, batch 1.
static std::vector<Case> workload_cases() {
    std::mt19937 rng(1);
    auto uniform = [&](int rows, int lo, int hi) {
        std::vector<int> v(rows);
        for (int& x : v) x = std::uniform_int_distribution<int>(lo, hi)(rng);
        return v;
    };
    auto longest_first = [](std::vector<int> v) {
        std::sort(v.begin(), v.end(), std::greater<int>());
        return v;
    };
    const std::vector<int> early = uniform(256, 100, 2048);
    return {
        {"mixed-like, 256 rows of 100-2048", early},
        {"the same, longest first", longest_first(early)},
        {"mixed-like, 128 rows of 600-2048", uniform(128, 600, 2048)},
        {"mixed tail, 40 rows of 1000-2048", uniform(40, 1000, 2048)},
        {"256 rows of 1024", std::vector<int>(256, 1024)},
        {"64 rows of 2048", std::vector<int>(64, 2048)},
        {"8 rows of 4096", std::vector<int>(8, 4096)},
        {"1 row of 128 (batch 1)", std::vector<int>(1, 128)},
    };
}

// `--sweep`: rows of 1,024 positions on either side of whole waves of blocks (the kernel's resident blocks times
// the multiprocessors), to see what a launch loses to its last, partly filled wave.
static std::vector<Case> wave_cases(int slots) {
    std::vector<Case> cases;
    const int rows_per_wave = slots / KV_HEADS;
    for (int waves = 1; waves <= 5; waves++)
        for (int rows : {waves * rows_per_wave, waves * rows_per_wave + 1})
            cases.push_back({std::to_string(rows) + " rows of 1024 (" + std::to_string(rows * KV_HEADS) + " blocks)",
                             std::vector<int>(rows, 1024)});
    return cases;
}

//   decode_attention [fp8|bf16] [--sweep] [reference prefix]
int main(int argc, char** argv) {
    const bool fp8_cache = argc < 2 || strcmp(argv[1], "bf16") != 0;
    const bool sweep = argc > 2 && strcmp(argv[2], "--sweep") == 0;
    const char* reference = argc > 2 && !sweep ? argv[2] : nullptr;
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int resident = fp8_cache ? resident_blocks(bench_attention_fp8) : resident_blocks(bench_attention_bf16);
    printf("%s, %d SMs, %s cache, %d blocks a multiprocessor\n", prop.name, sms, fp8_cache ? "fp8" : "bf16", resident);
    const std::vector<Case> cases = sweep ? wave_cases(resident * sms) : workload_cases();
    for (size_t i = 0; i < cases.size(); i++) {
        if (fp8_cache)
            run_case<fp8>(cases[i], bench_attention_fp8, sms, resident * sms, reference, (int)i);
        else
            run_case<bf16>(cases[i], bench_attention_bf16, sms, resident * sms, reference, (int)i);
    }
    return 0;
}
