/* A float32 decoder layer of a few rows in two calls, around the attention, for the CPU engine's lean layers when
 * the operator asks for the few-row kernel (`LLMQ_FLOAT32_FEW_ROWS`; loaded by `cpu_kernels.py`, called by
 * `lean_layers.py` for steps of up to `FEW_ROWS` rows).
 *
 * A lone request's decode step is bound by reading the weights and by the ~40 small tensor ops a layer runs around
 * its products (norms, rotary, SiLU, residual adds, views), each a torch dispatch and a wake of the OpenMP team.
 * Here each half of a layer is one call and one parallel region:
 * - `llmq_attention_in_float32`: RMSNorm, the q, k and v products (side by side in one output), rotary embedding
 *   on q and k;
 * - `llmq_attention_out_float32`: the output projection plus the residual, RMSNorm, the gate and up products,
 *   SiLU(gate) * up, the down product plus the residual.
 * The products are `few_rows_float32.c`'s (bitwise), the norm `rms_norm.c`'s (torch's bits, at the `lanes` the
 * engine checked), rotary and the residual adds round as the lean layer's torch ops do (-ffp-contract=off); SiLU
 * uses the C library's `expf` where torch uses its own vector exp, so its last bit may differ. The attention between
 * the halves stays the engine's (the paged cache, `paged_decode.c`).
 *
 * Built at first use with the machine's C compiler (-O3 -march=native -fopenmp -ffp-contract=off), on CPUs with AVX2
 * and FMA, or AVX-512.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "few_rows_float32.c"
#include "rms_norm.c"

/* One product of a layer half: `weight` [out_features, in] (+ bias) into columns [column, column + out_features)
 * of an output with rows of `out_stride` floats. */
typedef struct {
    const float *weight;
    const float *bias;
    float *out;
    int64_t out_features;
} product;

/* The products of `x` [rows, in_features] by each of `count` weights, their output column blocks shared out among
 * the team (a work-sharing loop: called inside the parallel region, it ends at the loop's barrier). */
static void products(const float *x, int64_t rows, int64_t in_features, const product *list, int count,
                     int64_t out_stride)
{
    int64_t total = 0;
    for (int p = 0; p < count; p++)
        total += (list[p].out_features + OUTPUTS - 1) / OUTPUTS;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < total; b++) {
        int p = 0;
        int64_t local = b;
        while (local >= (list[p].out_features + OUTPUTS - 1) / OUTPUTS) {
            local -= (list[p].out_features + OUTPUTS - 1) / OUTPUTS;
            p++;
        }
        const int64_t first = local * OUTPUTS;
        const int outputs = list[p].out_features - first < OUTPUTS ? (int)(list[p].out_features - first) : OUTPUTS;
        for (int64_t row = 0; row < rows; row += ROWS)
            block(x, list[p].weight, list[p].bias, list[p].out, row, rows - row < ROWS ? (int)(rows - row) : ROWS,
                  first, outputs, in_features, out_stride);
    }
}

/* normed[r] = RMSNorm(x[r]) * weight, as `llmq_rms_norm` computes it. */
static void norm_rows(const float *x, const float *weight, float *normed, int64_t rows, int64_t width, float eps,
                      int lanes)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict row = x + r * width;
        float *restrict result = normed + r * width;
        const float sum = lanes == 16 ? sum_of_squares(row, width, 16) : sum_of_squares(row, width, 8);
        const float inverse = 1.0f / sqrtf(sum / (float)width + eps);
        for (int64_t j = 0; j < width; j++)
            result[j] = (row[j] * inverse) * weight[j];
    }
}

/* qkv: rows of q_width + 2 * kv_width floats = [q | k | v] of RMSNorm(hidden) (weights [out, hidden_size]; biases
 * or null), q and k rotated per head: x * cos + roll(x, head_dim / 2) * signed_sin, with `cos` and `signed_sin`
 * [rows, head_dim] (the sine's first half negated, as `rotate_half` does). Returns nonzero where its scratch cannot
 * be allocated. */
int llmq_attention_in_float32(const float *hidden, const float *norm_weight, float eps, int lanes,
                              const float *q_weight, const float *k_weight, const float *v_weight,
                              const float *q_bias, const float *k_bias, const float *v_bias, const float *cos,
                              const float *signed_sin, float *qkv, int64_t rows, int64_t hidden_size, int64_t q_width,
                              int64_t kv_width, int64_t head_dim, int threads)
{
    const int64_t width = q_width + 2 * kv_width, rotated = q_width + kv_width, half = head_dim / 2;
    float *normed = malloc(sizeof(float) * rows * hidden_size);
    float *unrotated = malloc(sizeof(float) * rows * rotated);
    if (normed == 0 || unrotated == 0) {
        free(normed);
        free(unrotated);
        return 1;
    }
    norm_rows(hidden, norm_weight, normed, rows, hidden_size, eps, lanes);
    const product list[3] = {
        {q_weight, q_bias, unrotated, q_width},
        {k_weight, k_bias, unrotated + q_width, kv_width},
        {v_weight, v_bias, qkv + rotated, kv_width},
    };
    const int64_t heads = rotated / head_dim;
#pragma omp parallel num_threads(threads)
    {
        /* q and k land unrotated in their own rows of `rotated` floats, v straight in qkv's */
        products(normed, rows, hidden_size, list, 2, rotated);
        products(normed, rows, hidden_size, list + 2, 1, width);
#pragma omp for schedule(static)
        for (int64_t h = 0; h < rows * heads; h++) {
            const int64_t r = h / heads;
            const float *restrict x = unrotated + r * rotated + (h % heads) * head_dim;
            float *restrict y = qkv + r * width + (h % heads) * head_dim;
            const float *restrict c = cos + r * head_dim, *restrict s = signed_sin + r * head_dim;
            for (int64_t j = 0; j < head_dim; j++)
                y[j] = x[j] * c[j] + x[j < half ? j + half : j - half] * s[j];
        }
    }
    free(normed);
    free(unrotated);
    return 0;
}

/* out = h + down(SiLU(gate(n)) * up(n)), where h = residual + o(attended) and n = RMSNorm(h) * norm_weight; all
 * rows contiguous: attended [rows, attended_width], residual and out [rows, hidden_size]. Returns nonzero where its
 * scratch cannot be allocated. */
int llmq_attention_out_float32(const float *attended, const float *residual, const float *o_weight,
                               const float *o_bias, const float *norm_weight, float eps, int lanes,
                               const float *gate_weight, const float *up_weight, const float *down_weight,
                               const float *gate_bias, const float *up_bias, const float *down_bias, float *out,
                               int64_t rows, int64_t hidden_size, int64_t attended_width, int64_t intermediate,
                               int threads)
{
    float *mid = malloc(sizeof(float) * rows * hidden_size * 2);
    float *gate_up = malloc(sizeof(float) * rows * intermediate * 3);
    if (mid == 0 || gate_up == 0) {
        free(mid);
        free(gate_up);
        return 1;
    }
    float *normed = mid + rows * hidden_size, *gated = gate_up + rows * intermediate * 2;
    const product output = {o_weight, o_bias, mid, hidden_size};
    const product mlp_in[2] = {{gate_weight, gate_bias, gate_up, intermediate},
                               {up_weight, up_bias, gate_up + intermediate, intermediate}};
    const product down = {down_weight, down_bias, out, hidden_size};
#pragma omp parallel num_threads(threads)
    {
        products(attended, rows, attended_width, &output, 1, hidden_size);
#pragma omp single
        {
            for (int64_t i = 0; i < rows * hidden_size; i++)
                mid[i] = mid[i] + residual[i];
            norm_rows(mid, norm_weight, normed, rows, hidden_size, eps, lanes);
        }
        products(normed, rows, hidden_size, mlp_in, 2, 2 * intermediate);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * intermediate; i++) {
            const float gate = gate_up[(i / intermediate) * 2 * intermediate + i % intermediate];
            const float silu = gate / (1.0f + expf(-gate));
            gated[i] = silu * gate_up[(i / intermediate) * 2 * intermediate + intermediate + i % intermediate];
        }
        products(gated, rows, intermediate, &down, 1, hidden_size);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * hidden_size; i++)
            out[i] = out[i] + mid[i];
    }
    free(mid);
    free(gate_up);
    return 0;
}
