/* Products of a few bfloat16 rows with a bfloat16 weight, for the CPU engine's decode steps (loaded by
 * `cpu_kernels.py`; `prepack.py` calls it for steps of up to `few_rows_limit` rows).
 *
 * A decode step multiplies a handful of rows by every weight of the model, so it is bound by reading the weights:
 * oneDNN's bf16 kernels read them at about 12.6 GB/s here for one row (a layout made for many rows), this loop at
 * about 27 (SmolLM2's 30 layers, weights out of the caches: 16.8 -> 7.9 ms). Each weight row is read once, straight
 * through, four output columns at a time, while the few input rows stay in L1; AVX-512 BF16's pairwise dot product
 * (`vdpbf16ps`) sums in float32, and each output is rounded to bfloat16 once, after its bias, as oneDNN does. The
 * order of the sums differs from oneDNN's, so the last bit of an output may too (bfloat16 products already differ
 * with the row count there).
 *
 * Built at first use with the machine's C compiler (-O3 -march=native -fopenmp), on CPUs with AVX-512 BF16 only.
 */
#include <immintrin.h>
#include <stdint.h>

#include "bfloat16.h"

#if !defined(__AVX512BF16__)
#error "few_rows.c needs AVX-512 BF16 (-march=native on a CPU that has it)"
#endif

#define OUTPUTS 4 /* output columns per pass over the input: their weight rows stream side by side */
#define ROWS 4    /* input rows per pass: OUTPUTS x ROWS accumulators stay in registers */

/* Round to nearest, ties to even (NaN kept a NaN), as torch's and oneDNN's conversions do. */
static inline uint16_t float_to_bf16(float value)
{
    union {
        float value;
        uint32_t bits;
    } wide = {.value = value};
    if ((wide.bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((wide.bits >> 16) | 0x40);
    return (uint16_t)((wide.bits + 0x7fffu + ((wide.bits >> 16) & 1u)) >> 16);
}

/* out[r][o] for o in [first, first + outputs) and r in [row, row + rows): one pass over those weight rows. */
static inline __attribute__((always_inline)) void block_of(const uint16_t *restrict x, const uint16_t *restrict weight,
                                                           const uint16_t *restrict bias, uint16_t *restrict out,
                                                           int64_t row, int rows, int64_t first, int outputs,
                                                           int64_t in_features, int64_t out_features)
{
    __m512 sums[OUTPUTS][ROWS];
    for (int o = 0; o < OUTPUTS; o++)
        for (int r = 0; r < ROWS; r++)
            sums[o][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in_features; k += 32) {
        const int64_t left = in_features - k;
        const __mmask32 lanes = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1u);
        __m512bh inputs[ROWS];
        for (int r = 0; r < rows; r++)
            inputs[r] = (__m512bh)_mm512_maskz_loadu_epi16(lanes, x + (row + r) * in_features + k);
        for (int o = 0; o < outputs; o++) {
            const uint16_t *weights = weight + (first + o) * in_features + k;
            _mm_prefetch((const char *)(weights + OUTPUTS * in_features), _MM_HINT_T0);
            const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(lanes, weights);
            for (int r = 0; r < rows; r++)
                sums[o][r] = _mm512_dpbf16_ps(sums[o][r], inputs[r], w);
        }
    }
#pragma GCC unroll 4 /* fully, with constant counts: else GCC stores every sum to the stack for this loop */
    for (int o = 0; o < outputs; o++) {
        const float shift = bias == 0 ? 0.0f : bf16_to_float(bias[first + o]);
#pragma GCC unroll 4
        for (int r = 0; r < rows; r++)
            out[(row + r) * out_features + first + o] = float_to_bf16(_mm512_reduce_add_ps(sums[o][r]) + shift);
    }
}

typedef uint16_t element;
#include "block_rows.h"

/* out: [rows, out_features] = x: [rows, in_features] @ weight: [out_features, in_features]^T (+ bias, or null), all
 * bfloat16 and contiguous. Output columns are shared out among the threads. */
void llmq_few_rows_bf16(const uint16_t *x, const uint16_t *weight, const uint16_t *bias, uint16_t *out, int64_t rows,
                        int64_t in_features, int64_t out_features, int threads)
{
    const int64_t blocks = (out_features + OUTPUTS - 1) / OUTPUTS;
#pragma omp parallel for num_threads(threads) schedule(static) if (blocks > 16)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * OUTPUTS;
        const int outputs = out_features - first < OUTPUTS ? (int)(out_features - first) : OUTPUTS;
        for (int64_t row = 0; row < rows; row += ROWS)
            block(x, weight, bias, out, row, rows - row < ROWS ? (int)(rows - row) : ROWS, first, outputs,
                  in_features, out_features);
    }
}
