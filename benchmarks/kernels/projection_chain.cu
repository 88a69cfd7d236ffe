// An experiment, not part of the runtime (measured slower; benchmarks/RESULTS.md, 2026-12-03): several dependent
// small-batch projections in one kernel (sm_90 and newer), namely the part of a decoder layer after its
// attention at decode batch sizes (O adding into the residual, the MLP's gate/up with its norm and SiLU, down
// adding into the residual) and the next layer's QKV with its norm. Built into gemv_chain.cu, which times it.
//
// The idea: as separate kernels (kernels/gemv_bulk.cu) each projection can only start loading its weights once
// the kernel before it has started its own work, so the weight stream runs at most one projection ahead. Here
// one block per multiprocessor streams the weight rows it owns in every phase, in order, through one ring of
// shared-memory slots: the copies of later phases are in flight while earlier phases compute and while the
// blocks wait for each other, and the first ring's worth is issued before the kernel waits for the attention
// before it. Between phases the blocks meet at a grid barrier (each phase reads the whole output of the one
// before). The grid must be resident at once: one block per multiprocessor, launched with gridDim.x equal to
// the multiprocessor count, and nothing this kernel waits for can hold a multiprocessor forever.
//
// What the measurement showed: the projections at batch 1 are bound by their chain of dependent round trips,
// not by the weight stream, and a grid barrier (fence, atomic, polling) costs more than the kernel boundary it
// replaces; a layer took 27.0 µs against 23.8 µs as four kernels.
//
// Each phase is a projection of kernels/gemv_bulk.cu (same prologues, epilogues and roundings, so the outputs
// are bit-identical to running them one by one).
#include "gemv_bulk.cuh"

#define CHAIN_MAX_PHASES 4
// Most ring slots a launch may ask for.
#define CHAIN_MAX_SLOTS 16

struct ChainPhase {
    const bf16* x;  // [M, k]
    const float* norm_w;  // IN_NORM: [k]
    const bf16* w;  // [n, k] (OUT_SILU: [gate | up], n the full height)
    const float* bias;  // [n] or null
    bf16* y;  // [M, n] ([M, n / 2] for OUT_SILU)
    int n, k;
    int in, out;  // IN_*, OUT_* of gemv_common.cuh
    int stage_cols;  // output columns per ring slot (the host fits them to the slot)
};

struct Chain {
    ChainPhase phase[CHAIN_MAX_PHASES];
    int phases;
    float eps;
    // Grid barrier: a counter that only grows (every launch adds a multiple of gridDim.x), zero at allocation.
    unsigned long long* arrivals;
    int slot_bytes, slots;
};

extern __shared__ __align__(16) unsigned char chain_smem[];

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Every block arrives, then waits until all gridDim.x blocks of this barrier have. Tickets of one barrier are
// consecutive (no block can arrive at the next barrier before this one is complete), so the first ticket's
// multiple of gridDim.x names it.
__device__ __forceinline__ void grid_barrier(unsigned long long* arrivals) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned long long ticket = atomicAdd(arrivals, 1ull);
        const unsigned long long done = (ticket / gridDim.x + 1) * gridDim.x;
        while (load_acquire(arrivals) < done) {
        }
        __threadfence();
    }
    __syncthreads();
}

// The block's columns of one phase: [first, last), in stages of p.stage_cols.
struct PhaseSpan {
    int first, last, stages;
    __device__ __forceinline__ explicit PhaseSpan(const ChainPhase& p) {
        const int cols = p.out == OUT_SILU ? p.n / 2 : p.n;
        first = (int)((long long)blockIdx.x * cols / gridDim.x);
        last = (int)((long long)(blockIdx.x + 1) * cols / gridDim.x);
        stages = (last - first + p.stage_cols - 1) / p.stage_cols;
    }
};

// Issue the copies of the chain's stage g (counted over all phases in order) into ring slot g % slots.
__device__ void issue_stage(const Chain& c, int g, unsigned char* ring, unsigned long long* full) {
    int p = 0, s = g;  // phase p's stage s
    PhaseSpan span(c.phase[0]);
    while (s >= span.stages) {
        s -= span.stages;
        span = PhaseSpan(c.phase[++p]);
    }
    const ChainPhase& ph = c.phase[p];
    const int c0 = span.first + s * ph.stage_cols, n = min(ph.stage_cols, span.last - c0);
    unsigned char* dst = ring + (size_t)(g % c.slots) * c.slot_bytes;
    if (ph.out == OUT_SILU)
        copy_stage_rows<2>(dst, &full[g % c.slots], ph.w, ph.n / 2, ph.k, c0, n, ph.stage_cols);
    else
        copy_stage_rows<1>(dst, &full[g % c.slots], ph.w, ph.n, ph.k, c0, n, ph.stage_cols);
}

template <int M>
__device__ void stage_phase_input(const ChainPhase& p, float eps, bf16* xs, float* inv) {
    if (p.in == IN_NORM)
        stage_input<M, IN_NORM>(p.x, p.norm_w, eps, p.k, xs, inv);
    else
        stage_input<M, IN_PLAIN>(p.x, p.norm_w, eps, p.k, xs, inv);
}

template <int M>
__device__ void phase_stage_product(const ChainPhase& p, const uint4* stage, int n, const uint4* xv, int c0) {
    const int chunks = p.k / 8;
    const OldFromL2 old{p.y, p.n};
    switch (p.out) {
        case OUT_SILU: stage_product<M, OUT_SILU>(stage, p.stage_cols, n, xv, chunks, p.bias, p.y, p.n / 2, c0, old); break;
        case OUT_ADD: stage_product<M, OUT_ADD>(stage, p.stage_cols, n, xv, chunks, p.bias, p.y, p.n, c0, old); break;
        default: stage_product<M, OUT_STORE>(stage, p.stage_cols, n, xv, chunks, p.bias, p.y, p.n, c0, old); break;
    }
}
#endif

// grid: the multiprocessor count, one block each (see above); block: BULK_THREADS. Dynamic shared memory: the
// input rows (M * the largest k * 2 bytes, rounded up to 16), then `slots` slots of `slot_bytes`. Every phase's
// k % 8 == 0 and stage_cols rows (two per column for OUT_SILU) of it fit in a slot.
template <int M>
__device__ void projection_chain(const Chain& c) {
#if __CUDA_ARCH__ >= 900
    __shared__ float inv[M];
    __shared__ unsigned long long full[CHAIN_MAX_SLOTS];
    int widest = 0, total = 0;
    for (int p = 0; p < c.phases; p++) {
        widest = max(widest, c.phase[p].k);
        total += PhaseSpan(c.phase[p]).stages;
    }
    bf16* xs = reinterpret_cast<bf16*>(chain_smem);
    unsigned char* ring = chain_smem + ((M * widest * 2 + 15) & ~15);
    if (threadIdx.x == 0) {
        for (int i = 0; i < c.slots; i++) mbar_init(&full[i], 1);
        fence_barrier_init();
        for (int g = 0; g < min(c.slots, total); g++) issue_stage(c, g, ring, full);
    }
    kernel_begin();

    int g = 0;  // the chain's next stage
    for (int p = 0; p < c.phases; p++) {
        const ChainPhase& ph = c.phase[p];
        if (p > 0) grid_barrier(c.arrivals);  // phase p reads what every block wrote in phase p - 1
        stage_phase_input<M>(ph, c.eps, xs, inv);  // its barriers also publish the initialized stage barriers
        const PhaseSpan span(ph);
        for (int s = 0; s < span.stages; s++, g++) {
            const int c0 = span.first + s * ph.stage_cols, n = min(ph.stage_cols, span.last - c0);
            mbar_wait(&full[g % c.slots], (g / c.slots) & 1);
            const uint4* stage = reinterpret_cast<const uint4*>(ring + (size_t)(g % c.slots) * c.slot_bytes);
            phase_stage_product<M>(ph, stage, n, reinterpret_cast<const uint4*>(xs), c0);
            __syncthreads();  // every warp is done with this slot
            if (threadIdx.x == 0 && g + c.slots < total) {
                fence_async_shared();
                issue_stage(c, g + c.slots, ring, full);
            }
        }
    }
#endif
}

#define PROJECTION_CHAIN_VARIANT(M)                                                                \
    extern "C" __global__ void __launch_bounds__(BULK_THREADS, 1) projection_chain_m##M(const Chain c) { \
        projection_chain<M>(c);                                                                    \
    }

PROJECTION_CHAIN_VARIANT(1)
PROJECTION_CHAIN_VARIANT(2)
PROJECTION_CHAIN_VARIANT(3)
PROJECTION_CHAIN_VARIANT(4)
