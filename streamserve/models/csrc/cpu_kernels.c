/* The CPU path's C kernels, built and loaded by cpu_kernels.py. Needs AVX2 + FMA (+ F16C).
 *
 * gemm_packed_bf16 / f16 / f32: y = x @ w.T for every CPU step, x float32 [M, K], w packed in
 * panels of 16 rows (see the section below), bfloat16 and float16 weights widened in registers:
 * half the bytes of float32 weights for the steps of a few tokens, which are bound by reading
 * the weights, and unlike oneDNN's emulated bfloat16 path on CPUs without AVX512-BF16, no extra
 * passes over memory. Larger steps are bound by the FMA units, which the panel tiles keep busy.
 *
 * gemv_q4_0 / q4_1 / q8_0 / q4_k: the same product over GGUF's quantized blocks, taken in
 * integers against the vectors scaled to int16 per block (see the section below), for the
 * smallest steps of a quantized model (models/quantized.py); from QUANT_STRIP_MIN_ROWS vectors
 * on, over strips of rows dequantized as they are read, for every step of a layer that keeps
 * only its blocks.
 *
 * rms_norm_f32: RMSNorm over rows of float32, optionally adding the residual first (in
 * place, like the Triton kernel): one call instead of the eight small torch ops it
 * takes in Python, each of which costs more in dispatch than the arithmetic.
 *
 * paged_decode_attention: the decode rows' attention read straight from the paged cache (float32
 * or float16), where torch first gathers every sequence's blocks into a padded copy and masks it.
 *
 * paged_prefill_attention: the prefill chunks' causal attention, likewise in place, in tiles
 * of keys shared by 48 query vectors at a time (96 with AVX-512).
 *
 * step_forward_f32: a whole step (up to a few hundred tokens) through every layer of a Llama-family model.
 *
 * Built with -march=native: where the CPU has AVX-512, the packed GEMM takes 512-bit tiles and
 * the prefill attention 512-bit lanes (twice the FMA width; the rest stays on 256-bit vectors);
 * where it has AVX512-BF16 too, the bfloat16 GEMM of steps of a few rows and up takes bfloat16
 * dot products (twice the arithmetic again; x rounded to bfloat16), and so does the prefill
 * attention where asked (a bfloat16 checkpoint's: q, K, V and the softmax's weights rounded).
 */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

static inline __m256 widen_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The largest of v's lanes (a NaN lane may or may not win). */
static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- Float weights, packed in panels -------------------------------------------------------
 *
 * gemm_packed_{bf16,f16,f32}: y = x @ w.T, x float32 [M, K], y float32 [M, N], with w [N, K]
 * packed (cpu_kernels.py: pack_weight) into panels of 16 rows, k-major, the last panel padded
 * with zeros: float16 and float32 ones [ceil(N / 16), K, 16], each 16 weights of one k side by
 * side; bfloat16 ones [ceil(N / 16), K / 2, 16, 2] (K even: the Python side pads an odd K), the
 * 16 rows' weights of k and k + 1 as pairs, one pair a 32-bit lane, rows in order (the layout
 * AMX and VDPBF16PS take as it is; a shift or a mask widens a pair's k or k + 1 into float32).
 * For MR rows of x at a time, the tile takes each k as a broadcast of x[m, k] times the panel's
 * 16 weights of that k as two vectors of 8 float32, into 2 x MR accumulators that are the
 * outputs themselves (no horizontal sums), 12 of the 16 registers at MR = 6: per k, 12 FMAs
 * against 7 loads, so the FMA units set the pace. On this project's 2-core AVX2 machine that is
 * ~85% of the cores' FMA peak from 16 rows of x up, where the dot-product tiles it replaced
 * (rows of w against vectors of x, with a horizontal sum each) reached ~63% and torch's float32
 * GEMM ~65% (scripts/bench_gemv.py). One token reads every weight once, as before, so a
 * single-token step stays bound by memory. */
#define PANEL 16

/* Whether a thread reads its share of a small step's weights as several streams at once (rows of
 * w in threes, panels in pairs: fewer loads and broadcasts of x a weight) or as one (a row or a
 * panel at a time, which the prefetchers of AMD's cores keep up with better). One stream: on a
 * 2-core Zen 3 the default model's Q4_1 step of one vector ran 1.09-1.23x faster, and on a 2-core
 * Zen 5 the bfloat16 step of 1-12 rows 1.08-1.18x (2026-12-01/02). Several: on a 2-core Sapphire
 * Rapids Xeon (2026-12-03, scripts/ab_cpu_kernels.py --kernel gemv-step, builds alternating, two
 * runs each) the Q4_1 step of one vector 1.16-1.22x faster, of two 1.14x, the bfloat16 step of one
 * row 1.12-1.18x, of four 1.09-1.13x. So: several on Intel's cores, one elsewhere
 * (cpu_kernels_set_several_streams sets it, for tests). */
static int several_streams;

__attribute__((constructor)) static void streams_choose(void) {
    __builtin_cpu_init();
    several_streams = __builtin_cpu_is("intel");
}

int cpu_kernels_several_streams(void) { return several_streams; }

void cpu_kernels_set_several_streams(int on) { several_streams = on != 0; }

#define PANEL_MR 6
/* How far ahead, in k, a tile asks for its panel's weights (a hint: past the end it never faults):
 * 6 KB of bf16. On the Zen 5 EPYC's cores (2026-12-02, this AVX2 build, scripts/ab_gemv_step.c's
 * bf16 step against no prefetch, builds alternating) 1.24x at 1 row of x, 1.39x at 4, 1.83x at 8,
 * 1.45x at 16; 96 k gave 1.15-1.68x. (Not measured on a CPU that has only AVX2.) */
#define PANEL_AHEAD 192

/* A bfloat16 panel's weights of k + s (s 0 or 1) from its pairs of k and k + 1 at p: rows 0-7
 * (lo) and 8-15 (hi), widened by a shift (the pair's low half) or a mask (its high half). */
static inline void panel_bf16(const uint16_t *p, int s, __m256 *lo, __m256 *hi) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 16));
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000);
    *lo = _mm256_castsi256_ps(s ? _mm256_and_si256(a, high) : _mm256_slli_epi32(a, 16));
    *hi = _mm256_castsi256_ps(s ? _mm256_and_si256(b, high) : _mm256_slli_epi32(b, 16));
}

static inline void panel_f16(const uint16_t *p, int s, __m256 *lo, __m256 *hi) {
    (void)s, *lo = widen_f16(p), *hi = widen_f16(p + 8);
}

static inline void panel_f32(const float *p, int s, __m256 *lo, __m256 *hi) {
    (void)s, *lo = _mm256_loadu_ps(p), *hi = _mm256_loadu_ps(p + 8);
}

/* The accumulators as named variables (in an array, GCC stored them to the stack every k). */
#define PANEL_FMA(i, kk)                                                                          \
    if (MR > i) {                                                                                 \
        const __m256 b = _mm256_broadcast_ss(x + i * K + (kk));                                   \
        c##i##0 = _mm256_fmadd_ps(b, lo, c##i##0), c##i##1 = _mm256_fmadd_ps(b, hi, c##i##1);    \
    }
#define PANEL_STORE(i)                                                                            \
    if (MR > i) {                                                                                 \
        if (cols == PANEL) {                                                                      \
            _mm256_storeu_ps(y + i * N, c##i##0), _mm256_storeu_ps(y + i * N + 8, c##i##1);       \
        } else {                                                                                  \
            float t[PANEL];                                                                       \
            _mm256_storeu_ps(t, c##i##0), _mm256_storeu_ps(t + 8, c##i##1);                       \
            for (long j = 0; j < cols; j++) y[i * N + j] = t[j];                                  \
        }                                                                                         \
    }

/* MR (<= PANEL_MR, a constant at every call) rows of x (K apart) against one panel, into the
 * panel's `cols` columns of y (rows N apart), KSTEP k at a time: LOAD(p, s, &lo, &hi) the
 * panel's weights of k + s from the KSTEP k's at p. */
#define DEFINE_PANEL_TILE(NAME, T, LOAD, KSTEP)                                                   \
    static inline __attribute__((always_inline)) void NAME(                                       \
        const float *x, const T *w, float *y, long K, long N, long cols, const int MR) {           \
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;   \
        __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                   \
        for (long k = 0; k < K; k += KSTEP) {                                                     \
            _mm_prefetch((const char *)(w + (k + PANEL_AHEAD) * PANEL), _MM_HINT_T0);             \
            for (int s = 0; s < KSTEP; s++) {                                                     \
                __m256 lo, hi;                                                                    \
                LOAD(w + k * PANEL, s, &lo, &hi);                                                 \
                PANEL_FMA(0, k + s) PANEL_FMA(1, k + s) PANEL_FMA(2, k + s)                       \
                PANEL_FMA(3, k + s) PANEL_FMA(4, k + s) PANEL_FMA(5, k + s)                       \
            }                                                                                     \
        }                                                                                         \
        PANEL_STORE(0) PANEL_STORE(1) PANEL_STORE(2) PANEL_STORE(3) PANEL_STORE(4) PANEL_STORE(5) \
    }

/* Rows m .. m1 of x against the panel at wp, into y's columns n .. n + cols: tiles of PANEL_MR,
 * then what is left (x, y, K, N in scope too). */
#define PANEL_ROWS(NAME)                                                                          \
    for (; m + PANEL_MR <= m1; m += PANEL_MR) NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 6); \
    switch (m1 - m) {                                                                             \
    case 5: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 5); break;                      \
    case 4: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 4); break;                      \
    case 3: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 3); break;                      \
    case 2: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 2); break;                      \
    case 1: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 1); break;                      \
    }

/* Panels across the OpenMP threads (the same runtime torch uses), for rows of x in blocks of
 * 96 (a block's rows stay in the cache while every panel passes them). */
#define DEFINE_PACKED_GEMM(NAME, T, LOAD, KSTEP)                                                  \
    DEFINE_PANEL_TILE(NAME##_tile, T, LOAD, KSTEP)                                                \
    void NAME(const float *x, const T *w, float *y, long M, long N, long K) {                     \
        const long panels = (N + PANEL - 1) / PANEL;                                              \
        for (long m0 = 0; m0 < M; m0 += 16 * PANEL_MR) {                                          \
            const long m1 = m0 + 16 * PANEL_MR < M ? m0 + 16 * PANEL_MR : M;                      \
            _Pragma("omp parallel for schedule(static) if (panels > 1)")                          \
            for (long p = 0; p < panels; p++) {                                                   \
                const long n = p * PANEL, cols = N - n < PANEL ? N - n : PANEL;                   \
                const T *wp = w + n * K;                                                          \
                long m = m0;                                                                      \
                PANEL_ROWS(NAME)                                                                  \
            }                                                                                     \
        }                                                                                         \
    }

#ifndef __AVX512F__
DEFINE_PACKED_GEMM(gemm_packed_bf16, uint16_t, panel_bf16, 2)
DEFINE_PACKED_GEMM(gemm_packed_f16, uint16_t, panel_f16, 1)
DEFINE_PACKED_GEMM(gemm_packed_f32, float, panel_f32, 1)
#else
/* With AVX-512 (built with -march=native on such a CPU) the same layout, a panel's 16 weights
 * of one k in one 512-bit vector, and two panels at a time against up to 12 rows of x: 24 of
 * the 32 registers accumulate, per k 24 FMAs (each with its broadcast of x folded in) against
 * two loads of weights (a bfloat16 panel's: one load of a pair of k, widened by a shift for k
 * and by a mask for k + 1). */
#define PANEL_MR512 12
/* How far ahead, in k, a tile asks for its panels' weights: 3 KB a panel, about what the two cores
 * read from memory in a DRAM latency. A step of a few tokens waits on memory, and neither the
 * hardware's prefetchers nor the out-of-order window run far enough ahead: on a 2-core Zen 5
 * EPYC (2026-12-02, scripts/ab_gemv_step.c's bf16 step, builds alternating) 96 k against the
 * 16 k before ran 1.12x faster at 1 row of x, 1.42x at 4, 1.19x at 8, 1.30-1.40x at 12 and 16,
 * 1.18x at 32, 1.07x at 64 (48, 64 and 128 k: within a few percent of 96, below it mostly). */
#define PANEL512_AHEAD 96
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BF16_DOT 1
#endif

static inline __m512 panel512_bf16(const uint16_t *p, int s) {
    const __m512i v = _mm512_loadu_si512(p);
    return _mm512_castsi512_ps(s ? _mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)) : _mm512_slli_epi32(v, 16));
}

static inline __m512 panel512_f16(const uint16_t *p, int s) {
    return (void)s, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline __m512 panel512_f32(const float *p, int s) { return (void)s, _mm512_loadu_ps(p); }

#define PANEL512_FMA(i, kk, BCAST, MADD)                                                          \
    if (MR > i) {                                                                                 \
        const __m512 b = BCAST(x + i * K + (kk));                                                 \
        c##i##_0 = MADD(c##i##_0, b, w0);                                                         \
        if (NP > 1) c##i##_1 = MADD(c##i##_1, b, w1);                                             \
    }
#define PANEL512_STORE(i)                                                                         \
    if (MR > i) {                                                                                 \
        _mm512_mask_storeu_ps(y + i * N, mask0, c##i##_0);                                        \
        if (NP > 1) _mm512_mask_storeu_ps(y + i * N + PANEL, mask1, c##i##_1);                    \
    }

/* MR (<= PANEL_MR512) rows of x (XT, K apart) against NP (1 or 2) panels (K * PANEL apart),
 * into the panels' `cols` columns of y (rows N apart), KSTEP k at a time in SUB parts: per part
 * s, LOAD(p, s) a panel's weights from its KSTEP k's at p, BCAST(p) a row's x from p and
 * MADD(c, b, w) c + b w. */
#define DEFINE_PANEL512_TILE(NAME, T, XT, LOAD, BCAST, MADD, KSTEP, SUB)                          \
    static inline __attribute__((always_inline)) void NAME(                                       \
        const XT *x, const T *w, float *y, long K, long N, long cols, const int MR, const int NP) { \
        __m512 c0_0 = _mm512_setzero_ps(), c0_1 = c0_0, c1_0 = c0_0, c1_1 = c0_0, c2_0 = c0_0;     \
        __m512 c2_1 = c0_0, c3_0 = c0_0, c3_1 = c0_0, c4_0 = c0_0, c4_1 = c0_0, c5_0 = c0_0;       \
        __m512 c5_1 = c0_0, c6_0 = c0_0, c6_1 = c0_0, c7_0 = c0_0, c7_1 = c0_0, c8_0 = c0_0;       \
        __m512 c8_1 = c0_0, c9_0 = c0_0, c9_1 = c0_0, c10_0 = c0_0, c10_1 = c0_0, c11_0 = c0_0;    \
        __m512 c11_1 = c0_0;                                                                      \
        const T *v = w + K * PANEL;                                                               \
        for (long k = 0; k < K; k += KSTEP) {                                                     \
            /* PANEL512_AHEAD k on (a hint: past the end it never faults) */                      \
            _mm_prefetch((const char *)(w + (k + PANEL512_AHEAD) * PANEL), _MM_HINT_T0);          \
            if (NP > 1) _mm_prefetch((const char *)(v + (k + PANEL512_AHEAD) * PANEL), _MM_HINT_T0); \
            for (int s = 0; s < SUB; s++) {                                                       \
                const __m512 w0 = LOAD(w + k * PANEL, s), w1 = NP > 1 ? LOAD(v + k * PANEL, s) : w0; \
                PANEL512_FMA(0, k + s, BCAST, MADD) PANEL512_FMA(1, k + s, BCAST, MADD)           \
                PANEL512_FMA(2, k + s, BCAST, MADD) PANEL512_FMA(3, k + s, BCAST, MADD)           \
                PANEL512_FMA(4, k + s, BCAST, MADD) PANEL512_FMA(5, k + s, BCAST, MADD)           \
                PANEL512_FMA(6, k + s, BCAST, MADD) PANEL512_FMA(7, k + s, BCAST, MADD)           \
                PANEL512_FMA(8, k + s, BCAST, MADD) PANEL512_FMA(9, k + s, BCAST, MADD)           \
                PANEL512_FMA(10, k + s, BCAST, MADD) PANEL512_FMA(11, k + s, BCAST, MADD)         \
            }                                                                                     \
        }                                                                                         \
        const long c0 = cols < PANEL ? cols : PANEL, c1 = cols - PANEL;                           \
        const __mmask16 mask0 = (__mmask16)((1u << c0) - 1), mask1 = (__mmask16)(c1 > 0 ? (1u << c1) - 1 : 0); \
        PANEL512_STORE(0) PANEL512_STORE(1) PANEL512_STORE(2) PANEL512_STORE(3) PANEL512_STORE(4) \
        PANEL512_STORE(5) PANEL512_STORE(6) PANEL512_STORE(7) PANEL512_STORE(8) PANEL512_STORE(9) \
        PANEL512_STORE(10) PANEL512_STORE(11)                                                     \
    }

#define PANEL512_ROWS(NAME, NP)                                                                   \
    for (; m + PANEL_MR512 <= m1; m += PANEL_MR512) NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, PANEL_MR512, NP); \
    switch (m1 - m) {                                                                             \
    case 11: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 11, NP); break;                \
    case 10: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 10, NP); break;                \
    case 9: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 9, NP); break;                  \
    case 8: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 8, NP); break;                  \
    case 7: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 7, NP); break;                  \
    case 6: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 6, NP); break;                  \
    case 5: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 5, NP); break;                  \
    case 4: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 4, NP); break;                  \
    case 3: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 3, NP); break;                  \
    case 2: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 2, NP); break;                  \
    case 1: NAME##_tile(x + m * K, wp, y + m * N + n, K, N, cols, 1, NP); break;                  \
    }

/* Pairs of panels across the OpenMP threads, the last one alone where their number is odd, each
 * against every row of x (on the CPUs that have AVX-512, x's rows fit the L2 cache, and blocks of
 * 96 rows measured the same); single panels where one tile takes all of x's rows (a step of at
 * most PANEL_MR512 tokens, bound by reading the weights) and a thread reads best as one stream
 * (several_streams: on the Zen 5 EPYC, 0.91x at 16 rows, where twice the broadcasts of x cost
 * more), or where there are fewer than two pairs a thread (many cores, few rows of w: the threads
 * then share the work more evenly). */
#define DEFINE_PACKED_GEMM512(NAME, T, XT, LOAD, BCAST, MADD, KSTEP, SUB)                         \
    DEFINE_PANEL512_TILE(NAME##_tile, T, XT, LOAD, BCAST, MADD, KSTEP, SUB)                       \
    void NAME(const XT *x, const T *w, float *y, long M, long N, long K) {                        \
        const long panels = (N + PANEL - 1) / PANEL, pairs = (panels + 1) / 2;                    \
        const long per = (M > PANEL_MR512 || several_streams) && pairs >= 2 * omp_get_max_threads() ? 2 : 1; \
        const long units = per == 2 ? pairs : panels;                                             \
        const long m1 = M;  /* PANEL512_ROWS's end */                                             \
        _Pragma("omp parallel for schedule(static) if (units > 1)")                               \
        for (long u = 0; u < units; u++) {                                                        \
            const long n = u * per * PANEL, cols = N - n < per * PANEL ? N - n : per * PANEL;     \
            const T *wp = w + n * K;                                                              \
            long m = 0;                                                                           \
            if (cols > PANEL) { PANEL512_ROWS(NAME, 2) } else { PANEL512_ROWS(NAME, 1) }          \
        }                                                                                         \
    }

#define BCAST_F32(p) _mm512_set1_ps(*(p))
#define FMADD512(c, b, w) _mm512_fmadd_ps(b, w, c)

/* (gemm_packed_bf16 below: with AVX512-BF16 it takes the larger steps' GEMMs itself) */
DEFINE_PACKED_GEMM512(gemm_packed_bf16_f32x, uint16_t, float, panel512_bf16, BCAST_F32, FMADD512, 2, 2)
DEFINE_PACKED_GEMM512(gemm_packed_f16, uint16_t, float, panel512_f16, BCAST_F32, FMADD512, 1, 1)
DEFINE_PACKED_GEMM512(gemm_packed_f32, float, float, panel512_f32, BCAST_F32, FMADD512, 1, 1)
#ifndef BF16_DOT
void gemm_packed_bf16(const float *x, const uint16_t *w, float *y, long M, long N, long K) {
    gemm_packed_bf16_f32x(x, w, y, M, N, K);
}
#endif
#endif

#ifdef BF16_DOT
/* With AVX512-BF16, steps of BF16_DOT_MIN_ROWS rows of x or more (bound by the arithmetic, not
 * by reading the weights) round x to bfloat16 and take the bfloat16 panels' pairs as they lie
 * with VDPBF16PS, which multiplies and adds pairs of bfloat16 into float32 lanes: twice the
 * products of an FMA per instruction. x's rounding is the only change to the arithmetic (what
 * torch's and oneDNN's bfloat16 GEMMs do to their inputs too); the products and sums stay
 * float32. Smaller steps keep x in float32. */
#define BF16_DOT_MIN_ROWS 6

/* The 32 bfloat16 of v as 16 pairs, one a 32-bit lane: lane i holds elements i and i + 16. */
static inline __m512 pair_halves(__m512i v) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_castsi512_ps(_mm512_permutexvar_epi16(pairs, v));
}

/* 16 pairs of bfloat16 (lo[i], hi[i]), rounded from two vectors of float32. */
static inline __m512 bf16_pairs(__m512 lo, __m512 hi) { return pair_halves((__m512i)_mm512_cvtne2ps_pbh(hi, lo)); }

static inline uint16_t bf16_bits(float x) {
    return (uint16_t)_mm_extract_epi16((__m128i)_mm_cvtneps_pbh(_mm_set1_ps(x)), 0);
}

static inline __m512 panel512_bf16_pairs(const uint16_t *p, int s) { return (void)s, _mm512_castsi512_ps(_mm512_loadu_si512(p)); }
#define BCAST_BF16_PAIR(p) _mm512_castsi512_ps(_mm512_set1_epi32(*(const int32_t *)(p)))
#define DPBF16(c, b, w) _mm512_dpbf16_ps(c, (__m512bh)(w), (__m512bh)(b))

DEFINE_PACKED_GEMM512(gemm_packed_bf16_dot, uint16_t, uint16_t, panel512_bf16_pairs, BCAST_BF16_PAIR, DPBF16, 2, 1)

/* x [M, K] float32 as bfloat16 rows K apart, the rows from M to `rows` zeros; NULL without memory. */
static uint16_t *bf16_rows(const float *x, long M, long K, long rows) {
    uint16_t *xb = malloc(rows * K * sizeof(uint16_t));
    if (xb == NULL) return NULL;
    const long n = M * K;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (long i = 0; i < n - n % 32; i += 32)
        _mm512_storeu_si512(xb + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
    for (long i = n - n % 32; i < n; i++) xb[i] = bf16_bits(x[i]);
    for (long i = n; i < rows * K; i++) xb[i] = 0;
    return xb;
}
#endif

#if defined(BF16_DOT) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* With AMX (Intel's tile registers: eight of 16 rows by 64 bytes), steps of AMX_MIN_ROWS rows of
 * x or more take TDPBF16PS: a tile of 16 rows of x's bfloat16 (32 k each) against a tile of a
 * panel's 16 pairs of k (the bfloat16 panel as it lies, 1 KB), into a tile of 16 x 16 float32
 * sums, 8192 multiply-adds an instruction. Four sum tiles, 32 rows of x by a pair of panels,
 * take each k's two tiles of x and two of weights (tiles 0-3 sums, 4-5 x, 6-7 weights). Same
 * arithmetic as VDPBF16PS (x rounded to bfloat16, products and sums float32). Needs K a
 * multiple of 32 (a tile's k), which the Llama family's widths are; else the dot products
 * serve. Linux gives a process the tiles' state only once it asks (arch_prctl), at load. */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#define AMX_MIN_ROWS 8
#define AMX_AHEAD 64
#define AMX_ROWS_AT_ONCE 512  /* rows of x every pair of panels passes before the next rows (in L2) */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_permitted;

__attribute__((constructor)) static void amx_ask(void) {
    amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Every tile 16 rows of 64 bytes (the config zeroes them). */
static void amx_configure(void) {
    TileConfig c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.bytes_per_row[t] = 64;
    _tile_loadconfig(&c);
}

/* Sum tile T (16 x 16 float32) into y's rows m.. and columns n.. (N apart), of which `rows` and
 * `cols` are real (the rest: x's zero rows, a panel's zero rows), through t where not all are. */
#define AMX_STORE(T, y, N, rows, cols, t)                                                         \
    if ((rows) >= 16 && (cols) >= 16) {                                                           \
        _tile_stored(T, y, (N) * sizeof(float));                                                  \
    } else if ((rows) > 0 && (cols) > 0) {                                                        \
        _tile_stored(T, t, 16 * sizeof(float));                                                   \
        for (long i = 0; i < (rows) && i < 16; i++)                                               \
            for (long j = 0; j < (cols) && j < 16; j++) (y)[i * (N) + j] = (t)[i * 16 + j];       \
    }

/* Rows m .. m + 32 of xb (K apart, zeros past M) against panels w0 and w1 (w1 NULL: none) into
 * y's columns n .. n + 32. */
static inline void amx_block(const uint16_t *xb, const uint16_t *w0, const uint16_t *w1, float *y, long M,
                             long N, long K, long m, long n, float *t, int fetch) {
    const uint16_t *a = xb + m * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long k = 0; k < K; k += 32) {
        if (fetch)  /* the panels' next weights, AMX_AHEAD k on (hints: past the end they never fault) */
            for (int l = 0; l < 16; l++) {
                _mm_prefetch((const char *)(w0 + (k + AMX_AHEAD) * PANEL + 32 * l), _MM_HINT_T0);
                if (w1) _mm_prefetch((const char *)(w1 + (k + AMX_AHEAD) * PANEL + 32 * l), _MM_HINT_T0);
            }
        _tile_loadd(4, a + k, K * 2);
        _tile_loadd(6, w0 + k * PANEL, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (M - m > 16) {
            _tile_loadd(5, a + 16 * K + k, K * 2);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (w1) {
            _tile_loadd(7, w1 + k * PANEL, 64);
            _tile_dpbf16ps(2, 4, 7);
            if (M - m > 16) _tile_dpbf16ps(3, 5, 7);
        }
    }
    const long rows = M - m, cols = N - n;
    float *o = y + m * N + n;
    AMX_STORE(0, o, N, rows, cols, t)
    AMX_STORE(1, o + 16 * N, N, rows - 16, cols, t)
    AMX_STORE(2, o + 16, N, rows, cols - 16, t)
    AMX_STORE(3, o + 16 * N + 16, N, rows - 16, cols - 16, t)
}

/* y = x @ w.T through the tiles; -1 (nothing computed) without memory for x's bfloat16 copy. */
static int gemm_packed_bf16_amx(const float *x, const uint16_t *w, float *y, long M, long N, long K) {
    uint16_t *xb = bf16_rows(x, M, K, (M + 15) / 16 * 16);
    if (xb == NULL) return -1;
    const long panels = (N + PANEL - 1) / PANEL, pairs = (panels + 1) / 2;
#pragma omp parallel if (pairs > 1)
    {
        float t[16 * 16];
        amx_configure();
        for (long m0 = 0; m0 < M; m0 += AMX_ROWS_AT_ONCE) {
            const long m1 = m0 + AMX_ROWS_AT_ONCE < M ? m0 + AMX_ROWS_AT_ONCE : M;
#pragma omp for schedule(static) nowait
            for (long u = 0; u < pairs; u++) {
                const uint16_t *w0 = w + 2 * u * PANEL * K, *w1 = 2 * u + 1 < panels ? w0 + PANEL * K : NULL;
                for (long m = m0; m < m1; m += 32) amx_block(xb, w0, w1, y, m1, N, K, m, 2 * u * PANEL, t, m == m0);
            }
        }
        _tile_release();
    }
    free(xb);
    return 0;
}
#endif

#ifdef BF16_DOT
void gemm_packed_bf16(const float *x, const uint16_t *w, float *y, long M, long N, long K) {
#ifdef AMX
    if (amx_permitted && M >= AMX_MIN_ROWS && K % 32 == 0 && !gemm_packed_bf16_amx(x, w, y, M, N, K)) return;
#endif
    uint16_t *xb = M >= BF16_DOT_MIN_ROWS ? bf16_rows(x, M, K, M) : NULL;
    if (xb == NULL) {
        gemm_packed_bf16_f32x(x, w, y, M, N, K);
        return;
    }
    gemm_packed_bf16_dot(xb, w, y, M, N, K);
    free(xb);
}
#endif

/* The widest vectors this build's kernels use, in bits: 512 where it was built for AVX-512. */
int cpu_kernels_vector_bits(void) {
#ifdef __AVX512F__
    return 512;
#else
    return 256;
#endif
}

/* From how many rows of x the bfloat16 GEMM rounds x to bfloat16, or 0 where the build has no
 * AVX512-BF16 and x stays float32 at every size. */
int cpu_kernels_bf16_dot_min_rows(void) {
#ifdef BF16_DOT
    return BF16_DOT_MIN_ROWS;
#else
    return 0;
#endif
}

/* From how many rows of x the bfloat16 GEMM takes AMX's tiles (where K is a multiple of 32), or
 * 0 where the build has no AMX or Linux did not give this process the tiles. */
int cpu_kernels_amx_min_rows(void) {
#ifdef AMX
    return amx_permitted ? AMX_MIN_ROWS : 0;
#else
    return 0;
#endif
}

/* ---- The dot-product tiles the quantized GEMVs share ---------------------------------------- */

/* y = x @ w.T over rows [n, n + NR) of w for all M vectors: four at a time, then the rest.
 * X: what the tiles read the vectors from (XT; XAT(x, m0, K): from vector m0 on); STRIDE(K):
 * how many T a row of w takes (the bytes of a row of regrouped blocks: quant_row_bytes). */
#define DEFINE_ROWS(NAME, XT, XAT, T, TILE, STRIDE)                                               \
    static inline __attribute__((always_inline)) void NAME(                                       \
        XT x, const T *wr, float *y, long M, long N, long K, long n, const int NR) {              \
        const char *ahead = (const char *)(wr + 2 * NR * STRIDE(K));  /* two tiles on: a hint, never faults */ \
        for (long m0 = 0; m0 < M; m0 += 4) {                                                      \
            const char *hint = m0 ? 0 : ahead;  /* the first pass over the rows brings them in */ \
            switch (M - m0 < 4 ? M - m0 : 4) {                                                    \
            case 4: TILE(XAT(x, m0, K), wr, y + m0 * N + n, K, N, 4, NR, hint); break;            \
            case 3: TILE(XAT(x, m0, K), wr, y + m0 * N + n, K, N, 3, NR, hint); break;            \
            case 2: TILE(XAT(x, m0, K), wr, y + m0 * N + n, K, N, 2, NR, hint); break;            \
            case 1: TILE(XAT(x, m0, K), wr, y + m0 * N + n, K, N, 1, NR, hint); break;            \
            }                                                                                     \
        }                                                                                         \
    }

/* Rows of w across the OpenMP threads (the same runtime torch uses): in threes (then the one or two
 * left), whose tiles load each x vector once for three rows; for one or two vectors one at a time
 * where a thread reads best as one stream (several_streams). Three rows interleaved, group by
 * group, read from memory at 0.5-0.6x the speed of one for rows of 640 bytes and more (K >= 1024 in
 * Q4_1) on a 2-core Zen 3: the default model's step of single-vector GEMVs ran 1.09-1.23x faster one
 * row at a time, two vectors 1.045x, three 0.99x and four 0.96x (2026-12-01, the .so builds
 * alternating pass by pass in one process). */
#define DEFINE_GEMV_OF(NAME, XT, XAT, T, TILE, STRIDE)                                            \
    DEFINE_ROWS(NAME##_rows, XT, XAT, T, TILE, STRIDE)                                            \
    void NAME(XT x, const T *w, float *y, long M, long N, long K) {                               \
        const long S = STRIDE(K);                                                                 \
        if (M <= 2 && !several_streams) {                                                         \
            _Pragma("omp parallel for schedule(static)")                                          \
            for (long n = 0; n < N; n++) NAME##_rows(x, w + n * S, y, M, N, K, n, 1);             \
            return;                                                                               \
        }                                                                                         \
        _Pragma("omp parallel for schedule(static)")                                              \
        for (long p = 0; p < N / 3; p++) NAME##_rows(x, w + 3 * p * S, y, M, N, K, 3 * p, 3);     \
        if (N % 3 == 2) NAME##_rows(x, w + (N - 2) * S, y, M, N, K, N - 2, 2);                    \
        if (N % 3 == 1) NAME##_rows(x, w + (N - 1) * S, y, M, N, K, N - 1, 1);                    \
    }

/* ---- GGUF's quantized blocks -------------------------------------------------------------
 *
 * Q4_0: blocks of 32 weights w = d * (q - 8), q 4-bit; Q4_1: w = d * q + m; Q8_0: w = d * q,
 * q signed 8-bit; d and m float16. A 4-bit block's byte j holds weight j in its low nibble and
 * weight j + 16 in its high one. Q4_K takes blocks of 256 in eight sub-blocks of 32,
 * w = d * sc * q - dmin * mn, with a 6-bit sc and mn per sub-block. At 4.5 to 8.5 bits a
 * weight, a small step reads 2-3.5x fewer bytes than from bfloat16 copies. (Q6_K, as widened
 * here, ran at 0.87x the bfloat16 GEMV at one token: its tensors keep the dequantized path.)
 *
 * Widening 4-bit values to float32 would cost AVX2 more than the bytes it saves, so the products
 * are taken in integers: each vector x is split into blocks of 32 and each block scaled to int16
 * (x ~ sx * x16, |x16| <= 32767: a relative error of 2^-16 of the block's largest value, far
 * below bfloat16's 2^-9), and _mm256_madd_epi16 multiplies 16 weights by 16 activations and adds
 * them in pairs, exactly. Per block, d * sx * sum(q * x16) and the minimum's share,
 * m * sx * sum(x16) (Q4_0: m = -8d), go into float32 accumulators: the result is that of the
 * exact weights with x as int16. (int8 activations, as llama.cpp's, cost half the multiplies
 * but ten times the error: docs/design.md.)
 *
 * So that the per-block float work (scales, conversion, accumulation) is done eight blocks at
 * a time, cpu_kernels.py (pack_quantized) regroups each row's blocks: groups of 8 blocks of 32
 * (the last may hold fewer: with h = half its blocks, an odd count padded with a zero block),
 * each a header (the 8 blocks' d, then Q4_1's 8 m, as float16; Q4_K: GGUF's own 16 bytes of
 * scales) and then the blocks in pairs, block i beside block i + h: a 4-bit pair is 32 bytes,
 * block i's 16 bytes of nibbles then block i + h's (the low nibbles weights 0-15 of each, the
 * high ones 16-31), an 8-bit pair 64 bytes, the two blocks' weights 0-15 then their weights
 * 16-31. Q4_K's sub-blocks become such blocks of nibbles. A full group takes as many bytes as
 * GGUF's blocks. Unpacking a pair's bytes to int16 within 128-bit lanes keeps block i in the low
 * lane and block i + h in the high one (the vectors are laid out to match: quantize_x), so a
 * pair's products fill one vector of 8 int32 (block i's in lanes 0-3, block i + h's in lanes
 * 4-7), and three horizontal adds over a group's four pairs leave block j's sum in lane j
 * (j < h) and block h + j's in lane 4 + j: where the headers put their scales. Against GGUF's
 * own layout, a block at a time with a float conversion, FMA and scalar scales each, this is
 * 1.06-1.12x faster at 1-8 vectors on a 2-core AVX2 Zen 3 (2026-12-01). */
enum { QGROUP = 8 };  /* blocks of 32 a group */

/* The bytes of a group's header and of a pair of its blocks, per type (cpu_kernels.py: _group). */
#define HEADER_Q4_0 16
#define HEADER_Q4_1 32
#define HEADER_Q8_0 16
#define HEADER_Q4_K 16
#define PAIR_Q4 32
#define PAIR_Q8 64

/* Blocks of 32 in a row of K, padded to an even count, and the groups they make. */
static inline long padded_blocks(long K) { return K / 32 + (K / 32) % 2; }
static inline long groups_of(long K) { return (padded_blocks(K) + QGROUP - 1) / QGROUP; }

/* The bytes of a regrouped row of K weights. */
static inline long quant_row_bytes(long header, long pair, long K) {
    const long nb = padded_blocks(K), tail = nb % QGROUP;
    return nb / QGROUP * (header + QGROUP / 2 * pair) + (tail ? header + tail / 2 * pair : 0);
}

/* The activations, as the quantized GEMVs read them: per vector, its blocks as int16 in the
 * pairs' layout (padded_blocks(K) * 32 values: dot_pair_of), and per group, the 8 lanes' scales sx
 * and sums times sx (zeros in lanes without a block). */
typedef struct { int16_t *x16; float *sx, *xsum; } QuantX;

static int quantize_x(const float *x, long M, long K, QuantX *q) {
    const long nb = K / 32, nbp = padded_blocks(K), groups = groups_of(K);
    q->x16 = (int16_t *)calloc(1, sizeof(int16_t) * M * nbp * 32 + 2 * sizeof(float) * M * groups * QGROUP);
    if (!q->x16) return -1;
    q->sx = (float *)(q->x16 + M * nbp * 32);
    q->xsum = q->sx + M * groups * QGROUP;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(INFINITY);
    for (long m = 0; m < M; m++)
        for (long b = 0; b < nb; b++) {
            const float *xb = x + m * K + 32 * b;
            __m256 amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
            for (int j = 0; j < 32; j += 8) {
                const __m256 a = _mm256_and_ps(_mm256_loadu_ps(xb + j), abs_mask);
                amax = _mm256_max_ps(amax, a);
                finite = _mm256_and_ps(finite, _mm256_cmp_ps(a, inf, _CMP_LT_OQ));  /* false for NaN and inf */
            }
            /* a NaN or inf makes the block's scale NaN, so the outputs it reaches are NaN, as in
             * torch (not a finite value made of saturated int16s) */
            const float top = _mm256_movemask_ps(finite) == 0xff ? hmax(amax) : NAN;
            /* x / top, then * 32767: 32767 / top alone overflows below 1e-34; a block of subnormals
             * (below FLT_MIN, where 1 / top would) counts as zeros */
            const __m256 inv = _mm256_set1_ps(top >= FLT_MIN ? 1.0f / top : 0.0f), full = _mm256_set1_ps(32767.0f);
            /* where block b of its group goes: pair i, first or second of the pair, lane */
            const long g = b / QGROUP, j = b % QGROUP, h = (nbp - g * QGROUP < QGROUP ? nbp - g * QGROUP : QGROUP) / 2;
            const long i = j < h ? j : j - h, lane = j < h ? j : 4 + j - h;
            int16_t *dst = q->x16 + m * nbp * 32 + g * QGROUP * 32 + 64 * i + (j < h ? 0 : 8);
            __m256i sum = _mm256_setzero_si256();
            for (int half = 0; half < 2; half++) {  /* values 0-15, then 16-31 */
                const float *xh = xb + 16 * half;
                const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xh), inv), full));
                const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xh + 8), inv), full));
                /* packs works within 128-bit lanes: put the four quarters back in order */
                const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, c), 0xd8);
                _mm_storeu_si128((__m128i *)(dst + 32 * half), _mm256_castsi256_si128(w16));
                _mm_storeu_si128((__m128i *)(dst + 32 * half + 16), _mm256_extracti128_si256(w16, 1));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(w16, _mm256_set1_epi16(1)));
            }
            const long at = (m * groups + g) * QGROUP + lane;
            q->sx[at] = top / 32767.0f;
            /* the sum of the int16 values, not of x: then the minimum's share has the same error as
             * the rest, and the result is exactly the product with the int16 x (the weights are exact) */
            q->xsum[at] = q->sx[at] * hsum(_mm256_cvtepi32_ps(sum));
        }
    return 0;
}

/* A pair's bytes come in chunks of 16, eight of each block (cpu_kernels.py: _group), so widening
 * a chunk to int16 puts the first block's in the low 128-bit lane and the second's in the high
 * one. 4-bit pairs: a block's byte j holds its weights j and j + 16. */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* With AVX-512, two chunks widen into one vector whose four 128-bit lanes are the two 256-bit
 * vectors' lanes in order, and so are 32 values of x: a pair takes half the instructions. The
 * 512-bit sums' halves added give the 256-bit layout (4 lanes a block), the same integers. On a
 * 2-core Zen 5 EPYC (2026-12-02, `ab_cpu_kernels.py --kernel gemv-step`, builds alternating) the
 * default model's Q4_1 / Q8_0 step 1.06x faster at one vector, 1.17x at two, 1.14x at three, 1.16x
 * at four. */
static inline __m256i fold_halves(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
static inline __m256i dot_pair_q4(const uint8_t *w, const int16_t *x) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)w));
    const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(15)), hi = _mm512_srli_epi16(v, 4);
    return fold_halves(_mm512_dpwssd_epi32(_mm512_madd_epi16(lo, _mm512_loadu_si512(x)), hi,
                                           _mm512_loadu_si512(x + 32)));
}
static inline __m256i dot_pair_q8(const uint8_t *w, const int16_t *x) {
    const __m512i v0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w));
    const __m512i v1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32)));
    return fold_halves(_mm512_dpwssd_epi32(_mm512_madd_epi16(v0, _mm512_loadu_si512(x)), v1,
                                           _mm512_loadu_si512(x + 32)));
}
#else
/* A pair of blocks of weights w, as four vectors of 16 int16 (values 0-7, 8-15, 16-23, 24-31 of
 * both blocks: the first's in the low 128-bit lane, the second's in the high one), against the
 * vector's pair x (laid out the same way): 8 int32 lanes, 4 a block. vpmaddwd adds the products in
 * pairs, exactly: |q| <= 15 (or 128) times |x| <= 32767, twice, and eight such pairs a lane. */
static inline __m256i dot_pair_of(__m256i w0, __m256i w1, __m256i w2, __m256i w3, const int16_t *x) {
    const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x));
    const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16)));
    const __m256i p2 = _mm256_madd_epi16(w2, _mm256_loadu_si256((const __m256i *)(x + 32)));
    const __m256i p3 = _mm256_madd_epi16(w3, _mm256_loadu_si256((const __m256i *)(x + 48)));
    return _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3));
}
static inline __m256i dot_pair_q4(const uint8_t *w, const int16_t *x) {
    const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w));
    const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + 16)));
    const __m256i low4 = _mm256_set1_epi16(15);
    return dot_pair_of(_mm256_and_si256(v0, low4), _mm256_and_si256(v1, low4), _mm256_srli_epi16(v0, 4),
                       _mm256_srli_epi16(v1, 4), x);
}
/* 8-bit pairs: the chunks hold weights 0-7, 8-15, 16-23, 24-31 of both blocks. */
static inline __m256i dot_pair_q8(const uint8_t *w, const int16_t *x) {
    const __m128i *c = (const __m128i *)w;
    return dot_pair_of(_mm256_cvtepi8_epi16(_mm_loadu_si128(c)), _mm256_cvtepi8_epi16(_mm_loadu_si128(c + 1)),
                       _mm256_cvtepi8_epi16(_mm_loadu_si128(c + 2)), _mm256_cvtepi8_epi16(_mm_loadu_si128(c + 3)), x);
}
#endif

/* A group's header: its 8 lanes' scales d and minima m (as the weights read w = d * q + m). */
static inline void scales_q4_0(const uint8_t *G, __m256 *d, __m256 *m) {
    *d = widen_f16((const uint16_t *)G);
    *m = _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f));
}
static inline void scales_q4_1(const uint8_t *G, __m256 *d, __m256 *m) {
    *d = widen_f16((const uint16_t *)G);
    *m = widen_f16((const uint16_t *)G + QGROUP);
}
static inline void scales_q8_0(const uint8_t *G, __m256 *d, __m256 *m) {
    *d = widen_f16((const uint16_t *)G);
    *m = _mm256_setzero_ps();
}
/* Q4_K's 12 bytes hold 8 6-bit scales and 8 6-bit minima: bytes 0-3 and 4-7 the low 6 bits of
 * scales 0-3 and minima 0-3, whose top 2 bits carry the high 2 bits of scales and minima 4-7;
 * bytes 8-11 the low 4 bits of scales (low nibbles) and minima (high nibbles) 4-7. Unpacked a
 * word at a time, then widened and scaled 8 at a time (after GGUF's d and dmin). */
static inline void scales_q4_k(const uint8_t *G, __m256 *d, __m256 *m) {
    uint16_t dd[2];
    uint32_t w[3], scales[2], minima[2];
    __builtin_memcpy(dd, G, 4);
    __builtin_memcpy(w, G + 4, 12);
    const uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    scales[0] = w[0] & six;
    minima[0] = w[1] & six;
    scales[1] = (w[2] & four) | (((w[0] >> 6) & two) << 4);
    minima[1] = ((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4);
    uint64_t s8, m8;
    __builtin_memcpy(&s8, scales, 8);
    __builtin_memcpy(&m8, minima, 8);
    *d = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dd[0])),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8))));
    *m = _mm256_mul_ps(_mm256_set1_ps(-_cvtsh_ss(dd[1])),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8))));
}

/* A tile of the quantized product: NR rows of w (wr, ROW_BYTES(K) apart) against MR vectors
 * of x into y (yb, rows N apart), a group at a time: per row and vector, the group's (up to)
 * four pairs, their sums in 8 lanes, and those times d * sx plus m * xsum into an accumulator
 * of 8 lanes. The MR x NR accumulators stay in registers (MR, NR constants at every call, the
 * loops over them unrolled: GCC kept them as loops, with the accumulators on the stack; with
 * 256-bit vpdpwssd, 1.07-1.11x at 3 and 8 vectors on a Zen 4, and no change on the AVX2 build);
 * `ahead`, when set, is prefetched (the next rows, for the memory-bound single-vector case). */
#define DEFINE_QTILE(NAME, HEADER, PAIR, SCALES, DOT_PAIR, HAS_MINIMUM)                           \
    static inline __attribute__((always_inline)) void NAME(                                       \
        const QuantX *qx, const uint8_t *wr, float *yb, long K, long N, const int MR, const int NR, \
        const char *ahead) {                                                                      \
        const long nbp = padded_blocks(K), groups = groups_of(K), row = quant_row_bytes(HEADER, PAIR, K); \
        const long group_bytes = HEADER + QGROUP / 2 * PAIR;                                      \
        __m256 acc[4][3];                                                                         \
        for (int m = 0; m < MR; m++)                                                              \
            for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();                         \
        for (long g = 0; g < groups; g++) {                                                       \
            const long left = nbp - g * QGROUP, pairs = (left < QGROUP ? left : QGROUP) / 2;      \
            if (ahead)                                                                            \
                for (int r = 0; r < NR; r++)                                                      \
                    for (long c = 0; c < group_bytes; c += 64)                                    \
                        _mm_prefetch(ahead + r * row + g * group_bytes + c, _MM_HINT_T0);         \
            _Pragma("GCC unroll 3")                                                               \
            for (int r = 0; r < NR; r++) {                                                        \
                const uint8_t *G = wr + r * row + g * group_bytes;                                \
                __m256 d, mn;                                                                     \
                SCALES(G, &d, &mn);                                                               \
                _Pragma("GCC unroll 4")                                                           \
                for (int m = 0; m < MR; m++) {                                                    \
                    const int16_t *xg = qx->x16 + m * nbp * 32 + g * QGROUP * 32;                   \
                    __m256i p[4];                                                                 \
                    _Pragma("GCC unroll 4")                                                       \
                    for (int i = 0; i < 4; i++)                                                   \
                        p[i] = i < pairs ? DOT_PAIR(G + HEADER + PAIR * i, xg + 64 * i) : _mm256_setzero_si256(); \
                    const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),         \
                                                           _mm256_hadd_epi32(p[2], p[3]));        \
                    const long at = (m * groups + g) * QGROUP;                                    \
                    acc[m][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),                         \
                                                _mm256_mul_ps(d, _mm256_loadu_ps(qx->sx + at)), acc[m][r]); \
                    if (HAS_MINIMUM) acc[m][r] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(qx->xsum + at), acc[m][r]); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int m = 0; m < MR; m++)                                                              \
            for (int r = 0; r < NR; r++) yb[m * N + r] = hsum(acc[m][r]);                         \
    }

/* The quantized vectors from vector m0 on (a compound literal: it lives in the caller's block). */
#define QUANT_ROWS(x, m0, K)                                                                      \
    (&(const QuantX){(x)->x16 + (m0) * padded_blocks(K) * 32, (x)->sx + (m0) * groups_of(K) * QGROUP, \
                     (x)->xsum + (m0) * groups_of(K) * QGROUP})

/* ---- Larger steps over quantized blocks: a strip of rows dequantized at a time ------------
 *
 * The integer tiles above widen a pair's weights again for every vector of x, so from a few
 * vectors on they fall behind the float GEMM (at 64-512 vectors of 2048, 0.35-0.38x the
 * bfloat16 GEMM of the same weight on a 2-core Zen 4). A layer that keeps only its blocks
 * (--cpu-weights: worker/model_runner.py) would take every larger step at that pace, so for
 * larger steps each thread dequantizes rows of w into its own scratch (kept in the L2 cache) and
 * passes every vector of x by them: for a bfloat16 model where the build has AVX512-BF16, from
 * QUANT_STRIP_MIN_ROWS vectors on, a strip of rows as bfloat16, QUANT_TILE_MR vectors (x rounded
 * to bfloat16) by 3 rows at a time (VDPBF16PS, the arithmetic of gemm_packed_bf16's steps of as
 * many rows); else, from QUANT_PANEL_MIN_ROWS on, float32 panels in pack_weight's layout through
 * the float32 GEMM's own tiles (its arithmetic, x as it is). The dequantized
 * weights are exactly GGUF's (w = d * q + m rounds once, d * q being exact), then rounded to
 * bfloat16 where the dot products take it. Against the integer tiles (2026-12-04, a 2-core Zen 4,
 * scripts/bench_quant_strips.py, the two ways' builds alternating call by call; Q4_1, Q4_K and
 * Q8_0 on 2048x2048, 8192x2048 and 2048x8192 layers): bfloat16 strips 0.74-1.04x at 4-6
 * vectors, 0.97-1.22x at 8, 1.2-1.9x at 16, 1.8-2.8x at 64-256, where they run at 0.8-1.2x the
 * bfloat16 GEMM of the same weights (0.5-0.7x at 8, the dequantizing's share); float32 panels
 * (a float32 model, or a CPU without AVX512-BF16) 0.85-0.98x at 16-32, 0.90-1.08x at 64,
 * 1.11-1.31x at 256, 0.87-1.02x the float32 (or the AVX2 build's bfloat16) GEMM there. Hence
 * QUANT_STRIP_MIN_ROWS and QUANT_PANEL_MIN_ROWS. */
#ifndef QUANT_STRIP_MIN_ROWS
#define QUANT_STRIP_MIN_ROWS 8
#endif
#ifndef QUANT_PANEL_MIN_ROWS
#define QUANT_PANEL_MIN_ROWS 64
#endif
#define QUANT_STRIP_BYTES (192 << 10)  /* a strip's scratch at most (rows of 3 at least) */

/* A block's 32 weights d * q + m into a strip, from its first chunk of bytes at P (cpu_kernels.py:
 * _pairs: a 4-bit block's bytes j hold weights j and j + 16, in two chunks of 8, 16 bytes apart;
 * an 8-bit block's weights in four such chunks): as float32, and with AVX512-BF16 as bfloat16. */
static inline __m256 weights_of(__m256i q, __m256 d, __m256 m) { return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q), m); }
static inline void block_4bit_f32(const uint8_t *P, float d, float m, float *o) {
    const __m256 dd = _mm256_set1_ps(d), mm = _mm256_set1_ps(m);
    for (int c = 0; c < 2; c++) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(P + 16 * c)));
        _mm256_storeu_ps(o + 8 * c, weights_of(_mm256_and_si256(q, _mm256_set1_epi32(15)), dd, mm));
        _mm256_storeu_ps(o + 16 + 8 * c, weights_of(_mm256_srli_epi32(q, 4), dd, mm));
    }
}
static inline void block_8bit_f32(const uint8_t *P, float d, float m, float *o) {
    const __m256 dd = _mm256_set1_ps(d), mm = _mm256_set1_ps(m);
    for (int c = 0; c < 4; c++)
        _mm256_storeu_ps(o + 8 * c, weights_of(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(P + 16 * c))), dd, mm));
}

#ifdef BF16_DOT
/* The block's q as int32 lanes, weights 0-15 in q0 and 16-31 in q1, into 32 bfloat16 at o. */
static inline void block_out_bf16(__m512i q0, __m512i q1, float d, float m, uint16_t *o) {
    const __m512 dd = _mm512_set1_ps(d), mm = _mm512_set1_ps(m);
    _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(q1), mm),
                                                        _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(q0), mm)));
}
static inline __m128i two_chunks(const uint8_t *P) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)P), _mm_loadl_epi64((const __m128i *)(P + 16)));
}
static inline void block_4bit_bf16(const uint8_t *P, float d, float m, uint16_t *o) {
    const __m512i q = _mm512_cvtepu8_epi32(two_chunks(P));
    block_out_bf16(_mm512_and_si512(q, _mm512_set1_epi32(15)), _mm512_srli_epi32(q, 4), d, m, o);
}
static inline void block_8bit_bf16(const uint8_t *P, float d, float m, uint16_t *o) {
    block_out_bf16(_mm512_cvtepi8_epi32(two_chunks(P)), _mm512_cvtepi8_epi32(two_chunks(P + 32)), d, m, o);
}
static inline __m512 strip_madd_bf16(__m512 acc, const uint16_t *x, const uint16_t *w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
}
#endif

/* NAME(row, K, out): row `row` (regrouped blocks of K weights) as K T at out, BLOCK(P, d, m, o)
 * writing a block. SCALES gives lane j < 4 block j's d and m, lane 4 + j block h + j's, where a
 * pair's second block begins 8 bytes on; the padding block that evens an odd count is skipped. */
#define DEFINE_QDEQUANT(NAME, T, HEADER, PAIR, SCALES, BLOCK)                                     \
    static void NAME(const uint8_t *row, long K, T *out) {                                        \
        const long nb = K / 32, nbp = padded_blocks(K), groups = groups_of(K);                    \
        const long group_bytes = HEADER + QGROUP / 2 * PAIR;                                      \
        for (long g = 0; g < groups; g++) {                                                       \
            const uint8_t *G = row + g * group_bytes;                                             \
            const long left = nbp - g * QGROUP, h = (left < QGROUP ? left : QGROUP) / 2;          \
            __m256 dv, mv;                                                                        \
            float d[8], mn[8];                                                                    \
            SCALES(G, &dv, &mv);                                                                  \
            _mm256_storeu_ps(d, dv), _mm256_storeu_ps(mn, mv);                                    \
            for (long i = 0; i < h; i++) {                                                        \
                const uint8_t *P = G + HEADER + PAIR * i;                                         \
                const long b = g * QGROUP + i;                                                    \
                BLOCK(P, d[i], mn[i], out + 32 * b);                                              \
                if (b + h < nb) BLOCK(P + 8, d[4 + i], mn[4 + i], out + 32 * (b + h));            \
            }                                                                                     \
        }                                                                                         \
    }

/* Eight vectors of 8 float32 (rows) transposed in place (columns). */
static inline void transpose8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xee);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xee);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xee);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

typedef void (*DequantizeF32)(const uint8_t *row, long K, float *out);

/* `cols` (<= PANEL) regrouped rows of w (row_bytes apart) as a float32 panel [K, PANEL], the
 * layout gemm_packed_f32 reads (pack_weight's), its other rows zeros: eight rows at a time
 * into buf (8 * K floats), then written out transposed eight by eight. */
static void dequantize_panel_f32(DequantizeF32 dequantize, const uint8_t *w, long row_bytes, long cols, long K,
                                 float *panel, float *buf) {
    for (long r0 = 0; r0 < PANEL; r0 += 8) {
        for (long j = 0; j < 8; j++) {
            if (r0 + j < cols)
                dequantize(w + (r0 + j) * row_bytes, K, buf + j * K);
            else
                memset(buf + j * K, 0, sizeof(float) * K);
        }
        for (long k = 0; k < K; k += 8) {
            __m256 v[8];
            for (int j = 0; j < 8; j++) v[j] = _mm256_loadu_ps(buf + j * K + k);
            transpose8(v);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(panel + (k + i) * PANEL + r0, v[i]);
        }
    }
}

/* y = x @ w.T for float32 x (w: regrouped rows of row_bytes), PER panels of PANEL rows at a
 * time (two with AVX-512, whose tiles take pairs: a broadcast of x then feeds two FMAs)
 * dequantized into the thread's scratch and passed by every vector of x through the float32
 * GEMM's own tiles (its float32 arithmetic: x as it is); -1 without memory. */
#ifdef __AVX512F__
#define QUANT_PANELS 2
#else
#define QUANT_PANELS 1
#endif
static int quant_panels_f32(DequantizeF32 dequantize, long row_bytes, const float *x, const uint8_t *w, float *y,
                            long M, long N, long K) {
    const long per = QUANT_PANELS * PANEL, units = (N + per - 1) / per;
    int failed = 0;
#pragma omp parallel if (units > 1)
    {
        float *wp = malloc(sizeof(float) * (per + 8) * K);  /* the panels, then dequantize_panel_f32's rows */
        if (!wp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long u = 0; u < units; u++) {
            if (!wp) continue;
            const long n = u * per, cols = N - n < per ? N - n : per;
            for (long p = 0; p * PANEL < cols; p++) {
                const long c = cols - p * PANEL < PANEL ? cols - p * PANEL : PANEL;
                dequantize_panel_f32(dequantize, w + (n + p * PANEL) * row_bytes, row_bytes, c, K, wp + p * PANEL * K,
                                     wp + per * K);
            }
            long m = 0;
            const long m1 = M;
#ifdef __AVX512F__
            if (cols > PANEL) { PANEL512_ROWS(gemm_packed_f32, 2) } else { PANEL512_ROWS(gemm_packed_f32, 1) }
#else
            PANEL_ROWS(gemm_packed_f32)
#endif
        }
        free(wp);
    }
    return failed ? -1 : 0;
}

#ifdef BF16_DOT
#define QUANT_TILE_MR 4

/* MR vectors of x (bfloat16, K apart) by NR rows of a strip (K apart) into y (rows N apart). */
static inline __attribute__((always_inline)) void strip_tile_bf16(const uint16_t *x, const uint16_t *w, float *y,
                                                                  long K, long N, const int MR, const int NR) {
    __m512 acc[QUANT_TILE_MR][3];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 32) {
        _Pragma("GCC unroll 4")
        for (int m = 0; m < MR; m++) {
            _Pragma("GCC unroll 3")
            for (int r = 0; r < NR; r++) acc[m][r] = strip_madd_bf16(acc[m][r], x + m * K + k, w + r * K + k);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) y[m * N + r] = _mm512_reduce_add_ps(acc[m][r]);
}

/* Every vector of x against a strip of `rows` rows (s, K apart) into y's columns from y on. */
static void strip_rows_bf16(const uint16_t *x, const uint16_t *s, float *y, long M, long N, long K, long rows) {
    for (long m0 = 0; m0 < M; m0 += QUANT_TILE_MR) {
        const long mr = M - m0 < QUANT_TILE_MR ? M - m0 : QUANT_TILE_MR;
        for (long r0 = 0; r0 < rows; r0 += 3) {
            const uint16_t *xm = x + m0 * K, *wr = s + r0 * K;
            float *yo = y + m0 * N + r0;
            switch ((rows - r0 < 3 ? rows - r0 : 3) * 10 + mr) {
            case 34: strip_tile_bf16(xm, wr, yo, K, N, 4, 3); break;
            case 33: strip_tile_bf16(xm, wr, yo, K, N, 3, 3); break;
            case 32: strip_tile_bf16(xm, wr, yo, K, N, 2, 3); break;
            case 31: strip_tile_bf16(xm, wr, yo, K, N, 1, 3); break;
            case 24: strip_tile_bf16(xm, wr, yo, K, N, 4, 2); break;
            case 23: strip_tile_bf16(xm, wr, yo, K, N, 3, 2); break;
            case 22: strip_tile_bf16(xm, wr, yo, K, N, 2, 2); break;
            case 21: strip_tile_bf16(xm, wr, yo, K, N, 1, 2); break;
            case 14: strip_tile_bf16(xm, wr, yo, K, N, 4, 1); break;
            case 13: strip_tile_bf16(xm, wr, yo, K, N, 3, 1); break;
            case 12: strip_tile_bf16(xm, wr, yo, K, N, 2, 1); break;
            default: strip_tile_bf16(xm, wr, yo, K, N, 1, 1); break;
            }
        }
    }
}

/* y = x @ w.T for float32 x, rounded to bfloat16 (w: regrouped rows of row_bytes), a strip of
 * rows at a time dequantized to bfloat16 into the thread's scratch (at most QUANT_STRIP_BYTES, and
 * short enough that each thread takes four, 3 rows at least); -1 without memory. */
static int quant_strips_bf16(void (*dequantize)(const uint8_t *, long, uint16_t *), long row_bytes, const float *x,
                             const uint8_t *w, float *y, long M, long N, long K) {
    long strip = QUANT_STRIP_BYTES / (K * (long)sizeof(uint16_t)) / 3 * 3;
    const long share = N / (4 * omp_get_max_threads()) / 3 * 3;  /* four strips a thread at least */
    if (strip > share) strip = share;
    if (strip < 3) strip = 3;
    uint16_t *xb = bf16_rows(x, M, K, M);
    if (xb == NULL) return -1;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *s = malloc(sizeof(uint16_t) * strip * K);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long n0 = 0; n0 < N; n0 += strip) {
            if (!s) continue;
            const long rows = N - n0 < strip ? N - n0 : strip;
            for (long r = 0; r < rows; r++) dequantize(w + (n0 + r) * row_bytes, K, s + r * K);
            strip_rows_bf16(xb, s, y + n0, M, N, K, rows);
        }
        free(s);
    }
    free(xb);
    return failed ? -1 : 0;
}
#endif

/* From how many vectors the quantized GEMVs dequantize their rows, asked for bfloat16 dot
 * products (bf16) or not (tests read it). */
int cpu_kernels_quant_dequantized_min_rows(long bf16) {
#ifdef BF16_DOT
    if (bf16) return QUANT_STRIP_MIN_ROWS;
#endif
    return (void)bf16, QUANT_PANEL_MIN_ROWS;
}

/* Returns 0, or -1 when there is no memory for the int16 activations. K: a multiple of the
 * block's weights (32, or 256 for Q4_K); w: rows regrouped by pack_quantized. */
#ifdef BF16_DOT
#define QUANT_STRIPS_BF16(NAME, HEADER, PAIR, SCALES, BLOCK)                                      \
    DEFINE_QDEQUANT(NAME##_dequantize_bf16, uint16_t, HEADER, PAIR, SCALES, BLOCK##_bf16)
#define TAKE_STRIPS_BF16(NAME)                                                                    \
    {                                                                                             \
        if (bf16) return quant_strips_bf16(NAME##_dequantize_bf16, NAME##_row_bytes(K), x, w, y, M, N, K); \
    }
#else
#define QUANT_STRIPS_BF16(NAME, HEADER, PAIR, SCALES, BLOCK)
#define TAKE_STRIPS_BF16(NAME) (void)bf16;
#endif

/* Returns 0, or -1 without memory for the int16 activations or the strips. K: a multiple of the
 * block's weights (32, or 256 for Q4_K); w: rows regrouped by pack_quantized. bf16: whether the
 * strips may take bfloat16 dot products (a bfloat16 model's, as its GEMMs do; else float32). */
#define DEFINE_QGEMV(NAME, HEADER, PAIR, SCALES, DOT_PAIR, HAS_MINIMUM, BLOCK)                   \
    DEFINE_QTILE(NAME##_tile, HEADER, PAIR, SCALES, DOT_PAIR, HAS_MINIMUM)                        \
    static inline long NAME##_row_bytes(long K) { return quant_row_bytes(HEADER, PAIR, K); }     \
    DEFINE_GEMV_OF(NAME##_quantized, const QuantX *, QUANT_ROWS, uint8_t, NAME##_tile, NAME##_row_bytes) \
    DEFINE_QDEQUANT(NAME##_dequantize_f32, float, HEADER, PAIR, SCALES, BLOCK##_f32)              \
    QUANT_STRIPS_BF16(NAME, HEADER, PAIR, SCALES, BLOCK)                                          \
    int NAME(const float *x, const uint8_t *w, float *y, long M, long N, long K, long bf16) {     \
        if (M >= QUANT_STRIP_MIN_ROWS) TAKE_STRIPS_BF16(NAME)                                     \
        if (M >= QUANT_PANEL_MIN_ROWS)                                                            \
            return quant_panels_f32(NAME##_dequantize_f32, NAME##_row_bytes(K), x, w, y, M, N, K); \
        QuantX qx;                                                                                \
        if (quantize_x(x, M, K, &qx)) return -1;                                                  \
        NAME##_quantized(&qx, w, y, M, N, K);                                                     \
        free(qx.x16);                                                                             \
        return 0;                                                                                 \
    }

DEFINE_QGEMV(gemv_q4_0, HEADER_Q4_0, PAIR_Q4, scales_q4_0, dot_pair_q4, 1, block_4bit)
DEFINE_QGEMV(gemv_q4_1, HEADER_Q4_1, PAIR_Q4, scales_q4_1, dot_pair_q4, 1, block_4bit)
DEFINE_QGEMV(gemv_q8_0, HEADER_Q8_0, PAIR_Q8, scales_q8_0, dot_pair_q8, 0, block_8bit)
DEFINE_QGEMV(gemv_q4_k, HEADER_Q4_K, PAIR_Q4, scales_q4_k, dot_pair_q4, 1, block_4bit)

/* The weight types, as step_forward_f32 names them. */
enum { WEIGHT_F32 = 0, WEIGHT_BF16 = 1, WEIGHT_F16 = 2, WEIGHT_Q4_0 = 3, WEIGHT_Q4_1 = 4, WEIGHT_Q8_0 = 5,
       WEIGHT_Q4_K = 6 };

/* Rows ids[0 .. n) of an [N, K] weight packed in panels (pack_weight: bfloat16 [ceil(N / 16),
 * ceil(K / 2), 16, 2], float16 or float32 [ceil(N / 16), K, 16]) as float32 rows of K at out: a
 * tied embedding's lookup from its head's copy. dtype: WEIGHT_F32, WEIGHT_BF16 or WEIGHT_F16.
 * Returns 0, or -1 (nothing written) where an id lies outside [0, N). In place of torch's
 * indexing of the panels (16 rows: 100 us; 256: 1 ms). */
int packed_rows(const void *panels, long dtype, long N, long K, const int64_t *ids, long n, float *out) {
    for (long i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
#pragma omp parallel for schedule(static) if (n * K > 65536)
    for (long i = 0; i < n; i++) {
        const long p = ids[i] / PANEL, r = ids[i] % PANEL;
        float *o = out + i * K;
        if (dtype == WEIGHT_BF16) {  /* a pair of columns a 32-bit word, the first in its low half */
            const uint32_t *src = (const uint32_t *)panels + p * ((K + 1) / 2) * PANEL + r;
            for (long k = 0; k < K; k += 2) {
                const uint32_t pair = src[k / 2 * PANEL], first = pair << 16, second = pair & 0xFFFF0000u;
                memcpy(o + k, &first, 4);
                if (k + 1 < K) memcpy(o + k + 1, &second, 4);
            }
        } else if (dtype == WEIGHT_F16) {
            const uint16_t *src = (const uint16_t *)panels + p * K * PANEL + r;
            for (long k = 0; k < K; k++) o[k] = _cvtsh_ss(src[k * PANEL]);
        } else {
            const float *src = (const float *)panels + p * K * PANEL + r;
            for (long k = 0; k < K; k++) o[k] = src[k * PANEL];
        }
    }
    return 0;
}

/* The bytes of a regrouped row of K weights of a WEIGHT_Q* type (cpu_kernels.py checks its packing against it), or 0. */
long cpu_kernels_quant_row_bytes(long type, long K) {
    switch (type) {
    case WEIGHT_Q4_0: return gemv_q4_0_row_bytes(K);
    case WEIGHT_Q4_1: return gemv_q4_1_row_bytes(K);
    case WEIGHT_Q8_0: return gemv_q8_0_row_bytes(K);
    case WEIGHT_Q4_K: return gemv_q4_k_row_bytes(K);
    default: return 0;
    }
}

/* Returns 0, or -1 when a quantized GEMV found no memory for its int16 activations. */
static int gemv_any(long type, const float *x, const void *w, float *y, long M, long N, long K, long bf16) {
    switch (type) {
    case WEIGHT_BF16: gemm_packed_bf16(x, (const uint16_t *)w, y, M, N, K); return 0;
    case WEIGHT_F16: gemm_packed_f16(x, (const uint16_t *)w, y, M, N, K); return 0;
    case WEIGHT_Q4_0: return gemv_q4_0(x, (const uint8_t *)w, y, M, N, K, bf16);
    case WEIGHT_Q4_1: return gemv_q4_1(x, (const uint8_t *)w, y, M, N, K, bf16);
    case WEIGHT_Q8_0: return gemv_q8_0(x, (const uint8_t *)w, y, M, N, K, bf16);
    case WEIGHT_Q4_K: return gemv_q4_k(x, (const uint8_t *)w, y, M, N, K, bf16);
    default: gemm_packed_f32(x, (const float *)w, y, M, N, K); return 0;
    }
}

/* out[t] = r[t] * rsqrt(mean(r[t]^2) + eps) * w, where r = x, or, with a residual,
 * r = residual += x. x, residual, out: [T, H] contiguous float32 (out may be x). */
void rms_norm_f32(const float *x, float *residual, const float *w, float *out, long T, long H, float eps) {
#pragma omp parallel for schedule(static) if (T * H > 65536)
    for (long t = 0; t < T; t++) {
        const float *xr = x + t * H;
        float *rr = residual ? residual + t * H : 0, *orow = out + t * H;
        const float *src = rr ? rr : xr;
        __m256 acc = _mm256_setzero_ps();
        long k = 0;
        for (; k + 8 <= H; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            if (rr) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(rr + k));
                _mm256_storeu_ps(rr + k, v);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sum = hsum(acc);
        for (; k < H; k++) {
            float v = xr[k];
            if (rr) rr[k] = v = v + rr[k];
            sum += v * v;
        }
        const float inv = 1.0f / sqrtf(sum / (float)H + eps);
        const __m256 vinv = _mm256_set1_ps(inv);
        for (k = 0; k + 8 <= H; k += 8)
            _mm256_storeu_ps(orow + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + k), vinv),
                                                     _mm256_loadu_ps(w + k)));
        for (; k < H; k++) orow[k] = (src[k] * inv) * w[k];
    }
}

/* e^x for the floats of a vector: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial to
 * r^7 (relative error about 1e-7), 2^n through the exponent bits. Inputs below -87 give 0.
 * exp_ps for 256-bit vectors, exp512_ps for 512-bit ones (P: the intrinsics' prefix, W: the width). */
#define DEFINE_EXP(NAME, T, TI, P, W, ROUND, ZERO_BELOW)                                          \
    static inline T NAME(T x) {                                                                   \
        const T lo = P##set1_ps(-87.0f), hi = P##set1_ps(88.0f);                                  \
        /* max and min return their second operand for NaN */                                     \
        const T c = P##min_ps(hi, P##max_ps(lo, x));                                              \
        const T n = ROUND(P##mul_ps(c, P##set1_ps(1.44269504088896341f)));                        \
        T r = P##fnmadd_ps(n, P##set1_ps(0.693359375f), c);                                       \
        r = P##fnmadd_ps(n, P##set1_ps(-2.12194440e-4f), r);                                      \
        T p = P##set1_ps(1.0f / 5040.0f);                                                         \
        p = P##fmadd_ps(p, r, P##set1_ps(1.0f / 720.0f));                                         \
        p = P##fmadd_ps(p, r, P##set1_ps(1.0f / 120.0f));                                         \
        p = P##fmadd_ps(p, r, P##set1_ps(1.0f / 24.0f));                                          \
        p = P##fmadd_ps(p, r, P##set1_ps(1.0f / 6.0f));                                           \
        p = P##fmadd_ps(p, r, P##set1_ps(0.5f));                                                  \
        p = P##fmadd_ps(p, r, P##set1_ps(1.0f));                                                  \
        p = P##fmadd_ps(p, r, P##set1_ps(1.0f));                                                  \
        const TI scale = P##slli_epi32(P##add_epi32(P##cvtps_epi32(n), P##set1_epi32(127)), 23);  \
        return ZERO_BELOW(x, lo, P##mul_ps(p, P##castsi##W##_ps(scale)));                         \
    }
#define ROUND256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ZERO_BELOW256(x, lo, v) _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), v)
DEFINE_EXP(exp_ps, __m256, __m256i, _mm256_, 256, ROUND256, ZERO_BELOW256)
#ifdef __AVX512F__
#define ROUND512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ZERO_BELOW512(x, lo, v) _mm512_maskz_mov_ps((__mmask16)~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), v)
DEFINE_EXP(exp512_ps, __m512, __m512i, _mm512_, 512, ROUND512, ZERO_BELOW512)
/* e^x to about 2e-6 (a degree-5 polynomial, VSCALEFPS for the power of two), where the result is
 * rounded to bfloat16 (8 bits) next: the softmax's weights for the bfloat16 products. */
static inline __m512 exp512_bf16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f), c = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(lo, x));
    const __m512 n = ROUND512(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)));
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), c);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 120.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return ZERO_BELOW512(x, lo, _mm512_scalef_ps(p, n));
}
#endif

/* The sums of a, b, c and d's lanes, in that order. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static inline void axpy_f32(float *y, float a, const float *x, long n) {
    const __m256 va = _mm256_set1_ps(a);
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* ---- Decode attention over the paged KV cache ----------------------------------------------
 *
 * The cache holds float32, or float16 (`half`) for a model whose weights are 16-bit: half the
 * bytes, which is what the attention of a long context is bound by. `half` is a constant at
 * every call of the always-inline routines below, so each cache type gets its own code. */

/* Eight elements of a cache (or any) row from element i, as float32. */
static inline __attribute__((always_inline)) __m256 kv8(const void *p, long i, const int half) {
    return half ? widen_f16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) float kv1(const void *p, long i, const int half) {
    return half ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#ifdef __AVX512F__
static inline __attribute__((always_inline)) __m512 kv16(const void *p, long i, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}
#endif

#define ATTN_TILE 32      /* keys scored before their softmax and values (K and V rows: in L1) */
#define ATTN_HEADS 3      /* query heads a tile routine takes at once: their accumulators fill the registers */
#define ATTN_MAX_Q 256    /* query heads */
#define ATTN_MAX_QD 16384 /* query heads x head_dim: a task's accumulators, on the stack */
#define ATTN_PF_LINES 2048 /* of the next tile's K rows asked for with the values (128 KB: more than L1) */
#define ATTN_AHEAD 4      /* keys ahead whose K rows are prefetched (the hardware's prefetchers do not keep up) */

/* Head i's four accumulators A##i##0..3 += Y times the vectors x0..x3. */
#define FMA4(A, i, Y)                                                                             \
    {                                                                                             \
        const __m256 y_ = (Y);                                                                    \
        A##i##0 = _mm256_fmadd_ps(y_, x0, A##i##0), A##i##1 = _mm256_fmadd_ps(y_, x1, A##i##1);   \
        A##i##2 = _mm256_fmadd_ps(y_, x2, A##i##2), A##i##3 = _mm256_fmadd_ps(y_, x3, A##i##3);   \
    }

/* Scores of NG (<= ATTN_HEADS) query heads (q, rows D apart, already scaled) against the four
 * keys at rows[0..3] of k, into s[g * ATTN_TILE + 0..3]: each K vector is loaded once for the
 * NG heads, and the 4 x NG dot products are reduced together. */
static inline __attribute__((always_inline)) void scores_4keys(const float *q, const void *k, const long *rows,
                                                               long D, float *s, const int NG, const int half) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00;
    __m256 a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    long d = 0;
    for (; d + 8 <= D; d += 8) {
        const __m256 x0 = kv8(k, rows[0] + d, half), x1 = kv8(k, rows[1] + d, half);
        const __m256 x2 = kv8(k, rows[2] + d, half), x3 = kv8(k, rows[3] + d, half);
        FMA4(a, 0, _mm256_loadu_ps(q + d))
        if (NG > 1) FMA4(a, 1, _mm256_loadu_ps(q + D + d))
        if (NG > 2) FMA4(a, 2, _mm256_loadu_ps(q + 2 * D + d))
    }
    __m128 r[3] = {hsum4(a00, a01, a02, a03), hsum4(a10, a11, a12, a13), hsum4(a20, a21, a22, a23)};
    for (int g = 0; g < NG; g++) {
        if (d < D) {  /* a head_dim that is not a multiple of 8 */
            float tail[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (long e = d; e < D; e++)
                for (int j = 0; j < 4; j++) tail[j] += q[g * D + e] * kv1(k, rows[j] + e, half);
            r[g] = _mm_add_ps(r[g], _mm_loadu_ps(tail));
        }
        _mm_storeu_ps(s + g * ATTN_TILE, r[g]);
    }
}

/* acc[g][0:D] += sum_j p[g * ATTN_TILE + j] * (row j of v), for NG (<= ATTN_HEADS) heads (acc rows
 * D apart) over the n rows at rows[j]: 32 columns at a time, so that each V vector is loaded
 * once for the NG heads while their 4 x NG accumulators stay in registers. Meanwhile it asks
 * for its share of the next tile's K rows: of the cache lines at pf[0 .. pf_n), pf_per a V row
 * from pf_from on, pass (32 columns) after pass, n rows a pass. */
static inline __attribute__((always_inline)) void weighted_rows(float *acc, const float *p, const void *v,
                                                                const long *rows, long n, long D, const int NG,
                                                                const int half, const char *const *pf, long pf_n,
                                                                long pf_from, long pf_per) {
    long d = 0;
    for (; d + 32 <= D; d += 32) {
        __m256 c00 = _mm256_loadu_ps(acc + d), c01 = _mm256_loadu_ps(acc + d + 8);
        __m256 c02 = _mm256_loadu_ps(acc + d + 16), c03 = _mm256_loadu_ps(acc + d + 24);
        __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00, c20 = c00, c21 = c00, c22 = c00, c23 = c00;
        if (NG > 1) {
            c10 = _mm256_loadu_ps(acc + D + d), c11 = _mm256_loadu_ps(acc + D + d + 8);
            c12 = _mm256_loadu_ps(acc + D + d + 16), c13 = _mm256_loadu_ps(acc + D + d + 24);
        }
        if (NG > 2) {
            c20 = _mm256_loadu_ps(acc + 2 * D + d), c21 = _mm256_loadu_ps(acc + 2 * D + d + 8);
            c22 = _mm256_loadu_ps(acc + 2 * D + d + 16), c23 = _mm256_loadu_ps(acc + 2 * D + d + 24);
        }
        for (long j = 0; j < n; j++) {
            for (long i = pf_from + (d / 32 * n + j) * pf_per, e = i + pf_per; i < e && i < pf_n; i++)
                _mm_prefetch(pf[i], _MM_HINT_T0);
            const long x = rows[j] + d;
            const __m256 x0 = kv8(v, x, half), x1 = kv8(v, x + 8, half);
            const __m256 x2 = kv8(v, x + 16, half), x3 = kv8(v, x + 24, half);
            FMA4(c, 0, _mm256_broadcast_ss(p + j))
            if (NG > 1) FMA4(c, 1, _mm256_broadcast_ss(p + ATTN_TILE + j))
            if (NG > 2) FMA4(c, 2, _mm256_broadcast_ss(p + 2 * ATTN_TILE + j))
        }
        _mm256_storeu_ps(acc + d, c00), _mm256_storeu_ps(acc + d + 8, c01);
        _mm256_storeu_ps(acc + d + 16, c02), _mm256_storeu_ps(acc + d + 24, c03);
        if (NG > 1) {
            _mm256_storeu_ps(acc + D + d, c10), _mm256_storeu_ps(acc + D + d + 8, c11);
            _mm256_storeu_ps(acc + D + d + 16, c12), _mm256_storeu_ps(acc + D + d + 24, c13);
        }
        if (NG > 2) {
            _mm256_storeu_ps(acc + 2 * D + d, c20), _mm256_storeu_ps(acc + 2 * D + d + 8, c21);
            _mm256_storeu_ps(acc + 2 * D + d + 16, c22), _mm256_storeu_ps(acc + 2 * D + d + 24, c23);
        }
    }
    for (; d + 8 <= D; d += 8)  /* a head_dim that is not a multiple of 32 */
        for (int g = 0; g < NG; g++) {
            __m256 c = _mm256_loadu_ps(acc + g * D + d);
            for (long j = 0; j < n; j++)
                c = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * ATTN_TILE + j), kv8(v, rows[j] + d, half), c);
            _mm256_storeu_ps(acc + g * D + d, c);
        }
    for (; d < D; d++)
        for (int g = 0; g < NG; g++)
            for (long j = 0; j < n; j++) acc[g * D + d] += p[g * ATTN_TILE + j] * kv1(v, rows[j] + d, half);
}

/* The tile routines for the query heads g .. g + ATTN_HEADS - 1 (or to G) of a KV head. */
#define FOR_HEAD_GROUPS(G, CALL)                                                                  \
    for (long g = 0; g < (G); g += ATTN_HEADS) {                                                  \
        switch ((G) - g < ATTN_HEADS ? (G) - g : ATTN_HEADS) {                                    \
        case 3: CALL(3); break;                                                                   \
        case 2: CALL(2); break;                                                                   \
        case 1: CALL(1); break;                                                                   \
        }                                                                                         \
    }

/* n scores x -> cap * tanh(x / cap) (Gemma 2's soft cap), tanh(y) as 1 - 2 / (1 + e^2y). */
static void soft_cap(float *x, long n, float cap) {
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), c = _mm256_set1_ps(cap);
    const __m256 twice_inv = _mm256_set1_ps(2.0f / cap);
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), twice_inv));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(c, _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, e)))));
    }
    for (; i < n; i++) x[i] = cap * tanhf(x[i] / cap);
}

/* Online softmax of every query head (q [Hq, D], already scaled; query heads h*G .. h*G+G-1 read
 * KV head h) over keys [start, end) of one sequence: m (running maxima), l (running sums), acc
 * [Hq, D] (unnormalised outputs). A tile of keys is taken for every KV head before the next, so
 * its cache rows (a token's heads side by side) are read whole and in order. */
static inline __attribute__((always_inline)) void attend_keys(
        const float *q, const void *k_cache, const void *v_cache, const int64_t *table, long Hkv,
        long D, long bs, long G, long start, long end, float *m, float *l, float *acc, float softcap,
        const int half) {
    float s[ATTN_MAX_Q * ATTN_TILE];
    long rows[2 * ATTN_TILE + 8];  /* row offsets (elements, head 0) of the tile's keys and the next
                                      tile's, walked block by block: no division per key */
    long blk = start / bs, off = start % bs;
    const long elt = half ? 2 : 4, row = Hkv * D, row_bytes = row * elt, GD = G * D;
    for (long t0 = start; t0 < end; t0 += ATTN_TILE) {
        const long n = end - t0 < ATTN_TILE ? end - t0 : ATTN_TILE;
        {
            long b = blk, o = off, j = 0;
            for (; j < n + ATTN_TILE && t0 + j < end; j++) {
                rows[j] = (table[b] * bs + o) * row;
                if (++o == bs) o = 0, b++;
                if (j == n - 1) blk = b, off = o;
            }
            for (; j < n + ATTN_TILE + 8; j++) rows[j] = rows[j - 1];  /* the last group of four reads a key again */
        }
        for (long j = 0; j < n; j += 4) {
            /* ask for the whole K rows ATTN_AHEAD keys on and these four's V rows: without it, the
             * kernel read the cache from memory at 0.65x the speed, even where its blocks lay in order */
            for (long a = 0; a < 4; a++)
                for (long b = 0; b < row_bytes; b += 64) {
                    if (t0 == start)  /* later tiles' K rows: asked for with the values before them */
                        _mm_prefetch((const char *)k_cache + rows[j + ATTN_AHEAD + a] * elt + b, _MM_HINT_T0);
                    _mm_prefetch((const char *)v_cache + rows[j + a] * elt + b, _MM_HINT_T0);
                }
            for (long h = 0; h < Hkv; h++) {
                const char *kh = (const char *)k_cache + h * D * elt;
#define SCORES(NG) scores_4keys(q + h * GD + g * D, kh, rows + j, D, s + (h * G + g) * ATTN_TILE + j, NG, half)
                FOR_HEAD_GROUPS(G, SCORES)
#undef SCORES
            }
        }
        for (long g = 0; g < Hkv * G; g++) {
            float *sg = s + g * ATTN_TILE;
            if (softcap > 0.0f) soft_cap(sg, n, softcap);
            /* a NaN score may be skipped here: exp_ps and expf keep it NaN, and so the sums */
            __m256 vtop = _mm256_set1_ps(m[g]);
            long j = 0;
            for (; j + 8 <= n; j += 8) vtop = _mm256_max_ps(vtop, _mm256_loadu_ps(sg + j));
            float tile_max = hmax(vtop);
            for (; j < n; j++) tile_max = sg[j] > tile_max ? sg[j] : tile_max;
            const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - tile_max);
            float sum = 0.0f;
            j = 0;
            __m256 vsum = _mm256_setzero_ps();
            const __m256 vmax = _mm256_set1_ps(tile_max);
            for (; j + 8 <= n; j += 8) {
                const __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + j), vmax));
                _mm256_storeu_ps(sg + j, p);
                vsum = _mm256_add_ps(vsum, p);
            }
            for (; j < n; j++) sum += sg[j] = expf(sg[j] - tile_max);
            l[g] = l[g] * alpha + sum + hsum(vsum);
            m[g] = tile_max;
            if (alpha != 1.0f)
                for (long d = 0; d < D; d++) acc[g * D + d] *= alpha;
        }
        /* The next tile's K rows, asked for while this tile's values are taken, spread evenly over
         * all their passes: the V rows came in with the scores, and memory would idle meanwhile
         * (one thread took 213 cycles a key and KV head from memory, 76 cache-resident). Against
         * no such prefetch (scripts/ab_cpu_kernels.py --kernel attention, 30 layers' float16
         * caches, 2026-12-01): batch 1 context 3500 1.23x, batch 16 context 1000 1.43x, batch 64
         * context 512 1.42x, scattered blocks 1.32x, float32 caches 1.21x, context 200 1.00x. */
        const long next = end - t0 - n < ATTN_TILE ? end - t0 - n : ATTN_TILE;
        const char *pf[ATTN_PF_LINES];
        long pf_n = 0;
        for (long j = 0; j < next; j++)
            for (long b = 0; b < row_bytes && pf_n < ATTN_PF_LINES; b += 64)
                pf[pf_n++] = (const char *)k_cache + rows[n + j] * elt + b;
        const long chunks = D / 32 ? D / 32 : 1;  /* weighted_rows' passes a call (none below 32 columns) */
        const long passes = Hkv * ((G + ATTN_HEADS - 1) / ATTN_HEADS) * chunks;
        const long pf_per = (pf_n + passes * n - 1) / (passes * n);
        long pass = 0;
        for (long h = 0; h < Hkv; h++) {
            const char *vh = (const char *)v_cache + h * D * elt;
#define VALUES(NG) (weighted_rows(acc + h * GD + g * D, s + (h * G + g) * ATTN_TILE, vh, rows, n, D, NG, half, \
                                  pf, pf_n, pass * n * pf_per, pf_per), pass += chunks)
            FOR_HEAD_GROUPS(G, VALUES)
#undef VALUES
        }
    }
}

static void attend_keys_f32(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
                            long Hq, long Hkv, long D, long bs, long start, long end, float *mp, float *lp,
                            float *acc, float softcap) {
    attend_keys(q, k_cache, v_cache, table, Hkv, D, bs, Hq / Hkv, start, end, mp, lp, acc, softcap, 0);
}

static void attend_keys_f16(const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
                            long Hq, long Hkv, long D, long bs, long start, long end, float *mp, float *lp,
                            float *acc, float softcap) {
    attend_keys(q, k_cache, v_cache, table, Hkv, D, bs, Hq / Hkv, start, end, mp, lp, acc, softcap, 1);
}

/* Into how many chunks the keys of each of `tasks` tasks are split, so that every thread has
 * work: aim at 8 tasks a thread, in chunks of >= 256 keys, but one for every thread down to 64
 * keys each (one sequence of 100-256 keys: 1.2-1.45x). */
static long key_chunks(long tasks, long max_len, long threads) {
    if (tasks >= 8 * threads) return 1;
    const long want = (8 * threads + tasks - 1) / tasks;
    const long coarse = (max_len + 255) / 256, fine = (max_len + 63) / 64, even = fine < threads ? fine : threads;
    const long by_length = coarse > even ? coarse : even;
    const long chunks = want < by_length ? want : by_length;
    return chunks > 1 ? chunks : 1;
}

/* out [B, Hq, D] from the partial results of each row's `chunks` chunks of keys, laid out per
 * (row, chunk) as Hq maxima, Hq sums and Hq x D unnormalised outputs: merged by their
 * log-sum-exp (flash-decoding). A chunk that saw no key (sum 0) is skipped. */
static void merge_chunks(const float *part, long chunks, long B, long Hq, long D, float *out) {
    const long part_size = 2 * Hq + Hq * D;
    for (long b = 0; b < B; b++) {
        const float *p0 = part + b * chunks * part_size;
        for (long h = 0; h < Hq; h++) {
            float top = -INFINITY, total = 0.0f;
            for (long c = 0; c < chunks; c++) {
                const float mc = p0[c * part_size + h];
                top = mc > top ? mc : top;
            }
            float *o = out + (b * Hq + h) * D;
            for (long d = 0; d < D; d++) o[d] = 0.0f;
            for (long c = 0; c < chunks; c++) {
                const float *pc = p0 + c * part_size;
                if (pc[Hq + h] == 0.0f) continue;  /* a chunk that saw no key */
                const float w = expf(pc[h] - top);
                total += w * pc[Hq + h];
                axpy_f32(o, w, pc + 2 * Hq + h * D, D);
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            for (long d = 0; d < D; d++) o[d] *= inv;
        }
    }
}

/* Decode attention over a paged KV cache, one query token per sequence.
 *
 * q: row b at q + b * q_row_stride holds its Hq heads of D, float32; k_cache, v_cache: one
 * layer's [num_blocks, bs, Hkv, D], float32, or float16 where kv_half; tables [B, W] int64
 * block IDs; seq_lens [B] int64 (the keys each sequence sees); out [B, Hq, D] contiguous
 * float32. Query heads h*G .. h*G+G-1 read KV head h.
 * A task is one sequence over a chunk of its keys, read in place from the blocks (no
 * gathered copy of the context) with an online softmax, each K and V row once for its
 * group of query heads. The task walks its keys in tiles of ATTN_TILE and takes every KV
 * head over a tile before the next: a token's heads lie side by side in its cache row, so
 * the rows are read whole and in order, and stay in L1 for the heads after the first (one
 * task per KV head read a third of every row; then every KV head over spans of 128 keys in
 * turn, from L2, 0.65-0.75x as fast as this from memory). With few sequences the keys are split
 * into chunks so every thread has work, and the chunks' partial results are merged by
 * their log-sum-exp (flash-decoding). A sequence of length 0 gets zeros. With a sliding `window`
 * > 0, each query sees only its sequence's last `window` keys (0: all); with `softcap` > 0 the
 * scores are softcap * tanh(score / softcap) (Gemma 2's).
 * Hq <= ATTN_MAX_Q, Hq * D <= ATTN_MAX_QD.
 */
void paged_decode_attention(const float *q, long q_row_stride, const void *k_cache, const void *v_cache,
                            const int64_t *tables, const int64_t *seq_lens, float *out,
                            long B, long Hq, long Hkv, long D, long bs, long W, float scale, long kv_half,
                            long window, float softcap) {
    const long QD = Hq * D;
    long max_len = 0;  /* the most keys a sequence sees */
    for (long b = 0; b < B; b++) {
        const long seen = window > 0 && seq_lens[b] > window ? window : seq_lens[b];
        max_len = seen > max_len ? seen : max_len;
    }
    long chunks = key_chunks(B, max_len, omp_get_max_threads());
    /* per (sequence, chunk): Hq maxima, Hq sums, Hq x D accumulators */
    const long part_size = 2 * Hq + QD;
    float *part = chunks > 1 ? (float *)malloc(sizeof(float) * B * chunks * part_size) : 0;
    if (!part) chunks = 1;  /* no room for the partial results: each task takes a whole sequence */
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (B * chunks > 1)
    for (long b = 0; b < B; b++) {
        for (long c = 0; c < chunks; c++) {
            const long L = seq_lens[b], first = window > 0 && L > window ? L - window : 0;
            const long per = (L - first + chunks - 1) / chunks;
            const long start = first + c * per < L ? first + c * per : L, end = start + per < L ? start + per : L;
            float mp[ATTN_MAX_Q], lp[ATTN_MAX_Q], acc[ATTN_MAX_QD], qs[ATTN_MAX_QD];
            for (long h = 0; h < Hq; h++) mp[h] = -INFINITY, lp[h] = 0.0f;
            for (long i = 0; i < QD; i++) acc[i] = 0.0f, qs[i] = q[b * q_row_stride + i] * scale;
            (kv_half ? attend_keys_f16 : attend_keys_f32)(qs, k_cache, v_cache, tables + b * W, Hq, Hkv, D, bs,
                                                          start, end, mp, lp, acc, softcap);
            if (chunks == 1) {
                float *o = out + b * QD;
                for (long h = 0; h < Hq; h++) {
                    const float inv = lp[h] > 0.0f ? 1.0f / lp[h] : 0.0f;
                    for (long d = 0; d < D; d++) o[h * D + d] = acc[h * D + d] * inv;
                }
            } else {
                float *p = part + (b * chunks + c) * part_size;
                for (long h = 0; h < Hq; h++) p[h] = mp[h], p[Hq + h] = lp[h];
                for (long i = 0; i < QD; i++) p[2 * Hq + i] = acc[i];
            }
        }
    }
    if (chunks > 1) {
        merge_chunks(part, chunks, B, Hq, D, out);
        free(part);
    }
}

/* ---- Prefill attention over the paged KV cache ---------------------------------------------
 *
 * paged_prefill_attention: each sequence's query rows (a prefill chunk, at the last positions
 * before its length) attend causally over its cache, which holds the chunk's own keys once
 * they are written. The decode kernel would read every key once per query row; here a task
 * takes PF_LANES query vectors at once (consecutive (row, head) pairs of one KV head's group,
 * row-major) and reads each tile of PF_KEYS keys once for all of them, widened to float32
 * once. Both products keep the lanes in vectors, as the packed GEMM keeps its outputs: the
 * scores s[key][lane] = sum_d K[key][d] * qt[d][lane] (the queries scaled and packed
 * transposed once a task) and the outputs acc[d][lane] += sum_key V[key][d] * s[key][lane],
 * each an FMA of a broadcast K or V element and a vector of lanes, two keys or two columns at
 * a time into 12 accumulators. No horizontal sums; the online softmax (max, exp, sum, the
 * rescaling of the outputs) runs down the lanes, masking the keys past each lane's position
 * only in the tiles that reach past the task's first position. With AVX512-BF16, where the
 * caller asks (bf16_dot) and D is a multiple of 16, both products take VDPBF16PS on pairs of
 * bfloat16: the queries packed in pairs along d, the tile's K rows in bfloat16 and its V and
 * the softmax's weights in pairs of keys, so each instruction does two FMAs' products. */

/* The lanes' vectors: VL floats, 512-bit where the CPU has AVX-512 (a task then takes 96 lanes
 * in its six vectors, twice the queries each K and V tile is widened for), else 256-bit. */
#ifdef __AVX512F__
#define VL 16
typedef __m512 lanes_t;
#define L_LOAD _mm512_load_ps
#define L_STORE _mm512_store_ps
#define L_BCAST(p) _mm512_set1_ps(*(p))
#define L_ZERO _mm512_setzero_ps
#define L_FMA _mm512_fmadd_ps
#define L_MUL _mm512_mul_ps
#define L_ADD _mm512_add_ps
#define L_SUB _mm512_sub_ps
#define L_MAX _mm512_max_ps
#define L_EXP exp512_ps
#define L_PIN(r) __asm__("" : "+v"(r))
/* x, with -inf in the lanes whose position pos[] is before key t */
static inline lanes_t lanes_mask_past(lanes_t x, long t, const int32_t *pos) {
    const __mmask16 past = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int)t), _mm512_load_si512(pos));
    return _mm512_mask_blend_ps(past, x, _mm512_set1_ps(-INFINITY));
}
/* x, with 0 in the lanes where ref is -inf */
static inline lanes_t lanes_zero_where_ninf(lanes_t x, lanes_t ref) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ref, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), x, _mm512_setzero_ps());
}
#else
#define VL 8
typedef __m256 lanes_t;
#define L_LOAD _mm256_load_ps
#define L_STORE _mm256_store_ps
#define L_BCAST _mm256_broadcast_ss
#define L_ZERO _mm256_setzero_ps
#define L_FMA _mm256_fmadd_ps
#define L_MUL _mm256_mul_ps
#define L_ADD _mm256_add_ps
#define L_SUB _mm256_sub_ps
#define L_MAX _mm256_max_ps
#define L_EXP exp_ps
#define L_PIN(r) __asm__("" : "+x"(r))
static inline lanes_t lanes_mask_past(lanes_t x, long t, const int32_t *pos) {
    const __m256i past = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)t), _mm256_load_si256((const __m256i *)pos));
    return _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(past));
}
static inline lanes_t lanes_zero_where_ninf(lanes_t x, lanes_t ref) {
    return _mm256_andnot_ps(_mm256_cmp_ps(ref, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), x);
}
#endif

#define PF_VECS 6                 /* vectors of query lanes a task takes */
#define PF_LANES (VL * PF_VECS)
#define PF_KEYS 32                /* keys a tile (even: the scores take two at a time) */

/* a##i += x * r[VL i..], b##i += y * r[VL i..] for the first NV vectors of lanes at r (with
 * DOT, x, y and r hold pairs of bfloat16, and each lane adds both pairs' products) */
#define LANE_FMA(i)                                                                               \
    if (NV > i) {                                                                                 \
        lanes_t r_ = L_LOAD(r + VL * i);                                                          \
        L_PIN(r_); /* one load for both FMAs: the compiler would fold it into each */             \
        a##i = L_MADD(x, r_, a##i), b##i = L_MADD(y, r_, b##i);                                   \
    }
#ifdef BF16_DOT
#define L_MADD(x, r, a) (DOT ? DPBF16(a, x, r) : L_FMA(x, r, a))
#define L_BCAST_PAIR BCAST_BF16_PAIR
#else
#define L_MADD(x, r, a) L_FMA(x, r, a)
#define L_BCAST_PAIR(p) L_BCAST((const float *)(p))
#endif
#define LANE_FMAS LANE_FMA(0) LANE_FMA(1) LANE_FMA(2) LANE_FMA(3) LANE_FMA(4) LANE_FMA(5)

/* s[j][lane] = sum_d kt[j][d] * qt[d][lane] for the keys j < n of a tile (rows Dp apart; a spare
 * row of zeros when n is odd) and the lanes of the first NV vectors. With DOT, kt holds
 * bfloat16 and qt [D / 2][lane] pairs of them (d, d + 1). */
static inline __attribute__((always_inline)) void lane_scores(const float *qt, const void *kt, long n, long D,
                                                              long Dp, float *s, const int NV, const int DOT) {
    for (long j = 0; j < n; j += 2) {
        lanes_t a0 = L_ZERO(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        lanes_t b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
        if (DOT) {
            const uint16_t *k0 = (const uint16_t *)kt + j * Dp, *k1 = k0 + Dp;
            for (long d = 0; d < D; d += 2) {
                const float *r = qt + d / 2 * PF_LANES;
                const lanes_t x = L_BCAST_PAIR(k0 + d), y = L_BCAST_PAIR(k1 + d);
                LANE_FMAS
            }
        } else {
            const float *k0 = (const float *)kt + j * Dp, *k1 = k0 + Dp;
            for (long d = 0; d < D; d++) {
                const float *r = qt + d * PF_LANES;
                const lanes_t x = L_BCAST(k0 + d), y = L_BCAST(k1 + d);
                LANE_FMAS
            }
        }
        float *s0 = s + j * PF_LANES, *s1 = s0 + PF_LANES;
#define STORE(i) if (NV > i) L_STORE(s0 + VL * i, a##i), L_STORE(s1 + VL * i, b##i);
        STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
    }
}

/* acc[d][lane] = acc[d][lane] * alpha[lane] + sum_j vt[j][d] * s[j][lane] over the keys j < n of a
 * tile (rows Dp apart; a spare column of zeros when D is odd), two columns at a time. With DOT,
 * s [n / 2][lane] and vt [n / 2][Dp] hold pairs of bfloat16 (keys j, j + 1; the spare key of
 * an odd n zeros). */
static inline __attribute__((always_inline)) void lane_values(float *acc, const float *s, const void *vt,
                                                              const float *alpha, long n, long D, long Dp,
                                                              const int NV, const int DOT) {
    for (long d = 0; d < D; d += 2) {
        float *c0 = acc + d * PF_LANES, *c1 = c0 + PF_LANES;
#define LOAD(i)                                                                                   \
        if (NV > i) {                                                                             \
            const lanes_t f_ = L_LOAD(alpha + VL * i);                                            \
            a##i = L_MUL(L_LOAD(c0 + VL * i), f_);                                                \
            b##i = L_MUL(L_LOAD(c1 + VL * i), f_);                                                \
        }
        lanes_t a0 = L_ZERO(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        lanes_t b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
        LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5)
#undef LOAD
        if (DOT) {
            for (long j = 0; j < n; j += 2) {
                const float *r = s + j / 2 * PF_LANES;
                const int32_t *v = (const int32_t *)vt + j / 2 * Dp + d;
                const lanes_t x = L_BCAST_PAIR(v), y = L_BCAST_PAIR(v + 1);
                LANE_FMAS
            }
        } else {
            for (long j = 0; j < n; j++) {
                const float *r = s + j * PF_LANES, *v = (const float *)vt + j * Dp + d;
                const lanes_t x = L_BCAST(v), y = L_BCAST(v + 1);
                LANE_FMAS
            }
        }
#define STORE(i) if (NV > i) L_STORE(c0 + VL * i, a##i), L_STORE(c1 + VL * i, b##i);
        STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
    }
}
#undef LANE_FMAS
#undef LANE_FMA

/* The online softmax over a tile's scores s [n][PF_LANES] (keys t0 .. t0 + n - 1) for the lanes
 * of the first NV vectors: with `masked`, keys past a lane's position pos[lane] score -inf.
 * m, l: each lane's running max and sum; the scores become their weights, and alpha the factor
 * the lane's earlier weighted sum of values takes. With DOT, the weights (rounded to bfloat16
 * next) come from exp512_bf16. */
static inline __attribute__((always_inline)) void lane_softmax(float *s, long n, long t0, const int32_t *pos,
                                                               int masked, float *m, float *l, float *alpha,
                                                               const int NV, const int DOT) {
    for (int v = 0; v < NV; v++) {
        const lanes_t old = L_LOAD(m + VL * v);
        lanes_t top = old;
        for (long j = 0; j < n; j++) {
            float *sj = s + j * PF_LANES + VL * v;
            lanes_t x = L_LOAD(sj);
            if (masked) {
                x = lanes_mask_past(x, t0 + j, pos + VL * v);
                L_STORE(sj, x);
            }
            top = L_MAX(top, x);  /* a NaN score may be skipped here: the exp keeps it NaN */
        }
        const lanes_t a = lanes_zero_where_ninf(L_EXP(L_SUB(old, top)), old);
        /* a lane that has seen no key yet (a chunk of keys past its position) weighs them 0 */
        const lanes_t base = lanes_zero_where_ninf(top, top);
        lanes_t sum = L_ZERO();
        for (long j = 0; j < n; j++) {
            float *sj = s + j * PF_LANES + VL * v;
#ifdef BF16_DOT
            const lanes_t w = DOT ? exp512_bf16(L_SUB(L_LOAD(sj), base)) : L_EXP(L_SUB(L_LOAD(sj), base));
#else
            const lanes_t w = L_EXP(L_SUB(L_LOAD(sj), base));
#endif
            L_STORE(sj, w);
            sum = L_ADD(sum, w);
        }
        L_STORE(l + VL * v, L_ADD(L_MUL(L_LOAD(l + VL * v), a), sum));
        L_STORE(m + VL * v, top);
        L_STORE(alpha + VL * v, a);
    }
}

/* A task's scratch, 64-byte aligned arrays of floats: qt [D][PF_LANES], kt and vt [PF_KEYS][Dp],
 * s [PF_KEYS][PF_LANES], acc [Dp][PF_LANES], m, l, alpha [PF_LANES]; then pos [PF_LANES] int32;
 * then (for the bfloat16 dot products) the tile's K and V as lane_scores and lane_values take
 * them, [PF_KEYS][Dp] bfloat16 each, and (for AMX's tiles) V transposed, [Dp][PF_KEYS] bfloat16. */
static long prefill_scratch_bytes(long D) {
    const long Dp = (D + 7) / 8 * 8;
    return sizeof(float) * (D * PF_LANES + 2 * PF_KEYS * Dp + PF_KEYS * PF_LANES + Dp * PF_LANES + 3 * PF_LANES)
           + sizeof(int32_t) * PF_LANES + sizeof(uint16_t) * 3 * PF_KEYS * Dp;
}

#ifdef AMX
/* The prefill attention's products through AMX's tiles (DOT == 2 below), in the layouts the
 * bfloat16 dot products use, transposed where a tile needs them so: the scores as s^T = K q^T,
 * a tile of 16 keys' bfloat16 K rows (32 d) against the queries' pairs along d (qt: 16 pairs of
 * d by 16 lanes) into s[key][lane]; the values as acc^T += V^T p, a tile of 16 columns of V's
 * bfloat16 rows transposed (vT: 16 d by the tile's 32 keys) against the softmax's weights in
 * pairs of keys (16 pairs by 16 lanes) into acc[d][lane], loaded and stored around each
 * product. Each product takes a pair of lane vectors with two tiles of keys (scores) or of
 * columns (values): tiles 0-3 sums, 4-5 K or V^T, 6-7 the lanes'. Needs D a multiple of 32. */

/* 16 x 16 32-bit elements at src (rows `from` floats apart) transposed to dst (rows `to` apart). */
static inline void transpose16(const float *src, long from, float *dst, long to) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * from);
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int g = 0; g < 16; g += 4)
        for (int j = 0; j < 2; j++) {
            const __m512d a = _mm512_castps_pd(t[g + j]), b = _mm512_castps_pd(t[g + j + 2]);
            r[g + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            r[g + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    for (int h = 0; h < 16; h += 8)
        for (int j = 0; j < 4; j++) {
            t[h + j] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0x88);
            t[h + j + 4] = _mm512_shuffle_f32x4(r[h + j], r[h + j + 4], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * to, r[i]);
}

/* s[j][lane] = sum_d kb[j][d] qt[d][lane] for the tile's keys j < n (16 at a time) and the lanes of
 * the first NV vectors: kb [PF_KEYS][Dp] bfloat16, qt [D / 2][PF_LANES] pairs along d. */
static inline __attribute__((always_inline)) void amx_scores(const float *qt, const uint16_t *kb, long n, long D,
                                                             long Dp, float *s, const int NV) {
    const int second = n > 16;  /* keys 16 .. 31 */
    for (int v = 0; v < NV; v += 2) {
        const int pair = v + 1 < NV;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (long d = 0; d < D; d += 32) {
            const float *r = qt + d / 2 * PF_LANES + v * VL;
            _tile_loadd(4, kb + d, Dp * 2);
            _tile_loadd(6, r, PF_LANES * 4);
            _tile_dpbf16ps(0, 4, 6);
            if (pair) {
                _tile_loadd(7, r + VL, PF_LANES * 4);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (second) {
                _tile_loadd(5, kb + 16 * Dp + d, Dp * 2);
                _tile_dpbf16ps(2, 5, 6);
                if (pair) _tile_dpbf16ps(3, 5, 7);
            }
        }
        float *o = s + v * VL;
        _tile_stored(0, o, PF_LANES * 4);
        if (pair) _tile_stored(1, o + VL, PF_LANES * 4);
        if (second) {
            _tile_stored(2, o + 16 * PF_LANES, PF_LANES * 4);
            if (pair) _tile_stored(3, o + 16 * PF_LANES + VL, PF_LANES * 4);
        }
    }
}

/* acc[d][lane] = acc[d][lane] * alpha[lane] + sum_j vT[d][j] p[j][lane] over the tile's PF_KEYS keys
 * (the weights of those past its last zeros) for the lanes of the first NV vectors: vT [D][PF_KEYS]
 * bfloat16, p [PF_KEYS / 2][PF_LANES] pairs of keys. */
static inline __attribute__((always_inline)) void amx_values(float *acc, const float *p, const uint16_t *vT,
                                                             const float *alpha, long D, const int NV) {
    __mmask16 scaled = 0;  /* the lanes whose max rose (most tiles after the first few: none) */
    for (int v = 0; v < NV; v++) scaled |= _mm512_cmp_ps_mask(_mm512_load_ps(alpha + v * VL), _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);
    if (scaled)
        for (long d = 0; d < D; d++)
            for (int v = 0; v < NV; v++) {
                float *a = acc + d * PF_LANES + v * VL;
                _mm512_store_ps(a, _mm512_mul_ps(_mm512_load_ps(a), _mm512_load_ps(alpha + v * VL)));
            }
    for (long d = 0; d < D; d += 32)
        for (int v = 0; v < NV; v += 2) {
            const int pair = v + 1 < NV;
            float *c = acc + d * PF_LANES + v * VL;
            _tile_loadd(0, c, PF_LANES * 4);
            _tile_loadd(2, c + 16 * PF_LANES, PF_LANES * 4);
            _tile_loadd(4, vT + d * PF_KEYS, PF_KEYS * 2);
            _tile_loadd(5, vT + (d + 16) * PF_KEYS, PF_KEYS * 2);
            _tile_loadd(6, p + v * VL, PF_LANES * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            _tile_stored(0, c, PF_LANES * 4);
            _tile_stored(2, c + 16 * PF_LANES, PF_LANES * 4);
            if (pair) {
                _tile_loadd(1, c + VL, PF_LANES * 4);
                _tile_loadd(3, c + 16 * PF_LANES + VL, PF_LANES * 4);
                _tile_loadd(7, p + (v + 1) * VL, PF_LANES * 4);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
                _tile_stored(1, c + VL, PF_LANES * 4);
                _tile_stored(3, c + 16 * PF_LANES + VL, PF_LANES * 4);
            }
        }
}
#endif

#ifdef BF16_DOT
/* 16 columns from d of a tile's keys j and j + 1 (K rows k0, k1, V rows v0, v1): K's into kb as
 * bfloat16 rows Dp apart, V's into vb as pairs (j, j + 1), a row of Dp pairs per pair of keys. */
static inline __attribute__((always_inline)) void keys_bf16(uint16_t *kb, uint16_t *vb, long j, long d, long Dp,
                                                            __m512 k0, __m512 k1, __m512 v0, __m512 v1) {
    _mm256_storeu_si256((__m256i *)(kb + j * Dp + d), (__m256i)_mm512_cvtneps_pbh(k0));
    _mm256_storeu_si256((__m256i *)(kb + (j + 1) * Dp + d), (__m256i)_mm512_cvtneps_pbh(k1));
    _mm512_storeu_ps((float *)vb + j / 2 * Dp + d, bf16_pairs(v0, v1));
}
#endif

/* One task: the query lanes first .. first + count - 1 (lane i: row i / G, query head h * G + i % G)
 * of a sequence whose query rows start at q row `row0`, at position pos0, over its keys k0 .. k1 - 1
 * (up to the last lane's position; with a sliding `window` > 0, from the first lane's window on,
 * each lane's keys before its own window masked), into out (rows Hq * D), or where `part` is
 * given, their partial results for merge_chunks: the lane's row's chunk c of `chunks` at part
 * (rows from the call's first). */
static inline __attribute__((always_inline)) void prefill_task(
        const float *q, long q_row_stride, const void *k_cache, const void *v_cache, const int64_t *table,
        long Hq, long Hkv, long D, long bs, long h, long row0, long pos0, long first, long count, long k0,
        long k1, float scale, float *out, float *part, long part_row0, long c, long chunks, float *scratch,
        long window, float softcap, const int NV, const int half, const int DOT) {
    const long G = Hq / Hkv, Dp = (D + 7) / 8 * 8;
    float *qt = scratch, *kt = qt + D * PF_LANES, *vt = kt + PF_KEYS * Dp, *s = vt + PF_KEYS * Dp;
    float *acc = s + PF_KEYS * PF_LANES, *m = acc + Dp * PF_LANES, *l = m + PF_LANES, *alpha = l + PF_LANES;
    int32_t *pos = (int32_t *)(alpha + PF_LANES);
    uint16_t *kb = (uint16_t *)(pos + PF_LANES), *vb = kb + PF_KEYS * Dp, *vT = vb + PF_KEYS * Dp;
#ifdef AMX
    if (DOT == 2) amx_configure();
#endif
    for (long i = 0; i < PF_LANES; i++) {
        const long lane = first + (i < count ? i : count - 1), r = lane / G;  /* spare lanes repeat the last */
        const float *src = q + (row0 + r) * q_row_stride + (h * G + lane % G) * D;
#ifdef BF16_DOT
        if (DOT)  /* pairs (d, d + 1) of bfloat16 */
            for (long d = 0; d < D; d += 2)
                ((uint32_t *)qt)[d / 2 * PF_LANES + i] = bf16_bits(src[d] * scale) | (uint32_t)bf16_bits(src[d + 1] * scale) << 16;
        else
#endif
        for (long d = 0; d < D; d++) qt[d * PF_LANES + i] = src[d] * scale;
        pos[i] = (int32_t)(pos0 + r);
        m[i] = -INFINITY, l[i] = 0.0f;
    }
    for (long i = 0; i < Dp * PF_LANES; i++) acc[i] = 0.0f;
    for (long j = 0; j < PF_KEYS; j++)  /* the columns past D stay zero (lane_values reads column D when D is odd) */
        for (long d = D; d < Dp; d++) kt[j * Dp + d] = vt[j * Dp + d] = 0.0f;
    const long end = pos[PF_LANES - 1] + 1 < k1 ? pos[PF_LANES - 1] + 1 : k1, kv_row = Hkv * D;
    if (window > 0 && k0 < pos[0] - window + 1) k0 = pos[0] - window + 1;  /* no lane sees the keys before */
    long blk = k0 / bs, off = k0 % bs;
    for (long t0 = k0; t0 < end; t0 += PF_KEYS) {
        const long n = end - t0 < PF_KEYS ? end - t0 : PF_KEYS;
#ifdef AMX
        if (DOT == 2) {  /* K's rows in bfloat16 and V's in pairs of rows (j, j + 1) straight from the cache */
            long rows[PF_KEYS];
            for (long j = 0; j < n; j++) {
                rows[j] = (table[blk] * bs + off) * kv_row + h * D;
                if (++off == bs) off = 0, blk++;
            }
            for (long j = 0; j < PF_KEYS; j += 2)
                for (long d = 0; d < D; d += 16) {
                    const __m512 zero = _mm512_setzero_ps();
                    const __m512 ka = j < n ? kv16(k_cache, rows[j] + d, half) : zero;
                    const __m512 kz = j + 1 < n ? kv16(k_cache, rows[j + 1] + d, half) : zero;
                    const __m512 va = j < n ? kv16(v_cache, rows[j] + d, half) : zero;
                    const __m512 vz = j + 1 < n ? kv16(v_cache, rows[j + 1] + d, half) : zero;
                    keys_bf16(kb, vb, j, d, Dp, ka, kz, va, vz);
                }
        } else
#endif
        for (long j = 0; j < n; j++) {  /* the tile's K and V rows, widened */
            const long row = (table[blk] * bs + off) * kv_row + h * D;
            float *kj = kt + j * Dp, *vj = vt + j * Dp;
            long d = 0;
            for (; d + 8 <= D; d += 8) {
                _mm256_store_ps(kj + d, kv8(k_cache, row + d, half));
                _mm256_store_ps(vj + d, kv8(v_cache, row + d, half));
            }
            for (; d < D; d++) kj[d] = kv1(k_cache, row + d, half), vj[d] = kv1(v_cache, row + d, half);
            if (++off == bs) off = 0, blk++;
        }
        const long elt = half ? 2 : 4;  /* the next tile's rows, asked for while this one is computed */
        for (long t = t0 + PF_KEYS; t < t0 + 2 * PF_KEYS && t < end; t++) {
            const long row = ((table[t / bs] * bs + t % bs) * kv_row + h * D) * elt;
            for (long b = 0; b < D * elt; b += 64) {
                _mm_prefetch((const char *)k_cache + row + b, _MM_HINT_T0);
                _mm_prefetch((const char *)v_cache + row + b, _MM_HINT_T0);
            }
        }
        if (n % 2 && DOT != 2)  /* the scores take keys in pairs: the spare one is zeros (AMX's: above) */
            for (long d = 0; d < Dp; d++) kt[n * Dp + d] = vt[n * Dp + d] = 0.0f;
#ifdef BF16_DOT
        if (DOT == 1) {  /* K's rows in bfloat16; V's in pairs of rows (j, j + 1) */
            for (long j = 0; j < n + n % 2; j += 2)
                for (long d = 0; d < Dp; d += 16) {
                    const __m512 k0 = _mm512_load_ps(kt + j * Dp + d), k1 = _mm512_load_ps(kt + (j + 1) * Dp + d);
                    const __m512 v0 = _mm512_load_ps(vt + j * Dp + d), v1 = _mm512_load_ps(vt + (j + 1) * Dp + d);
                    keys_bf16(kb, vb, j, d, Dp, k0, k1, v0, v1);
                }
        }
#endif
#ifdef AMX
        if (DOT == 2) {
            for (long d = 0; d < D; d += 16)  /* V^T: the pairs of rows' columns as rows */
                transpose16((const float *)vb + d, Dp, (float *)vT + d * PF_KEYS / 2, PF_KEYS / 2);
            amx_scores(qt, kb, n, D, Dp, s, NV);
        } else
#endif
        lane_scores(qt, DOT ? (const void *)kb : kt, n, D, Dp, s, NV, DOT);
        if (softcap > 0.0f)
            for (long j = 0; j < n; j++) soft_cap(s + j * PF_LANES, NV * VL, softcap);
        if (window > 0 && t0 <= pos[PF_LANES - 1] - window)  /* keys before a lane's window: hidden */
            for (long j = 0; j < n; j++)
                for (long i = 0; i < NV * VL; i++)
                    if (t0 + j <= pos[i] - window) s[j * PF_LANES + i] = -INFINITY;
        lane_softmax(s, n, t0, pos, t0 + n - 1 > pos[0], m, l, alpha, NV, DOT);
#ifdef BF16_DOT
        if (DOT) {  /* the weights in pairs of keys (j, j + 1), in place; the spare keys' zeros */
            for (long j = 0; j < (DOT == 2 ? PF_KEYS : n); j += 2)
                for (int v = 0; v < NV; v++) {
                    const __m512 w0 = j < n ? _mm512_load_ps(s + j * PF_LANES + VL * v) : _mm512_setzero_ps();
                    const __m512 w1 = j + 1 < n ? _mm512_load_ps(s + (j + 1) * PF_LANES + VL * v) : _mm512_setzero_ps();
                    _mm512_store_ps(s + j / 2 * PF_LANES + VL * v, bf16_pairs(w0, w1));
                }
        }
#endif
#ifdef AMX
        if (DOT == 2)
            amx_values(acc, s, vT, alpha, D, NV);
        else
#endif
        lane_values(acc, s, DOT ? (const void *)vb : vt, alpha, n, D, Dp, NV, DOT);
    }
#ifdef AMX
    if (DOT == 2) _tile_release();
#endif
    for (long i = 0; i < count; i++) {
        const long lane = first + i, head = h * G + lane % G;
        if (part) {
            float *p = part + ((row0 - part_row0 + lane / G) * chunks + c) * (2 * Hq + Hq * D);
            p[head] = m[i], p[Hq + head] = l[i];
            for (long d = 0; d < D; d++) p[2 * Hq + head * D + d] = acc[d * PF_LANES + i];
        } else {
            float *o = out + (row0 + lane / G) * Hq * D + head * D;
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            for (long d = 0; d < D; d++) o[d] = acc[d * PF_LANES + i] * inv;
        }
    }
}

/* prefill_task for each cache type (and with AVX512-BF16, with and without the bfloat16 dot
 * products), with as many vectors of lanes as `count` needs */
typedef void (*prefill_task_fn)(const float *q, long q_row_stride, const void *k_cache, const void *v_cache,
                                const int64_t *table, long Hq, long Hkv, long D, long bs, long h, long row0,
                                long pos0, long first, long count, long k0, long k1, float scale, float *out,
                                float *part, long part_row0, long c, long chunks, float *scratch, long window,
                                float softcap);
#define PREFILL_TASK(NAME, HALF, DOT)                                                             \
    static void NAME(const float *q, long q_row_stride, const void *k_cache, const void *v_cache, \
                     const int64_t *table, long Hq, long Hkv, long D, long bs, long h, long row0,  \
                     long pos0, long first, long count, long k0, long k1, float scale, float *out, \
                     float *part, long part_row0, long c, long chunks, float *scratch, long window,  \
                     float softcap) {                                                             \
        switch ((count + VL - 1) / VL) {                                                          \
        TASK_CASE(1, HALF, DOT) TASK_CASE(2, HALF, DOT) TASK_CASE(3, HALF, DOT)                   \
        TASK_CASE(4, HALF, DOT) TASK_CASE(5, HALF, DOT) default: TASK_CASE(6, HALF, DOT)          \
        }                                                                                         \
    }
#define TASK_CASE(NV, HALF, DOT)                                                                  \
    case NV:                                                                                      \
        prefill_task(q, q_row_stride, k_cache, v_cache, table, Hq, Hkv, D, bs, h, row0, pos0, first, count, \
                     k0, k1, scale, out, part, part_row0, c, chunks, scratch, window, softcap, NV, HALF, DOT); \
        break;
PREFILL_TASK(prefill_task_f32, 0, 0)
PREFILL_TASK(prefill_task_f16, 1, 0)
#ifdef BF16_DOT
PREFILL_TASK(prefill_task_f32_dot, 0, 1)
PREFILL_TASK(prefill_task_f16_dot, 1, 1)
#endif
#ifdef AMX
PREFILL_TASK(prefill_task_f32_amx, 0, 2)
PREFILL_TASK(prefill_task_f16_amx, 1, 2)
#endif
#undef TASK_CASE
#undef PREFILL_TASK

/* Causal attention of S sequences' query rows over the paged cache.
 *
 * Sequence s's query rows are rows query_start_loc[s] .. query_start_loc[s + 1] - 1 of q (row b
 * at q + b * q_row_stride holds its Hq heads of D, float32), at the last positions before
 * seq_lens[s]; each sees the keys up to its own position, through row s of tables [S, W] (int64
 * block IDs; the keys must be written). k_cache, v_cache: one layer's [num_blocks, bs, Hkv, D],
 * float32, or float16 where kv_half. out: rows like q's, Hq * D apart, float32. The tasks (a
 * sequence's KV head and PF_LANES of its query lanes) run longest first; with too few of them
 * for the threads (a few rows after a long context: a prompt's last chunk, a cached chat's new
 * turn) each also takes only a chunk of the keys, merged after as the decodes' are. With a
 * sliding `window` > 0, each row sees only its last `window` keys (its own among them); `softcap`
 * as paged_decode_attention's.
 * Returns 0, or -1 (computing nothing) when there is no memory for the scratch. */
int paged_prefill_attention(const float *q, long q_row_stride, const void *k_cache, const void *v_cache,
                            const int64_t *query_start_loc, const int64_t *tables, const int64_t *seq_lens,
                            float *out, long S, long Hq, long Hkv, long D, long bs, long W, float scale,
                            long kv_half, long bf16_dot, long window, float softcap) {
    const long G = Hq / Hkv, row0 = query_start_loc[0], rows = query_start_loc[S] - row0;
    prefill_task_fn task = kv_half ? prefill_task_f16 : prefill_task_f32;
#ifdef BF16_DOT
    if (bf16_dot && D % 16 == 0) task = kv_half ? prefill_task_f16_dot : prefill_task_f32_dot;
#endif
#ifdef AMX
    if (bf16_dot && amx_permitted && D % 32 == 0) task = kv_half ? prefill_task_f16_amx : prefill_task_f32_amx;
#endif
    long num_tasks = 0, max_len = 0;  /* the most keys a sequence's rows see */
    for (long s = 0; s < S; s++) {
        const long n = query_start_loc[s + 1] - query_start_loc[s];
        num_tasks += Hkv * ((n * G + PF_LANES - 1) / PF_LANES);
        const long seen = window > 0 && seq_lens[s] > window + n ? window + n : seq_lens[s];
        max_len = seen > max_len ? seen : max_len;
    }
    if (!num_tasks) return 0;
    const long chunks = key_chunks(num_tasks, max_len, omp_get_max_threads());
    num_tasks *= chunks;
    const long threads = omp_get_max_threads() < num_tasks ? omp_get_max_threads() : num_tasks;
    const long scratch_floats = (prefill_scratch_bytes(D) + 63) / 64 * 16;
    long *tasks = (long *)malloc(sizeof(long) * 4 * num_tasks);
    float *scratch = (float *)aligned_alloc(64, sizeof(float) * scratch_floats * threads);
    float *part = chunks > 1 ? (float *)malloc(sizeof(float) * rows * chunks * (2 * Hq + Hq * D)) : 0;
    if (!tasks || !scratch || (chunks > 1 && !part)) {
        free(tasks), free(scratch), free(part);
        return -1;
    }
    long t = 0;
    for (long s = 0; s < S; s++) {
        const long lanes = (query_start_loc[s + 1] - query_start_loc[s]) * G;
        for (long h = 0; h < Hkv; h++)
            for (long first = 0; first < lanes; first += PF_LANES)
                for (long c = 0; c < chunks; c++)
                    tasks[4 * t] = s, tasks[4 * t + 1] = h, tasks[4 * t + 2] = first, tasks[4 * t + 3] = c, t++;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long i = num_tasks - 1; i >= 0; i--) {  /* a sequence's last lanes see the most keys */
        const long s = tasks[4 * i], h = tasks[4 * i + 1], first = tasks[4 * i + 2], c = tasks[4 * i + 3];
        const long start = query_start_loc[s], n = query_start_loc[s + 1] - start, lanes = n * G;
        /* the keys any of the sequence's rows see, split into the chunks */
        const long lo = window > 0 && seq_lens[s] - n - window + 1 > 0 ? seq_lens[s] - n - window + 1 : 0;
        const long count = lanes - first < PF_LANES ? lanes - first : PF_LANES, per = (seq_lens[s] - lo + chunks - 1) / chunks;
        task(q, q_row_stride, k_cache, v_cache, tables + s * W, Hq, Hkv, D, bs, h, start, seq_lens[s] - n, first,
             count, lo + c * per, lo + (c + 1) * per, scale, out, part, row0, c, chunks,
             scratch + omp_get_thread_num() * scratch_floats, window, softcap);
    }
    if (part)
        merge_chunks(part, chunks, rows, Hq, D, out + row0 * Hq * D);
    free(tasks), free(scratch), free(part);
    return 0;
}

/* ---- A step of a Llama-family model in one call -------------------------------------------
 *
 * What the Python path runs for a step, op for op (the same GEMM, RMSNorm and
 * attention kernels as above), without a return to Python between them: on a 2-core machine
 * the hundreds of small torch ops and calls a step makes in Python cost about as much as
 * reading the weights (see cpu_kernels.py: StepForward). The decodes attend through
 * paged_decode_attention, the prefill chunks through paged_prefill_attention: each token over
 * its sequence's cache up to its own position, which holds the whole chunk's keys once they
 * are written (causal attention). */

/* A linear layer's weight as a GEMV reads it: its data and its WEIGHT_* type. */
typedef struct {
    const void *data;
    long type;
} Weight;

/* Each linear layer's weight for steps of more than quant_max_tokens tokens ([0]) and its
 * GGUF blocks for steps of at most that many ([1], data NULL where it has none); a layer that
 * keeps only its blocks has them at [0], for every step (the quantized GEMVs take any size). */
typedef struct {
    const float *input_norm, *post_norm;    /* [H] (input_norm NULL for OLMo 2) */
    Weight qkv[2], o[2], gate_up[2], down[2]; /* [N, K] */
    const float *qkv_bias;                  /* [Hq * D + 2 * Hkv * D] or NULL (Qwen2 has one) */
    const float *q_norm, *k_norm;           /* [D] or NULL (Qwen3's per-head RMSNorm) */
    void *k_cache, *v_cache;                /* [num_blocks * bs, Hkv, D] each, float32 or float16 */
    long window;                            /* its sliding window, or 0 (Mistral's, Phi-3's, Gemma 3's) */
    /* Gemma 3's: the norms before and after the MLP (post_norm then norms attention's output
     * before the residual add), and a windowed layer's own rotary table; NULL for Llama's */
    const float *pre_ff_norm, *post_ff_norm; /* [H] */
    const float *cos_sin;                   /* [max_position, 2, rotary_dim], in place of the model's */
    long no_rope;                           /* q and k go unrotated (SmolLM3's every fourth layer) */
} StepLayer;

typedef struct {
    long num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, block_size, max_position;
    long num_slots;                         /* num_blocks * block_size: each cache's rows */
    long quant_max_tokens;                  /* the most tokens a step may have to read the GGUF blocks */
    long kv_half;                           /* whether the caches hold float16 */
    long bf16_dot;                          /* whether the prefill attention and the quantized strips take bfloat16 dot products */
    long gelu;                              /* the MLP's gate: SiLU (0) or GELU's tanh form (1, Gemma's) */
    long rotary_dim;                        /* the leading dims of each head the rotary turns (even, <= D) */
    long post_norms;                        /* OLMo 2's: no input norms, attention's output normed before its add */
    long qk_norm_whole;                     /* OLMo 2's: q and k each normed over all their heads at once */
    float eps, scale;
    float softcap;                          /* the attention scores' soft cap, or 0 (Gemma 2's) */
    float residual_scale;                   /* attention's and the MLP's outputs times this (Granite's; else 1) */
    const float *final_norm;                /* [H] */
    const float *cos_sin;                   /* [max_position, 2, rotary_dim]: cos, then sin, its first half negated */
    const StepLayer *layers;
} StepModel;

/* A LoRA adapter's pair for one linear layer [N, K]: a [R, K] and b [N, R] (scale folded in),
 * packed as the weights are, R even (a zero row and column pad an odd rank); data NULL where
 * the adapter leaves the layer alone. */
typedef struct {
    Weight a, b;
    long rank;
} LoRAPair;

/* One layer's pairs, in the order of StepLayer's linear layers: qkv, o, gate_up, down. */
typedef struct {
    LoRAPair pair[4];
} LoRALayer;

/* A step's adapters: group g's rows are rows[offsets[g]] .. rows[offsets[g + 1] - 1] (ascending),
 * its pairs layers[g][0 .. num_layers - 1]. */
typedef struct {
    long num_groups;
    const int64_t *rows;
    const long *offsets;
    const LoRALayer *const *layers;
} StepLoRA;

/* y[rows of group g] += (x[those rows] @ a.T) @ b.T for each group that adapts linear layer
 * `which` of layer l (y [B, N], x [B, K]); -1 when out of memory. */
static int lora_add(const StepLoRA *lora, long l, int which, const float *x, float *y, long N, long K) {
    for (long g = 0; g < lora->num_groups; g++) {
        const LoRAPair *p = &lora->layers[g][l].pair[which];
        if (!p->a.data) continue;
        const int64_t *rows = lora->rows + lora->offsets[g];
        const long n = lora->offsets[g + 1] - lora->offsets[g], R = p->rank;
        const int run = rows[n - 1] - rows[0] == n - 1;  /* one run of rows: read x in place */
        float *buf = malloc(sizeof(float) * n * ((run ? 0 : K) + R + N));
        if (!buf) return -1;
        float *t = buf, *d = t + n * R, *xg = d + n * N;
        if (run)
            xg = (float *)x + rows[0] * K;
        else
            for (long i = 0; i < n; i++) memcpy(xg + i * K, x + rows[i] * K, sizeof(float) * K);
        if (gemv_any(p->a.type, xg, p->a.data, t, n, R, K, 0) || gemv_any(p->b.type, t, p->b.data, d, n, N, R, 0)) {
            free(buf);
            return -1;
        }
        for (long i = 0; i < n; i++) {
            float *yr = y + rows[i] * N;
            const float *dr = d + i * N;
            for (long j = 0; j < N; j++) yr[j] += dr[j];
        }
        free(buf);
    }
    return 0;
}

/* y = x @ w.T through the weight a step of M tokens reads; -1 when out of memory. */
static int step_gemv(const StepModel *m, const Weight *w, const float *x, float *y, long M, long N, long K) {
    const Weight *use = w[1].data && M <= m->quant_max_tokens ? &w[1] : &w[0];
    return gemv_any(use->type, x, use->data, y, M, N, K, m->bf16_dot);
}

/* Neox-style rotary on the leading R dims of n heads of D at x: x * cos + rotate_half(x) * sin,
 * with cs = [cos, signed sin] (R each); the rest of each head stays (a partial rotary's). */
static void rotate_heads(float *x, long n, long D, long R, const float *cs) {
    const long half = R / 2;
    const float *c = cs, *s = cs + R;
    for (long h = 0; h < n; h++) {
        float *v = x + h * D;
        for (long d = 0; d < half; d++) {
            const float a = v[d], b = v[d + half];
            v[d] = a * c[d] + b * s[d];
            v[d + half] = b * c[d + half] + a * s[d + half];
        }
    }
}

/* out[t] = act(gate_up[t, :I]) * gate_up[t, I:], for T rows: act silu(x) = x / (1 + e^-x), or
 * with `gelu`, GELU's tanh form 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3) (Gemma's),
 * which is x / (1 + e^-2u): the same quotient. */
static void act_and_mul_f32(const float *gate_up, float *out, long T, long I, long gelu) {
#pragma omp parallel for schedule(static) if (T * I > 65536)
    for (long t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        long i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        const __m256 c1 = _mm256_set1_ps(1.5957691216057308f), c3 = _mm256_set1_ps(0.044715f);
        for (; i + 8 <= I; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            /* the exponent's argument: x, or 2u = 2 sqrt(2 / pi) (x + 0.044715 x^3) */
            const __m256 a = gelu ? _mm256_mul_ps(c1, _mm256_fmadd_ps(_mm256_mul_ps(c3, x), _mm256_mul_ps(x, x), x)) : x;
            const __m256 e = exp_ps(_mm256_sub_ps(zero, a));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) {
            const float a = gelu ? 1.5957691216057308f * (g[i] + 0.044715f * g[i] * g[i] * g[i]) : g[i];
            o[i] = g[i] / (1.0f + expf(-a)) * u[i];
        }
    }
}

/* n values of x into a cache from element i: float16 where half, rounded to nearest and held
 * to its largest finite value (as the torch path writes them). */
static void store_kv(void *cache, long i, const float *x, long n, long half) {
    if (!half) {
        for (long e = 0; e < n; e++) ((float *)cache)[i + e] = x[e];
        return;
    }
    uint16_t *c = (uint16_t *)cache + i;
    const __m256 top = _mm256_set1_ps(65504.0f), bottom = _mm256_set1_ps(-65504.0f);
    long e = 0;
    for (; e + 8 <= n; e += 8) {
        const __m256 v = _mm256_min_ps(top, _mm256_max_ps(bottom, _mm256_loadu_ps(x + e)));
        _mm_storeu_si128((__m128i *)(c + e), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; e < n; e++) c[e] = _cvtss_sh(x[e] > 65504.0f ? 65504.0f : x[e] < -65504.0f ? -65504.0f : x[e], 0);
}

/* residual += hidden; x = residual (n values). */
static void add_and_copy(const float *hidden, float *residual, float *x, long n) {
    for (long i = 0; i < n; i++) x[i] = residual[i] += hidden[i];
}

/* x[0 .. n - 1] *= scale, unless scale is 1. */
static void scale_rows(float *x, long n, float scale) {
    if (scale != 1.0f)
        for (long i = 0; i < n; i++) x[i] *= scale;
}

/* The floats of scratch step_forward_f32 takes per token. */
long step_scratch_floats(const StepModel *m) {
    const long D = m->head_dim;
    return 2 * m->hidden + (m->num_heads + 2 * m->num_kv_heads) * D + m->num_heads * D + 3 * m->intermediate;
}

/* hidden [B, H]: the B tokens' embeddings in, the final norm's output out. The step's S
 * sequences as paged_prefill_attention takes them: sequence s's tokens are rows
 * query_start_loc[s] .. query_start_loc[s + 1] - 1, at the last positions before seq_lens[s],
 * its blocks row s of tables [S, W]; the leading sequences of one token each are the decodes.
 * lora: the step's LoRA adapters (StepLoRA), each added to its rows' linear layers, or NULL.
 * slots [B]: each token's cache slot (-1 writes nothing). scratch: B * step_scratch_floats
 * floats. Returns 0, or before computing anything, for inputs that would read or write outside
 * the model's tables: -1 a position past the rotary table, -2 a slot past the cache, -3 a
 * sequence with no tokens, more tokens than its length, a length past its block-table row or
 * query_start_loc not from 0 to B, -4 a block ID (of those the length reaches) past the cache;
 * -5 (midway) when a kernel found no memory for its scratch. */
int step_forward_f32(const StepModel *m, float *hidden, const int64_t *slots, const int64_t *query_start_loc,
                     const int64_t *tables, const int64_t *seq_lens, long B, long S, long W, float *scratch,
                     const StepLoRA *lora) {
    const long H = m->hidden, I = m->intermediate, D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads;
    const long QKV = (Hq + 2 * Hkv) * D, kv_row = Hkv * D;
    if (query_start_loc[0] != 0 || query_start_loc[S] != B) return -3;
    for (long s = 0; s < S; s++) {
        const long n = query_start_loc[s + 1] - query_start_loc[s], len = seq_lens[s];
        if (n < 1 || len < n || len > W * m->block_size) return -3;
        if (len > m->max_position) return -1;
        for (long j = 0; j * m->block_size < len; j++)
            if (tables[s * W + j] < 0 || tables[s * W + j] >= m->num_slots / m->block_size) return -4;
    }
    for (long t = 0; t < B; t++)
        if (slots[t] < -1 || slots[t] >= m->num_slots) return -2;
    long nd = 0;  /* the decodes */
    while (nd < S && query_start_loc[nd + 1] == nd + 1) nd++;
    float *residual = scratch, *x = residual + B * H, *qkv = x + B * H, *attn = qkv + B * QKV;
    float *gate_up = attn + B * Hq * D, *act = gate_up + B * 2 * I;
    for (long i = 0; i < B * H; i++) residual[i] = 0.0f;  /* the first layer adds the embeddings to it */
    for (long l = 0; l < m->num_layers; l++) {
        const StepLayer *L = m->layers + l;
        if (m->post_norms)  /* OLMo 2's: the residual stream itself goes in */
            add_and_copy(hidden, residual, x, B * H);
        else
            rms_norm_f32(hidden, residual, L->input_norm, x, B, H, m->eps);  /* residual += mlp out */
        if (step_gemv(m, L->qkv, x, qkv, B, QKV, H) || (lora && lora_add(lora, l, 0, x, qkv, QKV, H))) return -5;
        for (long s = 0; s < S; s++)
            for (long t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) {
                const long position = seq_lens[s] - (query_start_loc[s + 1] - t);
                float *row = qkv + t * QKV;
                if (L->qkv_bias)
                    for (long i = 0; i < QKV; i++) row[i] += L->qkv_bias[i];
                if (L->q_norm && L->k_norm) {  /* per head (Qwen3's), or over all heads (OLMo 2's) */
                    const long qn = m->qk_norm_whole ? 1 : Hq, kn = m->qk_norm_whole ? 1 : Hkv;
                    rms_norm_f32(row, 0, L->q_norm, row, qn, Hq * D / qn, m->eps);
                    rms_norm_f32(row + Hq * D, 0, L->k_norm, row + Hq * D, kn, Hkv * D / kn, m->eps);
                }
                if (!L->no_rope)
                    rotate_heads(row, Hq + Hkv, D, m->rotary_dim,
                                 (L->cos_sin ? L->cos_sin : m->cos_sin) + position * 2 * m->rotary_dim);
                if (slots[t] >= 0) {
                    store_kv(L->k_cache, slots[t] * kv_row, row + Hq * D, kv_row, m->kv_half);
                    store_kv(L->v_cache, slots[t] * kv_row, row + Hq * D + kv_row, kv_row, m->kv_half);
                }
            }
        if (nd)
            paged_decode_attention(qkv, QKV, L->k_cache, L->v_cache, tables, seq_lens, attn,
                                   nd, Hq, Hkv, D, m->block_size, W, m->scale, m->kv_half, L->window, m->softcap);
        if (nd < S && paged_prefill_attention(qkv, QKV, L->k_cache, L->v_cache, query_start_loc + nd, tables + nd * W,
                                              seq_lens + nd, attn, S - nd, Hq, Hkv, D, m->block_size, W, m->scale,
                                              m->kv_half, m->bf16_dot, L->window, m->softcap))
            return -5;
        if (step_gemv(m, L->o, attn, hidden, B, H, Hq * D) || (lora && lora_add(lora, l, 1, attn, hidden, H, Hq * D)))
            return -5;
        scale_rows(hidden, B * H, m->residual_scale);
        if (m->post_norms) {  /* OLMo 2's: attention's output normed, added; the stream goes on in */
            rms_norm_f32(hidden, 0, L->post_norm, hidden, B, H, m->eps);
            add_and_copy(hidden, residual, x, B * H);
        } else if (L->pre_ff_norm) {  /* Gemma's: attention's output normed, added, normed again */
            rms_norm_f32(hidden, 0, L->post_norm, hidden, B, H, m->eps);
            rms_norm_f32(hidden, residual, L->pre_ff_norm, x, B, H, m->eps);
        } else {
            rms_norm_f32(hidden, residual, L->post_norm, x, B, H, m->eps);  /* residual += attention out */
        }
        if (step_gemv(m, L->gate_up, x, gate_up, B, 2 * I, H) || (lora && lora_add(lora, l, 2, x, gate_up, 2 * I, H)))
            return -5;
        act_and_mul_f32(gate_up, act, B, I, m->gelu);
        if (step_gemv(m, L->down, act, hidden, B, H, I) || (lora && lora_add(lora, l, 3, act, hidden, H, I))) return -5;
        scale_rows(hidden, B * H, m->residual_scale);
        if (L->post_ff_norm) rms_norm_f32(hidden, 0, L->post_ff_norm, hidden, B, H, m->eps);
    }
    rms_norm_f32(hidden, residual, m->final_norm, hidden, B, H, m->eps);
    return 0;
}

/* ---- Sampling: one token per row of logits -------------------------------------------------
 *
 * What the Sampler's torch path does for a row (worker/sampler.py), in a few passes over the row
 * instead of a sort of the vocabulary and an exponential per entry (at batch 64 and a vocabulary
 * of 49152, 0.1-0.3 s a step): greedy rows take the argmax; the others softmax(logits / T)
 * (e = exp((x - max) / T), the largest 1), then min_p (drop e < min_p: a probability below
 * min_p times the largest), then top_k, then top_p over what is left, and one draw by the
 * inverse CDF: the first token where the running sum of e (index order) passes u times their
 * total. top_k and top_p find their cut without sorting: a histogram of e by its top bits
 * (e >= 0, so its bits order it as a float does; SAMPLE_SHIFT: 4064 bins up to 1.0) says in
 * which bin the cut falls, and only that bin's tokens are sorted. */
#define SAMPLE_SHIFT 18
#define SAMPLE_BINS ((0x3F800000 >> SAMPLE_SHIFT) + 1)
#define SAMPLE_CHUNK 256  /* tokens a partial sum covers, for the draw's walk */

/* The first index of the row's largest value (NaN counts as the largest, as torch.argmax has it). */
static long argmax_row(const float *x, long V) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    long i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) break;  /* a NaN among these eight */
        top = _mm256_max_ps(top, v);
    }
    float m = hmax(top);
    for (long j = i; j < V; j++) {
        if (x[j] != x[j]) return j;
        if (x[j] > m) m = x[j];
    }
    const __m256 mv = _mm256_set1_ps(m);
    long j = 0;
    for (; j + 8 <= V; j += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), mv, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz(hit);
    }
    for (; j < V; j++)
        if (x[j] == m) return j;
    return 0;
}

typedef struct {
    float e;
    int32_t i;
} Entry;

/* larger e first; equal e: lower index first */
static int entry_order(const void *a, const void *b) {
    const Entry *x = a, *y = b;
    return x->e > y->e ? -1 : x->e < y->e ? 1 : (x->i > y->i) - (x->i < y->i);
}

static inline long sample_bin(float e) {
    uint32_t bits;
    memcpy(&bits, &e, 4);
    const long b = bits >> SAMPLE_SHIFT;
    return b < SAMPLE_BINS ? b : SAMPLE_BINS - 1;  /* e <= 1, but no rounding may index past the bins */
}

/* The tokens of e (>= 0, 0: dropped) in the bin where a cut falls, sorted (largest first) into
 * `bin` (room for V); returns how many. */
static long sorted_bin(const float *e, long V, long b, Entry *bin) {
    long n = 0;
    for (long j = 0; j < V; j++)
        if (e[j] > 0.0f && sample_bin(e[j]) == b) bin[n].e = e[j], bin[n].i = (int32_t)j, n++;
    qsort(bin, n, sizeof(Entry), entry_order);
    return n;
}

/* Drop (zero) every token of e below bin b, and of bin b's sorted tokens all from `keep` on. */
static void cut_at(float *e, long V, long b, const Entry *bin, long n, long keep) {
    for (long j = 0; j < V; j++)
        if (e[j] > 0.0f && sample_bin(e[j]) < b) e[j] = 0.0f;
    for (long j = keep; j < n; j++) e[bin[j].i] = 0.0f;
}

/* Drop (zero) the tokens of e at or below `floor` and list the rest in cand (room for V), in order;
 * returns how many. */
static long above_floor(float *e, long V, float floor, Entry *cand) {
    const __m256 fl = _mm256_set1_ps(floor);
    long n = 0, j = 0;
    for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(e + j), above = _mm256_cmp_ps(v, fl, _CMP_GT_OQ);
        int hit = _mm256_movemask_ps(above);
        if (hit != 0xff) _mm256_storeu_ps(e + j, _mm256_and_ps(v, above));
        for (; hit; hit &= hit - 1) {
            const long i = j + __builtin_ctz(hit);
            cand[n].e = e[i], cand[n].i = (int32_t)i, n++;
        }
    }
    for (; j < V; j++) {
        if (e[j] > floor) cand[n].e = e[j], cand[n].i = (int32_t)j, n++;
        else e[j] = 0.0f;
    }
    return n;
}

/* Of the n candidates, drop (zero in e) those below bin b and gather bin b's to the front of
 * cand, sorted (largest first); returns how many those are. */
static long crossing_candidates(float *e, Entry *cand, long n, long b) {
    long nb = 0;
    for (long c = 0; c < n; c++) {
        const long bc = sample_bin(cand[c].e);
        if (bc < b) e[cand[c].i] = 0.0f;
        else if (bc == b) cand[nb++] = cand[c];
    }
    qsort(cand, nb, sizeof(Entry), entry_order);
    return nb;
}

/* Keep the k largest of e (ties: the lower indices). Where at least k tokens weigh more than a
 * floor (2^-8, 2^-16 or 2^-24 of the largest: the highest that k pass) and those are few (a
 * peaked distribution), the rest are dropped in one pass and only those binned. */
static void keep_top_k(float *e, long V, long k, int32_t *count, Entry *bin) {
    static const float floors[3] = {0x1p-8f, 0x1p-16f, 0x1p-24f};
    long over[3] = {0, 0, 0}, j = 0;
    for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_loadu_ps(e + j);
        for (int f = 0; f < 3; f++)
            over[f] += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(floors[f]), _CMP_GT_OQ)));
    }
    for (; j < V; j++)
        for (int f = 0; f < 3; f++) over[f] += e[j] > floors[f];
    int f = 0;
    while (f < 3 && over[f] < k) f++;
    memset(count, 0, sizeof(int32_t) * SAMPLE_BINS);
    long above = 0, b = SAMPLE_BINS - 1;
    if (f < 3 && over[f] <= V / 8) {
        const long n = above_floor(e, V, floors[f], bin);
        for (long c = 0; c < n; c++) count[sample_bin(bin[c].e)]++;
        while (above + count[b] < k) above += count[b--];
        const long nb = crossing_candidates(e, bin, n, b);
        for (long c = k - above; c < nb; c++) e[bin[c].i] = 0.0f;
        return;
    }
    long kept = 0;
    for (j = 0; j < V; j++)
        if (e[j] > 0.0f) count[sample_bin(e[j])]++, kept++;
    if (kept <= k) return;
    while (above + count[b] < k) above += count[b--];
    const long n = sorted_bin(e, V, b, bin);
    cut_at(e, V, b, bin, n, k - above);
}

/* The highest bin whose tokens' mass, with that of the bins above (*before), passes target: the
 * bin where top_p's cut falls; -1 where none does (rounding). */
static long crossing_bin(const float *mass, float target, float *before) {
    long b = SAMPLE_BINS - 1;
    *before = 0.0f;
    while (b >= 0 && *before + mass[b] <= target) *before += mass[b--];
    return b;
}

/* keep_top_p's cut over every token of e: the crossing bin found from a histogram of them all. */
static void keep_top_p_all(float *e, long V, float target, float *mass, Entry *bin) {
    memset(mass, 0, sizeof(float) * SAMPLE_BINS);
    for (long j = 0; j < V; j++)
        if (e[j] > 0.0f) mass[sample_bin(e[j])] += e[j];
    float before;
    const long b = crossing_bin(mass, target, &before);
    if (b < 0) return;  /* rounding: every token stays */
    const long n = sorted_bin(e, V, b, bin);
    long keep = 0;
    while (keep < n && before < target) before += bin[keep++].e;
    cut_at(e, V, b, bin, n, keep);  /* keep >= 1 where no token lies above this bin */
}

/* Keep the fewest largest of e whose mass reaches p of the total: a token stays while the mass
 * of those before it (larger, or equal at a lower index) is below p times the total. A token at
 * or below (1 - p) / V of the total never stays (all such weigh at most 1 - p of it, so those
 * above weigh at least p): where those are most of the row (a peaked distribution), they are
 * dropped in one pass and only the rest (`cand`, room for V) binned, then the crossing bin's
 * sorted (batch 64 of 49152 tokens, logits of spread 4 at T 0.7: 8.6-11.2 -> 4.1-4.4 ms). */
static void keep_top_p(float *e, long V, float p, float *mass, Entry *cand) {
    __m256 sum = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= V; j += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(e + j));
    float total = hsum(sum);
    for (; j < V; j++) total += e[j];
    const float target = p * total, floor = (1.0f - p) * total / (float)V;
    const __m256 fl = _mm256_set1_ps(floor);
    long n = 0;
    for (j = 0; j + 8 <= V; j += 8) n += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(e + j), fl, _CMP_GT_OQ)));
    if (n > V / 8) {  /* a flat distribution: most tokens are candidates, and a pass over all costs less */
        keep_top_p_all(e, V, target, mass, cand);
        return;
    }
    n = above_floor(e, V, floor, cand);
    memset(mass, 0, sizeof(float) * SAMPLE_BINS);
    for (long c = 0; c < n; c++) mass[sample_bin(cand[c].e)] += cand[c].e;
    float before;
    const long b = crossing_bin(mass, target, &before);
    if (b < 0) return;  /* rounding: every candidate stays */
    const long nb = crossing_candidates(e, cand, n, b);
    long keep = 0;  /* >= 1 where no token lies above this bin */
    while (keep < nb && before < target) before += cand[keep++].e;
    for (long c = keep; c < nb; c++) e[cand[c].i] = 0.0f;
}

/* One draw from row x: see above. e, chunk: scratch of V and V / SAMPLE_CHUNK + 1 floats. */
static long sample_row(const float *x, long V, float temperature, float min_p, long top_k, float top_p, float u,
                       float *e, float *chunk, int32_t *count, float *mass, Entry *bin) {
    const long first = argmax_row(x, V);
    const float m = x[first];
    if (!(m > -INFINITY) || m != m || isinf(m)) return first;  /* no finite logit to weigh the rest by */
    const __m256 top = _mm256_set1_ps(m), inv = _mm256_set1_ps(1.0f / temperature), floor = _mm256_set1_ps(min_p);
    long j = 0;
    for (; j + 8 <= V; j += 8) {
        const __m256 w = exp_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), top), inv));
        _mm256_storeu_ps(e + j, _mm256_and_ps(_mm256_cmp_ps(w, floor, _CMP_GE_OQ), w));
    }
    for (; j < V; j++) {
        const float w = expf((x[j] - m) / temperature);
        e[j] = w >= min_p ? w : 0.0f;
    }
    e[first] = 1.0f;  /* the largest always stays (min_p <= 1) */
    if (top_k > 0 && top_k < V) keep_top_k(e, V, top_k, count, bin);
    if (top_p < 1.0f) keep_top_p(e, V, top_p, mass, bin);
    float total = 0.0f;
    for (long c = 0; c * SAMPLE_CHUNK < V; c++) {
        __m256 s = _mm256_setzero_ps();
        const long end = (c + 1) * SAMPLE_CHUNK < V ? (c + 1) * SAMPLE_CHUNK : V;
        long i = c * SAMPLE_CHUNK;
        for (; i + 8 <= end; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(e + i));
        float t = hsum(s);
        for (; i < end; i++) t += e[i];
        chunk[c] = t;
        total += t;
    }
    const float target = u * total;
    float before = 0.0f;
    long c = 0, last = 0;  /* the last chunk that holds a token */
    for (; c * SAMPLE_CHUNK < V; c++) {
        if (chunk[c] <= 0.0f) continue;
        last = c;
        if (before + chunk[c] > target) break;
        before += chunk[c];
    }
    if (c * SAMPLE_CHUNK >= V) c = last, before = -INFINITY;  /* rounding carried the target past the sum */
    long token = first;
    for (long i = c * SAMPLE_CHUNK; i < V && i < (c + 1) * SAMPLE_CHUNK; i++) {
        if (e[i] <= 0.0f) continue;
        token = i;
        before += e[i];
        if (before > target) break;
    }
    return token;  /* past the target, or (rounding) the last token that stays */
}

/* out[b]: row b of logits [B, V] (float32)'s token: the argmax where temperature[b] is 0, else a
 * draw as sample_row takes it with u[b] in [0, 1) (min_p 0, top_k 0, top_p 1: off). Returns 0, or
 * -1 (nothing drawn) without memory for the scratch. */
int sample_rows(const float *logits, long B, long V, const float *temperature, const float *min_p,
                const int64_t *top_k, const float *top_p, const float *u, int64_t *out) {
    int failed = 0;
#pragma omp parallel if (B > 1 && B * V > 65536)
    {
        float *e = NULL, *chunk = NULL, *mass = NULL;
        int32_t *count = NULL;
        Entry *bin = NULL;
#pragma omp for schedule(dynamic, 1)
        for (long b = 0; b < B; b++) {
            const float *x = logits + b * V;
            if (temperature[b] <= 0.0f) {
                out[b] = argmax_row(x, V);
                continue;
            }
            if (!e) {
                e = malloc(sizeof(float) * V), chunk = malloc(sizeof(float) * (V / SAMPLE_CHUNK + 1));
                mass = malloc(sizeof(float) * SAMPLE_BINS), count = malloc(sizeof(int32_t) * SAMPLE_BINS);
                bin = malloc(sizeof(Entry) * V);
            }
            if (!e || !chunk || !mass || !count || !bin) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            out[b] = sample_row(x, V, temperature[b], min_p[b], top_k[b], top_p[b], u[b], e, chunk, count, mass, bin);
        }
        free(e), free(chunk), free(mass), free(count), free(bin);
    }
    return failed ? -1 : 0;
}

/* Penalties on logits [B, V] (float32), in place, as the Sampler's torch path applies them:
 * row b's tokens are ids[offsets[b] .. offsets[b + 1]), the first prompt_len[b] its prompt and
 * the rest its output; a token seen (in the output, or in the prompt where rep[b] != 1) has its
 * logit divided by rep[b] where positive, else multiplied; then each output token's logit
 * loses freq[b] times its count and pres[b] once. Touches only the rows' own tokens (the torch
 * path builds [B, V] tensors of counts). Returns 0, or -1 without memory for the counts. */
int apply_penalties(float *logits, long B, long V, const int64_t *ids, const int64_t *offsets,
                    const int64_t *prompt_len, const float *rep, const float *freq, const float *pres) {
    int failed = 0;
#pragma omp parallel if (B > 1 && offsets[B] > 4096)
    {
        int32_t *count = NULL;  /* per token: its count in the output + 1 where seen, 0 where not */
#pragma omp for schedule(dynamic, 1)
        for (long b = 0; b < B; b++) {
            if (rep[b] == 1.0f && freq[b] == 0.0f && pres[b] == 0.0f) continue;
            if (!count && !(count = calloc(V, sizeof(int32_t)))) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int64_t *p = ids + offsets[b], *out = p + prompt_len[b], *end = ids + offsets[b + 1];
            float *x = logits + b * V;
            if (rep[b] != 1.0f)
                for (const int64_t *t = p; t < out; t++)
                    if (*t >= 0 && *t < V && !count[*t]) count[*t] = 1;
            for (const int64_t *t = out; t < end; t++)
                if (*t >= 0 && *t < V) count[*t] += count[*t] ? 1 : 2;
            for (const int64_t *t = rep[b] != 1.0f ? p : out; t < end; t++) {  /* each seen token once */
                if (*t < 0 || *t >= V || !count[*t]) continue;
                const long n = count[*t] - 1;
                float v = x[*t];
                v = v > 0.0f ? v / rep[b] : v * rep[b];
                x[*t] = v - freq[b] * (float)n - (n > 0 ? pres[b] : 0.0f);
                count[*t] = 0;
            }
        }
        free(count);
    }
    return failed ? -1 : 0;
}

/* Logprobs of rows of logits [B, V] (float32), as log_softmax would give them: where top_n[b] >= 0,
 * row b's token tokens[b] gets its logprob chosen[b] and rank[b] (1 + the tokens of higher
 * logprob), and its top_n[b] (<= max_n) best tokens their IDs and logprobs, best first (ties: the
 * lower ID), into rows max_n apart of top_ids and top_vals. Rows with top_n -1 are skipped. One
 * exp pass and one comparing pass a row; the top list kept sorted as the row is read. */
void token_logprobs(const float *logits, long B, long V, const int64_t *tokens, const int64_t *top_n, long max_n,
                    float *chosen, int64_t *rank, int64_t *top_ids, float *top_vals) {
#pragma omp parallel for schedule(dynamic, 1) if (B > 1 && B * V > 65536)
    for (long b = 0; b < B; b++) {
        if (top_n[b] < 0) continue;
        const float *x = logits + b * V;
        const float m = x[argmax_row(x, V)];
        float sum = 0.0f;
        if (m > -INFINITY && m < INFINITY) {
            const __m256 top = _mm256_set1_ps(m);
            __m256 s = _mm256_setzero_ps();
            long j = 0;
            for (; j + 8 <= V; j += 8) s = _mm256_add_ps(s, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), top)));
            sum = hsum(s);
            for (; j < V; j++) sum += expf(x[j] - m);
        }
        const float logsum = logf(sum);  /* raw_i = (x_i - m) - logsum, as log_softmax rounds it */
        const float mine = (x[tokens[b]] - m) - logsum;
        long higher = 0;
        const long n = top_n[b];
        int64_t *ids = top_ids + b * max_n;
        float *vals = top_vals + b * max_n;
        long have = 0, j = 0;
#define INTO_TOP(R, J)                                                                            \
    if (n && (have < n || (R) > vals[n - 1])) {  /* into the sorted top list */                   \
        long at = have < n ? have++ : n - 1;                                                      \
        while (at > 0 && vals[at - 1] < (R)) vals[at] = vals[at - 1], ids[at] = ids[at - 1], at--; \
        vals[at] = (R), ids[at] = (J);                                                            \
    }
        const __m256 vm = _mm256_set1_ps(m), vl = _mm256_set1_ps(logsum), vmine = _mm256_set1_ps(mine);
        for (; j + 8 <= V; j += 8) {
            float r[8];
            const __m256 v = _mm256_sub_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm), vl);
            higher += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v, vmine, _CMP_GT_OQ)));
            int hit = !n ? 0 : have < n ? 0xff : _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(vals[n - 1]), _CMP_GT_OQ));
            if (!hit) continue;
            _mm256_storeu_ps(r, v);
            for (; hit; hit &= hit - 1) {
                const int i = __builtin_ctz(hit);
                INTO_TOP(r[i], j + i)
            }
        }
        for (; j < V; j++) {
            const float r = (x[j] - m) - logsum;
            higher += r > mine;
            INTO_TOP(r, j)
        }
#undef INTO_TOP
        chosen[b] = mine, rank[b] = higher + 1;
    }
}
