/* NF4 matrix times a few rows on the host CPU: out[t, r] = sum_j W[r, j] * x[t, j], W read once from its packed
 * bytes (airquant/quant/kernels/nf4_cpu.py compiles this file with gcc -O3 -march=native -fopenmp and calls it
 * through ctypes).
 *
 * The NF4 layout is bitsandbytes' (and nf4_moe.py's Triton ``_decode``): element i of the flat [n, k] matrix is
 * nibble i % 2 of byte i / 2 (the even element in the high nibble), its value quant_map[nibble] times the
 * absmax of block i / blocksize; with double quant that absmax is nested_code[absmax_u8[b]] *
 * nested_absmax[b / 256] + offset. Sums are fp32.
 *
 * Fast path (k % blocksize == 0, blocksize % 32 == 0, AVX-512 or AVX2): x is split once per call into its even
 * and odd elements, so a byte's two nibbles multiply x_even and x_odd lane by lane; the 16-entry code book is a
 * register permute (AVX-512: one vpermps over 16 lanes; AVX2: two 8-lane permutes and a blend). A block's
 * products are summed unscaled, then scaled once: sum_b scale_b * (sum_j q_j x_j). Rows are split over the
 * OpenMP threads; up to TOKENS (4) rows of x share one pass over a row of W (more go in further passes over the
 * row, which is in cache by then: the bytes are read from memory once).
 *
 * Wide path (k % (8 x lanes) == 0, a power-of-two blocksize >= 64: every expert shape of the MoE models
 * served): 4 x lanes bytes a step as dwords, each nibble looked up by a shift and a permute, x laid out once per
 * call to match (``row_pass_wide``). One thread, 4096 x 4096 matrices, an AMD EPYC (Zen 4), packed bytes a
 * second against an 11-13 GB/s copy: AVX-512 7.6-8.4 GB/s before, 9.0-10.0 after; AVX2 (-mno-avx512f) 4.6-4.8
 * before, 5.9 after.
 *
 * NF4_PREFETCH (a -D define, bytes; 2048 by default, 0: off): the wide pass prefetches its row's bytes that far
 * ahead, past the 4 KB pages where a core's stream prefetch stops. Measured on the H200's host (Xeon, 16 vCPUs, 14
 * threads; benchmarks/host_gemv_sweep.py, 2026-12-06): 4096 x 4096 GEMV 56.0 GB/s against 51.4 without, Qwen3
 * layer calls 43.2 against 36.6 (4 KB ahead: 45.2, 40.3); a 2-vCPU Xeon the same way: one thread's Qwen3 layer
 * calls 8.7-10.9 GB/s against 5.7.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __x86_64__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define TOKENS 4
#ifndef NF4_PREFETCH
#define NF4_PREFETCH 2048
#endif
#define NESTED 256

static inline float block_scale(int64_t b, int dbl, const float *absmax, const uint8_t *codes,
                                const float *nested_absmax, const float *nested_code, float offset) {
    if (dbl)
        return nested_code[codes[b]] * nested_absmax[b / NESTED] + offset;
    return absmax[b];
}

/* Any shape: one element at a time (a block may straddle rows, a byte two rows when k is odd). */
static void rows_generic(int64_t r0, int64_t r1, const uint8_t *w, int dbl, const float *absmax,
                         const uint8_t *codes, const float *nested_absmax, const float *nested_code, float offset,
                         const float *qm, int64_t n, int64_t k, int64_t bs, const float *x, int64_t t, float *out) {
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t tt = 0; tt < t; tt++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                int64_t i = r * k + j;
                uint8_t byte = w[i >> 1];
                int nib = (i & 1) ? (byte & 15) : (byte >> 4);
                float s = block_scale(i / bs, dbl, absmax, codes, nested_absmax, nested_code, offset);
                acc += qm[nib] * s * x[tt * k + j];
            }
            out[tt * n + r] = acc;
        }
    }
}

#if defined(__AVX512F__)
#define LANES 16
typedef struct { __m512 all; } book;
static inline book load_book(const float *qm) { return (book){_mm512_loadu_ps(qm)}; }
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
/* 16 bytes -> the code book values of their high and low nibbles (16 lanes each). */
static inline void lookup(const uint8_t *p, book lut, __m512 *hi, __m512 *lo) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut.all);
    *lo = _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), lut.all);
}
/* hi/lo nibble values of 16 bytes -> the 32 elements in order (element 2m: hi[m], 2m + 1: lo[m]), stored at o. */
static inline void store_pairs(float *o, __m512 hi, __m512 lo, __m512 s) {
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_permutex2var_ps(hi, first, lo), s));
    _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(hi, second, lo), s));
}
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET1(s) _mm512_set1_ps(s)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
typedef struct { __m256 low, high; } book;  /* code book entries 0-7 and 8-15 */
static inline book load_book(const float *qm) { return (book){_mm256_loadu_ps(qm), _mm256_loadu_ps(qm + 8)}; }
static inline __m256 lut16(__m256i idx, book lut) {
    __m256 a = _mm256_permutevar8x32_ps(lut.low, idx);
    __m256 b = _mm256_permutevar8x32_ps(lut.high, idx);
    __m256i upper = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7));
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(upper));
}
/* 8 bytes -> the code book values of their high and low nibbles (8 lanes each). */
static inline void lookup(const uint8_t *p, book lut, __m256 *hi, __m256 *lo) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *hi = lut16(_mm256_srli_epi32(b, 4), lut);
    *lo = lut16(_mm256_and_si256(b, _mm256_set1_epi32(15)), lut);
}
/* hi/lo nibble values of 8 bytes -> the 16 elements in order (element 2m: hi[m], 2m + 1: lo[m]), stored at o. */
static inline void store_pairs(float *o, __m256 hi, __m256 lo, __m256 s) {
    const __m256 a = _mm256_unpacklo_ps(hi, lo), b = _mm256_unpackhi_ps(hi, lo);  /* pairs 0,1,4,5 and 2,3,6,7 */
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_permute2f128_ps(a, b, 0x20), s));
    _mm256_storeu_ps(o + 8, _mm256_mul_ps(_mm256_permute2f128_ps(a, b, 0x31), s));
}
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET1(s) _mm256_set1_ps(s)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
#endif

#ifdef LANES
/* Rows r0..r1 of W, each for the rows of x in groups of up to TOKENS from t0: PASS(c), c the group's size as a
 * constant (so that the pass's accumulators stay in registers), leaves the group's sums in res; they go to out. */
#define TOKEN_PASSES(PASS)                                                       \
    for (int64_t r = r0; r < r1; r++) {                                          \
        for (int64_t t0 = 0; t0 < t; t0 += TOKENS) {                             \
            const int64_t tn = t - t0 < TOKENS ? t - t0 : TOKENS;                \
            switch (tn) {                                                        \
            case 1: PASS(1); break;                                              \
            case 2: PASS(2); break;                                              \
            case 3: PASS(3); break;                                              \
            default: PASS(4); break;                                             \
            }                                                                    \
            for (int64_t u = 0; u < tn; u++) out[(t0 + u) * n + r] = res[u];     \
        }                                                                        \
    }

/* One pass over row ``row`` of W for ``tn`` rows of x (xe/xo: their even and odd elements, [t, k/2], from
 * x row t0): a constant ``tn`` at each call site, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void row_pass(const uint8_t *row, int64_t first_block, int dbl,
        const float *absmax, const uint8_t *codes, const float *nested_absmax, const float *nested_code,
        float offset, book lut, int64_t half, int64_t hb, int64_t blocks, const float *xe, const float *xo,
        int64_t t0, const int tn, float *res) {
    vec total[TOKENS];
    for (int u = 0; u < tn; u++) total[u] = VZERO();
    for (int64_t b = 0; b < blocks; b++) {
        vec part[TOKENS];
        for (int u = 0; u < tn; u++) part[u] = VZERO();
        for (int64_t j = b * hb; j < (b + 1) * hb; j += LANES) {
            vec hi, lo;
            lookup(row + j, lut, &hi, &lo);
            for (int u = 0; u < tn; u++) {
                const int64_t base = (t0 + u) * half + j;
                part[u] = VFMA(hi, VLOAD(xe + base), part[u]);
                part[u] = VFMA(lo, VLOAD(xo + base), part[u]);
            }
        }
        const vec s = VSET1(block_scale(first_block + b, dbl, absmax, codes, nested_absmax, nested_code, offset));
        for (int u = 0; u < tn; u++) total[u] = VFMA(s, part[u], total[u]);
    }
    for (int u = 0; u < tn; u++) res[u] = hsum(total[u]);
}

/* Rows r0..r1 of a matrix whose blocks lie inside rows. */
static void rows_fast(int64_t r0, int64_t r1, const uint8_t *w, int dbl, const float *absmax, const uint8_t *codes,
                      const float *nested_absmax, const float *nested_code, float offset, const float *qm,
                      int64_t n, int64_t k, int64_t bs, const float *xe, const float *xo, int64_t t, float *out) {
    const int64_t half = k / 2, hb = bs / 2, blocks = k / bs;
    const book lut = load_book(qm);
    float res[TOKENS];
#define PASS(c) row_pass(w + r * half, r * blocks, dbl, absmax, codes, nested_absmax, nested_code, offset, lut, \
                         half, hb, blocks, xe, xo, t0, c, res)
    TOKEN_PASSES(PASS)
#undef PASS
}
#endif


/* One expert's buffers, as ``nf4_experts`` takes them: data pointers (0 where absent). */
enum { W, ABSMAX, NESTED_ABSMAX, NESTED_CODE, NESTED_OFFSET, QUANT_MAP, BUFFERS };

/* An expert's buffers typed: fp32 absmax without double quant, uint8 codes and the nested tables with it. */
typedef struct {
    const uint8_t *w, *codes;
    const float *a32, *nested_absmax, *nested_code, *qm;
    float offset;
} matrix;

static matrix matrix_of(const int64_t *p, int dbl) {
    return (matrix){.w = (const uint8_t *)p[W], .codes = dbl ? (const uint8_t *)p[ABSMAX] : NULL,
                    .a32 = dbl ? NULL : (const float *)p[ABSMAX], .nested_absmax = (const float *)p[NESTED_ABSMAX],
                    .nested_code = (const float *)p[NESTED_CODE], .qm = (const float *)p[QUANT_MAP],
                    .offset = dbl ? *(const float *)p[NESTED_OFFSET] : 0.0f};
}

static inline float scale_of(const matrix *m, int64_t b, int dbl) {
    return block_scale(b, dbl, m->a32, m->codes, m->nested_absmax, m->nested_code, m->offset);
}

#ifdef LANES
/* Wide path (``wide_shape``): 4 x LANES bytes of a row (WIDE elements) a step, loaded as
 * LANES dwords. A permute reads only the low bits of each index lane, so dword >> 4p looks up nibble p of every
 * lane with no widening load and no mask (AVX-512: one vpermps over the 16-entry book; AVX2: two 8-entry
 * permutes, blended on the nibble's top bit moved to the sign by a left shift). Lane i's nibble p is element
 * 8i + (p even ? p + 1 : p - 1) of the step, so x is laid out once per call to match (``wide_order``):
 * x8[WIDE c + LANES p + i]. A step spans at most two blocks of 64: AVX-512's lanes 0-7 hold its first 64
 * elements, lanes 8-15 the next 64, one scale each; AVX2's step is 64 elements, one block. */
#define WIDE (8 * LANES)
static inline int64_t wide_element(int p, int i) { return 2 * (4 * i + p / 2) + ((p & 1) ? 0 : 1); }
/* Shapes the wide path takes: whole steps a row, blocks inside rows, a power-of-two blocksize of 64 or more
 * (every bitsandbytes blocksize is), so that a step's block index is a shift, not a division: a 64-bit
 * division a step (two scales) took ~20 % of a step's time (one thread, matrices in cache: 9.9 GB/s before,
 * 12.5 after, on a 2-vCPU Xeon). */
static inline int wide_shape(int64_t k, int64_t bs) {
    return k % WIDE == 0 && k % bs == 0 && bs % 64 == 0 && (bs & (bs - 1)) == 0;
}
#ifdef NF4_DIVIDE  /* a 64-bit division as before (host_gemv_sweep's "divide" build: the baseline in the same run) */
#define BLOCK_OF(at) ((at) / ((int64_t)1 << sh))
#else
#define BLOCK_OF(at) ((at) >> sh)
#endif

static void wide_order(const float *x, int64_t rows, int64_t k, float *x8) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < k; c += WIDE)
            for (int p = 0; p < 8; p++)
                for (int i = 0; i < LANES; i++)
                    x8[r * k + c + LANES * p + i] = x[r * k + c + wide_element(p, i)];
}

#if LANES == 16
typedef __m512i ivec;
static inline ivec wide_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline __attribute__((always_inline)) vec wide_lookup(ivec raw, const int p, book lut) {
    return _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4 * p), lut.all);
}
static inline vec wide_scale(const matrix *m, int64_t at, int sh, int dbl) {
    return _mm512_mask_broadcastss_ps(_mm512_set1_ps(scale_of(m, BLOCK_OF(at), dbl)), 0xFF00,
                                      _mm_set_ss(scale_of(m, BLOCK_OF(at + 64), dbl)));
}
#else
typedef __m256i ivec;
static inline ivec wide_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __attribute__((always_inline)) vec wide_lookup(ivec raw, const int p, book lut) {
    const __m256i idx = _mm256_srli_epi32(raw, 4 * p);
    const __m256 top = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 28 - 4 * p));  /* nibble bit 3 -> sign */
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lut.low, idx), _mm256_permutevar8x32_ps(lut.high, idx), top);
}
static inline vec wide_scale(const matrix *m, int64_t at, int sh, int dbl) {
    return VSET1(scale_of(m, BLOCK_OF(at), dbl));
}
#endif

static inline __attribute__((always_inline)) void row_pass_wide(const uint8_t *row, int64_t first, int sh,
        const matrix *m, int dbl, book lut, int64_t k, const float *x8, int64_t t0, const int tn, float *res) {
    vec total[TOKENS];
    for (int u = 0; u < tn; u++) total[u] = VZERO();
    for (int64_t c = 0; c < k; c += WIDE) {
#if NF4_PREFETCH
        _mm_prefetch((const char *)(row + c / 2 + NF4_PREFETCH), _MM_HINT_T0);
#endif
        const ivec raw = wide_load(row + c / 2);
        vec a[TOKENS], b[TOKENS];
        const vec v0 = wide_lookup(raw, 0, lut), v1 = wide_lookup(raw, 1, lut);
        for (int u = 0; u < tn; u++) {
            const float *xc = x8 + (t0 + u) * k + c;
            a[u] = VMUL(v0, VLOAD(xc));
            b[u] = VMUL(v1, VLOAD(xc + LANES));
        }
#define NIB(p, acc) { const vec v = wide_lookup(raw, p, lut); \
            for (int u = 0; u < tn; u++) acc[u] = VFMA(v, VLOAD(x8 + (t0 + u) * k + c + LANES * p), acc[u]); }
        NIB(2, a) NIB(3, b) NIB(4, a) NIB(5, b) NIB(6, a) NIB(7, b)
#undef NIB
        const vec s = wide_scale(m, first + c, sh, dbl);
        for (int u = 0; u < tn; u++) total[u] = VFMA(s, VADD(a[u], b[u]), total[u]);
    }
    for (int u = 0; u < tn; u++) res[u] = hsum(total[u]);
}

/* Rows r0..r1 of expert matrix ``m`` [n, k] for t rows of x laid out by ``wide_order``. */
static void rows_wide(int64_t r0, int64_t r1, const matrix *m, int dbl, int64_t n, int64_t k, int64_t bs,
                      const float *x8, int64_t t, float *out) {
    const book lut = load_book(m->qm);
    const int sh = __builtin_ctzll((unsigned long long)bs);  /* a power of two here (``wide_shape``) */
    float res[TOKENS];
#define PASS(c) row_pass_wide(m->w + r * (k / 2), r * k, sh, m, dbl, lut, k, x8, t0, c, res)
    TOKEN_PASSES(PASS)
#undef PASS
}
#endif

/* Rows r0..r1 of expert ``e``'s matrix for its rows of x (``xs``: [rows, k], or their even/odd halves). */
static void expert_rows(const int64_t *p, int64_t r0, int64_t r1, int64_t n, int64_t k, int64_t bs, int dbl,
                        int fast, const float *x, const float *xe, const float *xo, int64_t t, float *out) {
    const matrix m = matrix_of(p, dbl);
#ifdef WIDE
    if (fast == 2) {  /* xe: x in wide_order */
        rows_wide(r0, r1, &m, dbl, n, k, bs, xe, t, out);
        return;
    }
#endif
#ifdef LANES
    if (fast) {
        rows_fast(r0, r1, m.w, dbl, m.a32, m.codes, m.nested_absmax, m.nested_code, m.offset, m.qm, n, k, bs, xe, xo,
                  t, out);
        return;
    }
#endif
    (void)xe; (void)xo; (void)fast;
    rows_generic(r0, r1, m.w, dbl, m.a32, m.codes, m.nested_absmax, m.nested_code, m.offset, m.qm, n, k, bs, x, t,
                 out);
}

/* For each of ``u`` experts (``ptrs`` [u, BUFFERS]: its buffers' data pointers; ``absmax`` fp32 without double
 * quant, uint8 codes with it), its rows rows[e] .. rows[e + 1] of x [R, k] times its NF4 matrix [n, k]' into the
 * same rows of out [R, n]: one call, one parallel region over (expert, 16 rows of W) for a call's every expert.
 * ``skip`` (or NULL): experts whose rows this call leaves alone (the caller multiplies them another way).
 * Returns 1 where the vector path ran, 0 for the generic one, -1 when the split copy of x could not be allocated
 * (nothing written). */
int nf4_experts(int64_t u, const int64_t *ptrs, const int64_t *rows, const uint8_t *skip, int64_t n, int64_t k,
                int64_t bs, int dbl, const float *x, float *out, int threads) {
    const int64_t total = rows[u], chunks = (n + 15) / 16;
    int fast = 0;
    float *xe = NULL, *xo = NULL;
#ifdef LANES
    fast = k % bs == 0 && bs % (2 * LANES) == 0;
#ifdef WIDE
    if (wide_shape(k, bs)) {
        xe = malloc(sizeof(float) * (size_t)(total * k + 1));
        if (xe == NULL)
            return -1;
        wide_order(x, total, k, xe);
        fast = 2;
    } else
#endif
    if (fast) {
        const int64_t half = k / 2;
        xe = malloc(sizeof(float) * (size_t)(total * half * 2 + 1));
        if (xe == NULL)
            return -1;
        xo = xe + total * half;
        for (int64_t i = 0; i < total * half; i++) {
            xe[i] = x[2 * i];
            xo[i] = x[2 * i + 1];
        }
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < u * chunks; task++) {
        const int64_t e = task / chunks, c = task % chunks, t = skip && skip[e] ? 0 : rows[e + 1] - rows[e];
        const int64_t r1 = (c + 1) * 16 < n ? (c + 1) * 16 : n, at = rows[e];
        if (t > 0)
            expert_rows(ptrs + e * BUFFERS, c * 16, r1, n, k, bs, dbl, fast, x + at * k,
                        xe ? xe + at * (fast == 2 ? k : k / 2) : NULL, xo ? xo + at * (k / 2) : NULL, t,
                        out + at * n);
    }
    free(xe);
    return fast ? 1 : 0;
}

/* Rows r0..r1 of one expert's NF4 matrix [n, k] (``p``: its buffers, as ``nf4_experts`` takes them) decoded to
 * fp32 into dst [r1 - r0, k], split over ``threads``: quant_map[nibble] x the block's absmax, the values the
 * kernel above multiplies by. For calls with many rows an expert, where a BLAS product of the decoded rows is
 * faster than the kernel, which decodes each byte once per TOKENS rows of x. */
void nf4_decode(const int64_t *p, int64_t r0, int64_t r1, int64_t k, int64_t bs, int dbl, float *dst, int threads) {
    const matrix m = matrix_of(p, dbl);
#ifdef LANES
    if (k % bs == 0 && bs % (2 * LANES) == 0) {  /* blocks inside rows: LANES bytes a step */
        const book lut = load_book(m.qm);
        const int64_t half = k / 2, hb = bs / 2, blocks = k / bs;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = m.w + r * half;
            float *o = dst + (r - r0) * k;
            for (int64_t b = 0; b < blocks; b++) {
                const vec s = VSET1(scale_of(&m, r * blocks + b, dbl));
                for (int64_t j = b * hb; j < (b + 1) * hb; j += LANES) {
                    vec hi, lo;
                    lookup(row + j, lut, &hi, &lo);
                    store_pairs(o + 2 * j, hi, lo, s);
                }
            }
        }
        return;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = r0; r < r1; r++) {
        float *o = dst + (r - r0) * k;
        int64_t i = r * k;
        const int64_t end = i + k;
        while (i < end) {  /* one absmax block (or the part of it in this row) at a time */
            const int64_t b = i / bs, stop = (b + 1) * bs < end ? (b + 1) * bs : end;
            const float s = scale_of(&m, b, dbl);
            for (; i < stop; i++) {
                const uint8_t byte = m.w[i >> 1];
                o[i - r * k] = m.qm[(i & 1) ? (byte & 15) : (byte >> 4)] * s;
            }
        }
    }
}

/* A plain copy split over ``threads`` (each a contiguous share): the host memory bandwidth ``airquant doctor``
 * sets the kernel's against. */
void host_copy(uint8_t *dst, const uint8_t *src, int64_t nbytes, int threads) {
#pragma omp parallel num_threads(threads)
    {
        int64_t parts = 1, me = 0;
#ifdef _OPENMP
        parts = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
        int64_t a = nbytes * me / parts, b = nbytes * (me + 1) / parts;
        memcpy(dst + a, src + a, (size_t)(b - a));
    }
}

/* Lanes of the vector path this build has: 16 (AVX-512), 8 (AVX2) or 0 (generic only). */
int nf4_lanes(void) {
#ifdef LANES
    return LANES;
#else
    return 0;
#endif
}
