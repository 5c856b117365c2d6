/* RMSNorm for the CPU engine's lean decoder layers (loaded by `cpu_kernels.py`), with torch's float32 arithmetic to
 * the bit: torch's CPU `rms_norm` is a chain of seven tensor ops (square, sum, divide, add, rsqrt, two products),
 * about 60 a step on SmolLM2, each paying torch's dispatch; here it is one call.
 *
 * The bits depend on the order of the sum of squares, which is torch's `cascade_sum` for a contiguous row
 * (aten/src/ATen/native/cpu/SumKernel.cpp): the row read as vectors of `lanes` floats, every 4th vector into one of 4
 * accumulators, each accumulator a cascade of 4 levels of 2^max(4, ceil(log2(n)) / 4) vectors; then the leftover
 * vectors into the first accumulator, the accumulators added in order, and the leftover floats followed by the
 * lanes one by one. `cpu_kernels.rms_norm` checks the result against torch's before the engine uses it, so a torch
 * that sums another way only costs the speed-up. Built with -ffp-contract=off: a fused multiply-add would round
 * once where torch rounds twice.
 */
#include <math.h>
#include <stdint.h>

#define ILP 4
#define LEVELS 4
#define MAX_LANES 16

static int ceil_log2(int64_t x)
{
    int bits = 0;
    while (((int64_t)1 << bits) < x)
        bits++;
    return bits;
}

/* acc[k] += the squares of vector `v` of `row`, lane by lane. */
static inline void add_squares(float *restrict acc, const float *restrict row, int64_t v, int lanes)
{
    const float *restrict vector = row + v * lanes;
    for (int l = 0; l < lanes; l++)
        acc[l] += vector[l] * vector[l];
}

/* The sum of the squares of `row`'s `width` floats, in torch's order for `lanes`-wide vectors. Inlined with
 * `lanes` a constant (8 or 16), so that the compiler turns each lane loop into one vector operation. */
static inline __attribute__((always_inline)) float sum_of_squares(const float *restrict row, int64_t width, int lanes)
{
    const int64_t vectors = width / lanes;
    const int64_t size = vectors / ILP; /* vectors per accumulator */
    int level_power = ceil_log2(size) / LEVELS;
    level_power = level_power < 4 ? 4 : level_power;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[ILP][LEVELS][MAX_LANES] = {{{0.0f}}};
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < ILP; k++)
                add_squares(acc[k][0], row, i * ILP + k, lanes);
        for (int j = 1; j < LEVELS; j++) { /* carry a full level up, as far as the count of vectors says */
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[k][j][l] += acc[k][j - 1][l];
                    acc[k][j - 1][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0)
                break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < ILP; k++)
            add_squares(acc[k][0], row, i * ILP + k, lanes);
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++)
                acc[k][0][l] += acc[k][j][l];
    for (int64_t v = size * ILP; v < vectors; v++)
        add_squares(acc[0][0], row, v, lanes);
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < lanes; l++)
            acc[0][0][l] += acc[k][0][l];
    float total = 0.0f;
    for (int64_t t = vectors * lanes; t < width; t++)
        total += row[t] * row[t];
    for (int l = 0; l < lanes; l++)
        total += acc[0][0][l];
    return total;
}

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight, for `rows` rows of `width` floats; lanes 8 or 16. Rows are
 * shared out among the threads from 64 rows on (prefill chunks), which changes no row's arithmetic. */
void llmq_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t width, float eps, int lanes,
                   int threads)
{
#pragma omp parallel for num_threads(threads) if (rows >= 64) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict row = x + r * width;
        float *restrict result = out + r * width;
        const float sum = lanes == 16 ? sum_of_squares(row, width, 16) : sum_of_squares(row, width, 8);
        const float mean = sum / (float)width;
        const float inverse = 1.0f / sqrtf(mean + eps);
        for (int64_t j = 0; j < width; j++)
            result[j] = (row[j] * inverse) * weight[j];
    }
}
