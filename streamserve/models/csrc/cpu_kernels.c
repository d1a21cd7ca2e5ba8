/* The CPU path's C kernels, built and loaded by cpu_kernels.py. Needs AVX2 + FMA (+ F16C).
 *
 * gemv_bf16 / gemv_f16: matrix times a few vectors for the CPU's small steps: y = x @ w.T with x float32 [M, K]
 * (M small), w bfloat16 or float16 [N, K] (row-major, as nn.Linear keeps it), y float32 [M, N].
 *
 * A step of a few tokens reads every weight once, so it is bound by memory bandwidth.
 * Reading half-size weights and widening them in registers (bfloat16: a 16-bit shift;
 * float16: F16C) halves the bytes of a float32 GEMV, and unlike oneDNN's emulated
 * bfloat16 path on CPUs without AVX512-BF16, it costs no extra passes over memory.
 * Rows of w are split across OpenMP threads (the same runtime torch uses); each row
 * is read once for all M vectors, four at a time, with float32 accumulators, while
 * the row four ahead is prefetched (about 20% more bandwidth than the hardware
 * prefetcher alone reaches on short rows).
 *
 * rms_norm_f32: RMSNorm over rows of float32, optionally adding the residual first (in
 * place, like the Triton kernel): one call instead of the eight small torch ops it
 * takes in Python, each of which costs more in dispatch than the arithmetic.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline __m256 widen_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline __m256 widen_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline float scalar_bf16(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline float scalar_f16(uint16_t h) {
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One weight row against up to four vectors (mb of them, starting at row m0 of x). */
#define ROW_TIMES_VECTORS(WIDEN, SCALAR)                                                   \
    const char *ahead = (const char *)(wr + 4 * K);  /* a hint: never faults */            \
    for (long m0 = 0; m0 < M; m0 += 4) {                                                    \
        const long mb = M - m0 < 4 ? M - m0 : 4;                                            \
        const float *xb = x + m0 * K;                                                       \
        __m256 acc[4][2];                                                                   \
        for (int m = 0; m < 4; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();            \
        long k = 0;                                                                         \
        for (; k + 16 <= K; k += 16) {                                                      \
            if (m0 == 0) _mm_prefetch(ahead + 2 * k, _MM_HINT_T0);                          \
            const __m256 w0 = WIDEN(wr + k), w1 = WIDEN(wr + k + 8);                        \
            for (long m = 0; m < mb; m++) {                                                 \
                acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + m * K + k), w0, acc[m][0]); \
                acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + m * K + k + 8), w1, acc[m][1]); \
            }                                                                               \
        }                                                                                   \
        for (long m = 0; m < mb; m++) {                                                     \
            float sum = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));                          \
            for (long kk = k; kk < K; kk++) sum += xb[m * K + kk] * SCALAR(wr[kk]);          \
            y[(m0 + m) * N + n] = sum;                                                      \
        }                                                                                   \
    }

void gemv_bf16(const float *x, const uint16_t *w, float *y, long M, long N, long K) {
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        const uint16_t *wr = w + n * K;
        ROW_TIMES_VECTORS(widen_bf16, scalar_bf16)
    }
}

void gemv_f16(const float *x, const uint16_t *w, float *y, long M, long N, long K) {
#pragma omp parallel for schedule(static)
    for (long n = 0; n < N; n++) {
        const uint16_t *wr = w + n * K;
        ROW_TIMES_VECTORS(widen_f16, scalar_f16)
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
