//! x86 SIMD plumbing for the CPU matmul kernels: an instruction-set trait (AVX2/FMA with 8 f32 lanes,
//! AVX-512 with 16) and a weight-format trait (f32, bf16, int8, and blocks of 4- or 8-bit integers with an f16
//! or f32 scale and minimum) whose loads widen stored weights to f32 lanes in registers. Kernels written over both traits
//! are compiled once per pair inside a `#[target_feature]` function and chosen at run time.

#[cfg(target_arch = "x86_64")]
pub(super) use imp::*;

#[cfg(not(target_arch = "x86_64"))]
pub fn avx2_available() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub fn avx512_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
mod imp {
    use super::super::cpu_matmul::PANEL;
    use std::arch::x86_64::*;

    /// AVX2 with FMA and F16C (every AVX2 CPU has the other two; the blocked format's scales are f16).
    pub fn avx2_available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }

    pub fn avx512_available() -> bool {
        avx2_available() && is_x86_feature_detected!("avx512f")
    }

    /// A SIMD instruction set: vectors of `LANES` f32. Every method is `inline(always)` so it compiles with
    /// the target features of the kernel it is inlined into.
    pub trait Isa {
        type V: Copy;
        const LANES: usize;
        unsafe fn zero() -> Self::V;
        unsafe fn load(p: *const f32) -> Self::V;
        unsafe fn load_bf16(p: *const u16) -> Self::V;
        unsafe fn load_i8(p: *const i8) -> Self::V;
        /// `LANES` bytes from `p`, each byte's high nibble when `high`, else its low one.
        unsafe fn load_u4(p: *const u8, high: bool) -> Self::V;
        /// `LANES` f16 bit patterns.
        unsafe fn load_f16(p: *const u16) -> Self::V;
        /// Every lane `*p`.
        unsafe fn broadcast(p: *const f32) -> Self::V;
        /// Every lane `x`.
        unsafe fn splat(x: f32) -> Self::V;
        unsafe fn store(p: *mut f32, v: Self::V);
        /// The first `count` lanes of `v` (at most `LANES`) to `p`: a whole store when all of them.
        #[inline(always)]
        unsafe fn store_first(p: *mut f32, v: Self::V, count: usize) {
            if count == Self::LANES {
                Self::store(p, v);
            } else if count > 0 {
                let mut lanes = [0.0f32; 16];
                Self::store(lanes.as_mut_ptr(), v);
                std::ptr::copy_nonoverlapping(lanes.as_ptr(), p, count);
            }
        }
        /// `a * b + c`.
        unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
        unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
        unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    }

    pub struct Avx2;

    impl Isa for Avx2 {
        type V = __m256;
        const LANES: usize = 8;

        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }

        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }

        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m256 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()))))
        }

        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> __m256 {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
        }

        #[inline(always)]
        unsafe fn load_u4(p: *const u8, high: bool) -> __m256 {
            let bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
            let shifted = _mm256_srl_epi32(bytes, _mm_cvtsi32_si128(4 * high as i32));
            _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(0x0F)))
        }

        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        }

        #[inline(always)]
        unsafe fn broadcast(p: *const f32) -> __m256 {
            _mm256_broadcast_ss(&*p)
        }

        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }

        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }

        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }

        #[inline(always)]
        unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }

        #[inline(always)]
        unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
    }

    pub struct Avx512;

    impl Isa for Avx512 {
        type V = __m512;
        const LANES: usize = 16;

        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }

        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }

        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))
        }

        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> __m512 {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
        }

        #[inline(always)]
        unsafe fn load_u4(p: *const u8, high: bool) -> __m512 {
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
            let shifted = _mm512_srl_epi32(bytes, _mm_cvtsi32_si128(4 * high as i32));
            _mm512_cvtepi32_ps(_mm512_and_si512(shifted, _mm512_set1_epi32(0x0F)))
        }

        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
        }

        #[inline(always)]
        unsafe fn broadcast(p: *const f32) -> __m512 {
            _mm512_set1_ps(*p)
        }

        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }

        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }

        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }

        #[inline(always)]
        unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }

        #[inline(always)]
        unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
    }

    /// A stored weight format: how `LANES` stored weights of one k step become f32 lanes, and what happens to
    /// a finished vector of dot products (int8 scales it). A format may share constants over a group of k steps
    /// (a block's scale and minimum): the kernel asks for them once per group and hands them to every load.
    pub trait Format: Copy {
        type Elem: Copy;
        /// What the loads of weight rows `c..c + LANES` need within one group of k steps.
        type Group<I: Isa>: Copy;
        /// Stored elements per k step of a panel.
        const STEP: usize = PANEL;
        /// Whether the kernel widens a panel to f32 with `load` once for many rows: for a format whose `load`
        /// costs several instructions and gives the weights themselves (a format with a `finish` does not).
        const WIDEN: bool = false;
        /// Where weight row `c` of a panel (`c % PANEL`) starts within a k step's elements.
        #[inline(always)]
        fn at(c: usize) -> usize {
            c
        }
        /// Whether k step `p` starts a new group (the kernel asks at multiples of 4 only).
        #[inline(always)]
        fn starts_group(self, _p: usize) -> bool {
            false
        }
        /// The group of weight rows `c..c + LANES` at k step `p` (of `k`).
        unsafe fn group<I: Isa>(self, c: usize, p: usize, k: usize) -> Self::Group<I>;
        /// Weight rows `c..c + LANES` (`c` within the panel) of one k step, from `p` = the step + `at(c)`.
        unsafe fn load<I: Isa>(p: *const Self::Elem, c: usize, group: Self::Group<I>) -> I::V;
        /// The finished dot products of weight rows `c..c + LANES`.
        #[inline(always)]
        unsafe fn finish<I: Isa>(self, _c: usize, v: I::V) -> I::V {
            v
        }
    }

    #[derive(Clone, Copy)]
    pub struct F32;

    impl Format for F32 {
        type Elem = f32;
        type Group<I: Isa> = ();

        #[inline(always)]
        unsafe fn group<I: Isa>(self, _c: usize, _p: usize, _k: usize) {}

        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const f32, _c: usize, _: ()) -> I::V {
            I::load(p)
        }
    }

    #[derive(Clone, Copy)]
    pub struct Bf16;

    impl Format for Bf16 {
        type Elem = u16;
        type Group<I: Isa> = ();

        #[inline(always)]
        unsafe fn group<I: Isa>(self, _c: usize, _p: usize, _k: usize) {}

        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const u16, _c: usize, _: ()) -> I::V {
            I::load_bf16(p)
        }
    }

    /// Per-row scales (padded like the rows): the integer-weight dot products are scaled once at the end.
    #[derive(Clone, Copy)]
    pub struct Int8(pub *const f32);

    impl Format for Int8 {
        type Elem = i8;
        type Group<I: Isa> = ();

        #[inline(always)]
        unsafe fn group<I: Isa>(self, _c: usize, _p: usize, _k: usize) {}

        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const i8, _c: usize, _: ()) -> I::V {
            I::load_i8(p)
        }

        #[inline(always)]
        unsafe fn finish<I: Isa>(self, c: usize, v: I::V) -> I::V {
            I::mul(v, I::load(self.0.add(c)))
        }
    }

    /// A block constant as stored: an f16 bit pattern or an f32.
    pub trait Constant: Copy {
        /// `LANES` constants from `p`, as f32.
        unsafe fn load<I: Isa>(p: *const Self) -> I::V;
    }

    impl Constant for u16 {
        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const u16) -> I::V {
            I::load_f16(p)
        }
    }

    impl Constant for f32 {
        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const f32) -> I::V {
            I::load(p)
        }
    }

    /// Where the kernel finds a group's scales and minimums.
    pub trait GroupConstants: Copy {
        /// The scales and minimums of weight rows `c..c + LANES` at k step `p` (of `k`), in groups of `group`.
        unsafe fn get<I: Isa>(self, c: usize, p: usize, k: usize, group: usize) -> (I::V, I::V);
    }

    /// Stored per group at `cpu_matmul::block_param_index`; `mins` is null where every minimum is -0.0
    /// (nothing stored, nothing streamed).
    #[derive(Clone, Copy)]
    pub struct Stored<C: Constant> {
        pub scales: *const C,
        pub mins: *const C,
    }

    impl<C: Constant> Stored<C> {
        pub fn new(scales: &[C], mins: &[C]) -> Self {
            Stored { scales: scales.as_ptr(), mins: if mins.is_empty() { std::ptr::null() } else { mins.as_ptr() } }
        }
    }

    impl<C: Constant> GroupConstants for Stored<C> {
        #[inline(always)]
        unsafe fn get<I: Isa>(self, c: usize, p: usize, k: usize, group: usize) -> (I::V, I::V) {
            let at = super::super::cpu_matmul::block_param_index(c, p, k, group);
            let min = if self.mins.is_null() { I::splat(-0.0) } else { C::load::<I>(self.mins.add(at)) };
            (C::load::<I>(self.scales.add(at)), min)
        }
    }

    /// A factor per super-block of `super_group` k steps times an integer step per group, as
    /// `cpu_matmul::Constants::Factored` lays them out; the f32 product is the constant exactly. `min_steps` is
    /// null where every minimum is -0.0.
    #[derive(Clone, Copy)]
    pub struct Factored {
        pub scale_factors: *const f32,
        pub scale_steps: *const i8,
        pub min_factors: *const f32,
        pub min_steps: *const i8,
        pub super_group: usize,
    }

    impl Factored {
        pub fn new(scale_factors: &[f32], scale_steps: &[i8], min_factors: &[f32], min_steps: &[i8], super_group: usize) -> Self {
            Factored {
                scale_factors: scale_factors.as_ptr(),
                scale_steps: scale_steps.as_ptr(),
                min_factors: min_factors.as_ptr(),
                min_steps: if min_steps.is_empty() { std::ptr::null() } else { min_steps.as_ptr() },
                super_group,
            }
        }
    }

    impl GroupConstants for Factored {
        #[inline(always)]
        unsafe fn get<I: Isa>(self, c: usize, p: usize, k: usize, group: usize) -> (I::V, I::V) {
            use super::super::cpu_matmul::block_param_index;
            let (at, sup) = (block_param_index(c, p, k, group), block_param_index(c, p, k, self.super_group));
            let scale = I::mul(I::load(self.scale_factors.add(sup)), I::load_i8(self.scale_steps.add(at)));
            let min = if self.min_steps.is_null() {
                I::splat(-0.0)
            } else {
                I::mul(I::load(self.min_factors.add(sup)), I::load_i8(self.min_steps.add(at)))
            };
            (scale, min)
        }
    }

    /// Groups of `group` k steps (a power of two, a multiple of 4): `w = fma(q, scale, min)` with the group's
    /// scale and minimum per weight row, from `constants`. One fused multiply-add gives exactly the f32 weight it
    /// stands for (see `cpu_matmul::pack_blocks`).
    #[derive(Clone, Copy)]
    pub struct Blocks<S: GroupConstants> {
        pub constants: S,
        pub group: usize,
    }

    impl<S: GroupConstants> Format for Blocks<S> {
        type Elem = i8;
        type Group<I: Isa> = (I::V, I::V);
        const WIDEN: bool = true;

        #[inline(always)]
        fn starts_group(self, p: usize) -> bool {
            p & (self.group - 1) == 0
        }

        #[inline(always)]
        unsafe fn group<I: Isa>(self, c: usize, p: usize, k: usize) -> (I::V, I::V) {
            self.constants.get::<I>(c, p, k, self.group)
        }

        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const i8, _c: usize, (scale, min): (I::V, I::V)) -> I::V {
            I::fma(I::load_i8(p), scale, min)
        }
    }

    /// [`Blocks`] with 4-bit values, two per byte, as `cpu_matmul::Levels::Nibbles` lays them out: byte `j`
    /// of a k step holds weight rows `j` (low nibble) and `j + PANEL / 2` (high nibble) of the panel. A `SIGNED`
    /// level is its nibble minus 8 (exact in f32), so levels -8..=7 (Q4_0's) take nibbles too.
    #[derive(Clone, Copy)]
    pub struct Nibbles<S: GroupConstants, const SIGNED: bool>(pub Blocks<S>);

    impl<S: GroupConstants, const SIGNED: bool> Format for Nibbles<S, SIGNED> {
        type Elem = u8;
        type Group<I: Isa> = (I::V, I::V);
        const STEP: usize = PANEL / 2;
        const WIDEN: bool = true;

        #[inline(always)]
        fn at(c: usize) -> usize {
            c % (PANEL / 2)
        }

        #[inline(always)]
        fn starts_group(self, p: usize) -> bool {
            self.0.starts_group(p)
        }

        #[inline(always)]
        unsafe fn group<I: Isa>(self, c: usize, p: usize, k: usize) -> (I::V, I::V) {
            self.0.group::<I>(c, p, k)
        }

        #[inline(always)]
        unsafe fn load<I: Isa>(p: *const u8, c: usize, (scale, min): (I::V, I::V)) -> I::V {
            let nibbles = I::load_u4(p, c >= PANEL / 2);
            let levels = if SIGNED { I::add(nibbles, I::splat(-8.0)) } else { nibbles };
            I::fma(levels, scale, min)
        }
    }
}
