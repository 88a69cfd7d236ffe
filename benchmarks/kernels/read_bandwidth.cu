// How fast this GPU can read DRAM at all, and how many bytes a multiprocessor must keep in flight for it: the
// ceiling the bandwidth-bound kernels (the decode attention, the batch-1 projections) are measured against, on
// whichever card runs it, instead of the data sheet's figure.
//
//   nvcc -arch=sm_90 -O3 -std=c++17 -I kernels -o /tmp/rb benchmarks/kernels/read_bandwidth.cu && /tmp/rb
//
// Every read is the decode attention's K/V load (kv_stream_load). Two access patterns over a buffer far larger
// than L2:
// - stream: every thread reads U 16-byte words a round, the grid striding over the buffer (a memcpy's reads);
// - chunks: each warp reads whole chunks of C bytes taken in a random order (a paged KV cache's blocks: an fp8
//   block of 16 positions of one KV head at head_dim 128 is 2 KB), U chunks in flight a warp.
// Each is swept over blocks per multiprocessor and U, so the table shows where more bytes in flight stop helping.
#include "bench_harness.cuh"
#include "kv_cache.cuh"  // kv_stream_load: the decode attention's own K/V load

#include <algorithm>
#include <random>
#include <vector>

constexpr int THREADS = 256;

// The XOR of everything read, stored only if it equals a value it never takes, so no load is optimized away.
__device__ __forceinline__ void keep(u32 acc, u32* sink) {
    if (acc == 0x9e3779b9u) *sink = acc;
}

template <int U>
__global__ void __launch_bounds__(THREADS, 1) stream_read(const uint4* __restrict__ buf, size_t words, u32* sink) {
    const size_t stride = (size_t)gridDim.x * THREADS;
    u32 acc = 0;
    for (size_t base = blockIdx.x * (size_t)THREADS + threadIdx.x; base + (U - 1) * stride < words; base += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = kv_stream_load(buf + base + u * stride);
#pragma unroll
        for (int u = 0; u < U; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    keep(acc, sink);
}

// Warp w of the grid reads chunks order[w], order[w + warps], ...; each chunk is C / 16 words, a lane reading
// every 32nd of them.
template <int U>
__global__ void __launch_bounds__(THREADS, 1) chunk_read(const uint4* __restrict__ buf, const u32* __restrict__ order,
                                                     int chunks, int chunk_words, u32* sink) {
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (THREADS / 32);
    const int warp = blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
    const int per_lane = chunk_words / 32;  // a multiple of 4: chunks are 2 KB or more
    u32 acc = 0;
    for (int i = warp; i + (U - 1) * warps < chunks; i += U * warps) {
        const uint4* c[U];
#pragma unroll
        for (int u = 0; u < U; u++) c[u] = buf + (size_t)__ldg(order + i + u * warps) * chunk_words + lane;
        for (int j = 0; j < per_lane; j += 4) {
            uint4 v[U][4];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int k = 0; k < 4; k++) v[u][k] = kv_stream_load(c[u] + 32 * (j + k));
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int k = 0; k < 4; k++) acc ^= v[u][k].x ^ v[u][k].y ^ v[u][k].z ^ v[u][k].w;
        }
    }
    keep(acc, sink);
}

// TB/s of `bytes` read per launch, the best of 5 timed launches after 2 warm-ups.
template <typename Launch>
double tbps(size_t bytes, Launch launch) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 2; i++) launch();
    float best = 1e30f;
    for (int i = 0; i < 5; i++) {
        CK(cudaEventRecord(a));
        launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        best = std::min(best, ms);
    }
    CK(cudaGetLastError());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return bytes / (best * 1e-3) / 1e12;
}

// Blocks of `kernel` one multiprocessor can hold, at most `wanted`.
template <typename Kernel>
int resident_blocks(Kernel kernel, int wanted) {
    int n = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, THREADS, 0));
    return std::min(n, wanted);
}

// "TB/s/KB in flight per SM" of one cell.
void print_cell(double tb, int blocks, int bytes_per_thread) {
    printf(" %5.2f/%-4d", tb, blocks * THREADS * bytes_per_thread / 1024);
}

template <int U>
void stream_cell(const uint4* buf, size_t words, int blocks, int sms, u32* sink) {
    const int grid = blocks * sms;
    // Only the words the loop reaches count: whole rounds of U * grid * THREADS.
    const size_t round = (size_t)U * grid * THREADS;
    const double tb = tbps(words / round * round * 16, [&] { stream_read<U><<<grid, THREADS>>>(buf, words, sink); });
    print_cell(tb, resident_blocks(stream_read<U>, blocks), U * 16);
}

template <int U>
void chunk_cell(const uint4* buf, const u32* order, int chunks, int chunk_bytes, int blocks, int sms, u32* sink) {
    const int grid = blocks * sms, warps = grid * (THREADS / 32);
    const size_t read = (size_t)chunks / ((size_t)U * warps) * ((size_t)U * warps) * chunk_bytes;
    const double tb =
        tbps(read, [&] { chunk_read<U><<<grid, THREADS>>>(buf, order, chunks, chunk_bytes / 16, sink); });
    // A lane has 4 words of each of its U chunks in flight.
    print_cell(tb, resident_blocks(chunk_read<U>, blocks), U * 4 * 16);
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int clock_khz = 0, mem_khz = 0, bus = 0;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    CK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, 0));
    CK(cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, 0));
    const int sms = prop.multiProcessorCount;
    printf("%s: %d SMs, SM clock %d MHz, memory %d MHz x %d bits, L2 %d MB\n", prop.name, sms, clock_khz / 1000,
           mem_khz / 1000, bus, prop.l2CacheSize >> 20);

    const size_t bytes = (size_t)8 << 30;  // 8 GiB: reads never come from L2
    uint4* buf;
    u32* sink;
    CK(cudaMalloc(&buf, bytes));
    CK(cudaMalloc(&sink, 4));
    fill_random<<<4 * sms, 256>>>(reinterpret_cast<bf16*>(buf), bytes / 2, 7, 1.0f);
    CK(cudaDeviceSynchronize());
    const size_t words = bytes / 16;

    printf("\nEach cell: TB/s / KB in flight per SM (the blocks that fit, times their loads in flight).\n");
    printf("\nstream: rows are blocks of %d threads per SM asked for, columns 16-byte loads in flight a thread\n",
           THREADS);
    printf("%-10s %10s %10s %10s %10s\n", "blocks/SM", "U=1", "U=2", "U=4", "U=8");
    for (int b : {1, 2, 4, 8}) {
        printf("%-10d", b);
        stream_cell<1>(buf, words, b, sms, sink);
        stream_cell<2>(buf, words, b, sms, sink);
        stream_cell<4>(buf, words, b, sms, sink);
        stream_cell<8>(buf, words, b, sms, sink);
        printf("\n");
    }

    for (int chunk_bytes : {2048, 4096, 16384}) {
        const int chunks = (int)(bytes / chunk_bytes);
        std::vector<u32> order(chunks);
        for (int i = 0; i < chunks; i++) order[i] = i;
        std::shuffle(order.begin(), order.end(), std::mt19937(1));
        u32* d_order;
        CK(cudaMalloc(&d_order, chunks * sizeof(u32)));
        CK(cudaMemcpy(d_order, order.data(), chunks * sizeof(u32), cudaMemcpyHostToDevice));
        printf("\nchunks of %d bytes in random order: rows blocks per SM, columns chunks in flight a warp\n",
               chunk_bytes);
        printf("%-10s %10s %10s %10s\n", "blocks/SM", "U=1", "U=2", "U=4");
        for (int b : {2, 4, 8}) {
            printf("%-10d", b);
            chunk_cell<1>(buf, d_order, chunks, chunk_bytes, b, sms, sink);
            chunk_cell<2>(buf, d_order, chunks, chunk_bytes, b, sms, sink);
            chunk_cell<4>(buf, d_order, chunks, chunk_bytes, b, sms, sink);
            printf("\n");
        }
        CK(cudaFree(d_order));
    }
    CK(cudaFree(buf));
    CK(cudaFree(sink));
    return 0;
}
