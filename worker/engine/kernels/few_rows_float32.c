/* Products of a few float32 rows with a float32 weight, for the CPU engine's decode steps when the operator asks
 * for it (`LLMQ_FLOAT32_FEW_ROWS`; loaded by `cpu_kernels.py`, called by `prepack.py` for steps of up to
 * `few_rows_limit` rows).
 *
 * A decode step multiplies a handful of rows by every weight of the model, so it is bound by reading the weights.
 * oneDNN's packed float32 products read them in a layout made for many rows; this loop reads each weight row once,
 * straight through, `OUTPUTS` output columns at a time, while the few input rows stay in L1 (SmolLM2's products, 2
 * threads, an AVX2 EPYC: 27.6 GB/s against oneDNN's 22.8 at one row, 22.1 against 12.5 at four). Sums run in float32 fused multiply-adds,
 * lane by lane, then across the lanes: another order than oneDNN's, so an output's last bits may differ from the
 * packed product's (which is why the engine runs this only when asked: float32 outputs are otherwise `generate`'s,
 * bit for bit). A row's outputs do not depend on the other rows in its call.
 *
 * Built at first use with the machine's C compiler (-O3 -march=native -fopenmp), on CPUs with AVX2 and FMA, or
 * AVX-512.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vec_zero() _mm512_setzero_ps()
#define vec_load(p) _mm512_loadu_ps(p)
#define vec_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline float vec_sum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
#define vec_zero() _mm256_setzero_ps()
#define vec_load(p) _mm256_loadu_ps(p)
#define vec_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vec_sum(vec v)
{
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}
#else
#error "few_rows_float32.c needs AVX2 and FMA, or AVX-512 (-march=native on a CPU that has them)"
#endif

/* Output columns per pass over the input (their weight rows stream side by side) and input rows per pass. With
 * AVX2's 16 vector registers the 16 sums spill a little, yet measured on SmolLM2's products (AVX2 EPYC, 2 threads)
 * 4 x 4 beat 4 x 2, 4 x 3, 2 x 4, 3 x 4 and 8 x 1 at 4 rows by 10-25 % and was within 5 % of the best at 1 and 2;
 * with the sums in registers (`block`), 2 and 8 columns were no faster than 4 at 1-8 rows (Zen 5, `bench.few_rows`). */
#define OUTPUTS 4
#define ROWS 4

/* out[r][o] for o in [first, first + outputs) and r in [row, row + rows): one pass over those weight rows. */
static inline __attribute__((always_inline)) void block_of(const float *restrict x, const float *restrict weight,
                                                           const float *restrict bias, float *restrict out,
                                                           int64_t row, int rows, int64_t first, int outputs,
                                                           int64_t in_features, int64_t out_stride)
{
    vec sums[OUTPUTS][ROWS];
    for (int o = 0; o < OUTPUTS; o++)
        for (int r = 0; r < ROWS; r++)
            sums[o][r] = vec_zero();
    int64_t k = 0;
    for (; k + LANES <= in_features; k += LANES) {
        vec inputs[ROWS];
        for (int r = 0; r < rows; r++)
            inputs[r] = vec_load(x + (row + r) * in_features + k);
        for (int o = 0; o < outputs; o++) {
            const float *weights = weight + (first + o) * in_features + k;
            _mm_prefetch((const char *)(weights + OUTPUTS * in_features), _MM_HINT_T0);
            const vec w = vec_load(weights);
            for (int r = 0; r < rows; r++)
                sums[o][r] = vec_fma(inputs[r], w, sums[o][r]);
        }
    }
    for (int o = 0; o < outputs; o++) {
        const float *weights = weight + (first + o) * in_features;
        for (int r = 0; r < rows; r++) {
            const float *inputs = x + (row + r) * in_features;
            float sum = vec_sum(sums[o][r]);
            for (int64_t tail = k; tail < in_features; tail++) /* a width that is no multiple of LANES; fused */
                sum = fmaf(inputs[tail], weights[tail], sum);   /* whatever -ffp-contract the includer builds with */
            out[(row + r) * out_stride + first + o] = bias == 0 ? sum : sum + bias[first + o];
        }
    }
}

typedef float element;
#include "block_rows.h"

/* out: rows of `out_stride` floats, of which the first out_features are written, = x: [rows, in_features] @
 * weight: [out_features, in_features]^T (+ bias, or null); x, weight and bias contiguous. `out_stride` above
 * out_features writes a column slice of a wider output (stacked products, one weight at a time). Output columns are
 * shared out among the threads. */
void llmq_few_rows_float32(const float *x, const float *weight, const float *bias, float *out, int64_t rows,
                           int64_t in_features, int64_t out_features, int64_t out_stride, int threads)
{
    const int64_t blocks = (out_features + OUTPUTS - 1) / OUTPUTS;
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks > 16)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * OUTPUTS;
        const int outputs = out_features - first < OUTPUTS ? (int)(out_features - first) : OUTPUTS;
        for (int64_t row = 0; row < rows; row += ROWS)
            block(x, weight, bias, out, row, rows - row < ROWS ? (int)(rows - row) : ROWS, first, outputs,
                  in_features, out_stride);
    }
}
