/* A decoder layer of a few rows in native calls, for the CPU engine's lean layers (loaded by `cpu_kernels.py`,
 * called by `lean_layers.py` for steps of up to `few_rows_limit` rows): in float32 when the operator asks for the
 * few-row kernel (`LLMQ_FLOAT32_FEW_ROWS`), and built a second time with -DLLMQ_BFLOAT16 for the bfloat16 mode
 * (`LLMQ_DTYPE=bfloat16`, on CPUs with AVX-512 BF16), where every tensor handed over is bfloat16.
 *
 * A lone request's decode step is bound by reading the weights and by the ~40 small tensor ops a layer runs around
 * its products (norms, rotary, SiLU, residual adds, views, the cache write, the attention's bookkeeping), each a torch
 * dispatch and a wake of the OpenMP team. Here:
 * - `llmq_attention_in_*`: RMSNorm, the q, k and v products (side by side in one output), rotary embedding on q
 *   and k, in one parallel region;
 * - `llmq_attention_out_*`: the output projection plus the residual, RMSNorm, the gate and up products,
 *   SiLU(gate) * up, the down product plus the residual, in one parallel region;
 * - `llmq_decoder_layer_*`: both around writing each row's new key and value into the paged cache and the decode
 *   attention (`paged_decode.c`'s code), for a step whose rows are all decode rows: the whole layer in one call.
 * Each op rounds as the lean layer's torch op does: products are `few_rows_float32.c`'s / `few_rows.c`'s (bitwise),
 * the norm `rms_norm.c`'s (torch's bits, at the `lanes` the engine checked), and in bfloat16 every elementwise result
 * is rounded to bfloat16 once, as torch's bfloat16 ops round theirs (computed in float32, nearest even). SiLU uses
 * the C library's `expf` where torch uses its own vector exp, so its last bit may differ.
 *
 * Built at first use with the machine's C compiler (-O3 -march=native -fopenmp -ffp-contract=off), on CPUs with AVX2
 * and FMA, or AVX-512 (and AVX-512 BF16 for -DLLMQ_BFLOAT16).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(LLMQ_BFLOAT16)
#include "few_rows.c"
#define LLMQ_KV_BFLOAT16 /* the paged cache holds bfloat16 too */
typedef uint16_t act_t;  /* activations, weights, rotary tables, the cache */
static inline float wide(act_t value) { return bf16_to_float(value); }
static inline act_t narrow(float value) { return float_to_bf16(value); }
#else
#include "few_rows_float32.c"
typedef float act_t;
static inline float wide(float value) { return value; }
static inline float narrow(float value) { return value; }
#endif
#include "rms_norm.c"
/* The decode attention of `llmq_decoder_layer_*`, built as its own kernel is (multiply-adds fused): the same bits as
 * the engine's `llmq_paged_decode*` call it replaces. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#include "paged_decode.c"
#pragma GCC pop_options

/* One product of a layer half: `weight` [out_features, in] (+ bias) into columns [column, column + out_features)
 * of an output with rows of `out_stride` elements. */
typedef struct {
    const act_t *weight;
    const act_t *bias;
    act_t *out;
    int64_t out_features;
} product;

/* The products of `x` [rows, in_features] by each of `count` weights, their output column blocks shared out among
 * the team (a work-sharing loop: called inside the parallel region, it ends at the loop's barrier). */
static void products(const act_t *x, int64_t rows, int64_t in_features, const product *list, int count,
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

/* normed[r] = RMSNorm(x[r]) * weight, as `llmq_rms_norm` computes it in float32; in bfloat16 as the library's norm
 * does, the normed row rounded before the weight multiplies it. `scratch`: `width` floats. */
static void norm_rows(const act_t *x, const act_t *weight, act_t *normed, float *scratch, int64_t rows, int64_t width,
                      float eps, int lanes)
{
    for (int64_t r = 0; r < rows; r++) {
#if defined(LLMQ_BFLOAT16)
        for (int64_t j = 0; j < width; j++)
            scratch[j] = wide(x[r * width + j]);
        const float *restrict row = scratch;
#else
        (void)scratch;
        const float *restrict row = x + r * width;
#endif
        act_t *restrict result = normed + r * width;
        const float sum = lanes == 16 ? sum_of_squares(row, width, 16) : sum_of_squares(row, width, 8);
        const float inverse = 1.0f / sqrtf(sum / (float)width + eps);
        for (int64_t j = 0; j < width; j++)
            result[j] = narrow(wide(narrow(row[j] * inverse)) * wide(weight[j]));
    }
}

/* qkv: rows of q_width + 2 * kv_width = [q | k | v] of RMSNorm(hidden) (weights [out, hidden_size]; biases or null),
 * q and k rotated per head: x * cos + roll(x, head_dim / 2) * signed_sin, with `cos` and `signed_sin`
 * [rows, head_dim] (the sine's first half negated, as `rotate_half` does). Returns nonzero where its scratch cannot
 * be allocated. */
#if defined(LLMQ_BFLOAT16)
int llmq_attention_in_bf16(const uint16_t *hidden, const uint16_t *norm_weight, float eps, int lanes,
                           const uint16_t *q_weight, const uint16_t *k_weight, const uint16_t *v_weight,
                           const uint16_t *q_bias, const uint16_t *k_bias, const uint16_t *v_bias, const uint16_t *cos,
                           const uint16_t *signed_sin, uint16_t *qkv, int64_t rows, int64_t hidden_size,
                           int64_t q_width, int64_t kv_width, int64_t head_dim, int threads)
#else
int llmq_attention_in_float32(const float *hidden, const float *norm_weight, float eps, int lanes,
                              const float *q_weight, const float *k_weight, const float *v_weight,
                              const float *q_bias, const float *k_bias, const float *v_bias, const float *cos,
                              const float *signed_sin, float *qkv, int64_t rows, int64_t hidden_size, int64_t q_width,
                              int64_t kv_width, int64_t head_dim, int threads)
#endif
{
    const int64_t width = q_width + 2 * kv_width, rotated = q_width + kv_width, half = head_dim / 2;
    act_t *normed = malloc(sizeof(act_t) * rows * hidden_size);
    act_t *unrotated = malloc(sizeof(act_t) * rows * rotated);
    float *scratch = malloc(sizeof(float) * hidden_size);
    if (normed == 0 || unrotated == 0 || scratch == 0) {
        free(normed);
        free(unrotated);
        free(scratch);
        return 1;
    }
    norm_rows(hidden, norm_weight, normed, scratch, rows, hidden_size, eps, lanes);
    const product list[3] = {
        {q_weight, q_bias, unrotated, q_width},
        {k_weight, k_bias, unrotated + q_width, kv_width},
        {v_weight, v_bias, qkv + rotated, kv_width},
    };
    const int64_t heads = rotated / head_dim;
#pragma omp parallel num_threads(threads)
    {
        /* q and k land unrotated in their own rows of `rotated` elements, v straight in qkv's */
        products(normed, rows, hidden_size, list, 2, rotated);
        products(normed, rows, hidden_size, list + 2, 1, width);
#pragma omp for schedule(static)
        for (int64_t h = 0; h < rows * heads; h++) {
            const int64_t r = h / heads;
            const act_t *restrict x = unrotated + r * rotated + (h % heads) * head_dim;
            act_t *restrict y = qkv + r * width + (h % heads) * head_dim;
            const act_t *restrict c = cos + r * head_dim, *restrict s = signed_sin + r * head_dim;
            for (int64_t j = 0; j < head_dim; j++) {
                const float turned = wide(narrow(wide(x[j < half ? j + half : j - half]) * wide(s[j])));
                y[j] = narrow(wide(narrow(wide(x[j]) * wide(c[j]))) + turned);
            }
        }
    }
    free(normed);
    free(unrotated);
    free(scratch);
    return 0;
}

/* out = h + down(SiLU(gate(n)) * up(n)), where h = residual + o(attended) and n = RMSNorm(h) * norm_weight; all
 * rows contiguous: attended [rows, attended_width], residual and out [rows, hidden_size]. Returns nonzero where its
 * scratch cannot be allocated. */
#if defined(LLMQ_BFLOAT16)
int llmq_attention_out_bf16(const uint16_t *attended, const uint16_t *residual, const uint16_t *o_weight,
                            const uint16_t *o_bias, const uint16_t *norm_weight, float eps, int lanes,
                            const uint16_t *gate_weight, const uint16_t *up_weight, const uint16_t *down_weight,
                            const uint16_t *gate_bias, const uint16_t *up_bias, const uint16_t *down_bias,
                            uint16_t *out, int64_t rows, int64_t hidden_size, int64_t attended_width,
                            int64_t intermediate, int threads)
#else
int llmq_attention_out_float32(const float *attended, const float *residual, const float *o_weight,
                               const float *o_bias, const float *norm_weight, float eps, int lanes,
                               const float *gate_weight, const float *up_weight, const float *down_weight,
                               const float *gate_bias, const float *up_bias, const float *down_bias, float *out,
                               int64_t rows, int64_t hidden_size, int64_t attended_width, int64_t intermediate,
                               int threads)
#endif
{
    act_t *mid = malloc(sizeof(act_t) * rows * hidden_size * 2);
    act_t *gate_up = malloc(sizeof(act_t) * rows * intermediate * 3);
    float *scratch = malloc(sizeof(float) * hidden_size);
    if (mid == 0 || gate_up == 0 || scratch == 0) {
        free(mid);
        free(gate_up);
        free(scratch);
        return 1;
    }
    act_t *normed = mid + rows * hidden_size, *gated = gate_up + rows * intermediate * 2;
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
                mid[i] = narrow(wide(mid[i]) + wide(residual[i]));
            norm_rows(mid, norm_weight, normed, scratch, rows, hidden_size, eps, lanes);
        }
        products(normed, rows, hidden_size, mlp_in, 2, 2 * intermediate);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * intermediate; i++) {
            const float gate = wide(gate_up[(i / intermediate) * 2 * intermediate + i % intermediate]);
            const float silu = wide(narrow(gate / (1.0f + expf(-gate))));
            gated[i] = narrow(silu * wide(gate_up[(i / intermediate) * 2 * intermediate + intermediate + i % intermediate]));
        }
        products(gated, rows, intermediate, &down, 1, hidden_size);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows * hidden_size; i++)
            out[i] = narrow(wide(out[i]) + wide(mid[i]));
    }
    free(mid);
    free(gate_up);
    free(scratch);
    return 0;
}

/* A whole decoder layer for steps whose rows are all decode rows: `llmq_attention_in_*`, then each row's new key and
 * value written to cache row write_index[r] (`key_cache`, `value_cache`: [cache rows, kv_width]), then the decode
 * attention of `llmq_paged_decode*` (request i: query row query_rows[i] over cache rows index[starts[i] .. starts[i]
 * + lengths[i]), which include the row just written; queries and sums in float32, the result rounded once), then
 * `llmq_attention_out_*`. The same bits as those calls in turn, in one call instead of the torch ops between them.
 * Returns nonzero where scratch cannot be allocated (the cache rows may then be written already, as the step's other
 * calls would have). */
#if defined(LLMQ_BFLOAT16)
int llmq_decoder_layer_bf16(const uint16_t *hidden, const uint16_t *norm_weight, float eps, int lanes,
                            const uint16_t *q_weight, const uint16_t *k_weight, const uint16_t *v_weight,
                            const uint16_t *q_bias, const uint16_t *k_bias, const uint16_t *v_bias,
                            const uint16_t *cos, const uint16_t *signed_sin, uint16_t *key_cache,
                            uint16_t *value_cache, const int64_t *write_index, const int64_t *index,
                            const int64_t *starts, const int64_t *lengths, const int64_t *query_rows, float scale,
                            const uint16_t *o_weight, const uint16_t *o_bias, const uint16_t *norm_post_weight,
                            float eps_post, const uint16_t *gate_weight, const uint16_t *up_weight,
                            const uint16_t *down_weight, const uint16_t *gate_bias, const uint16_t *up_bias,
                            const uint16_t *down_bias, uint16_t *out, int64_t rows, int64_t hidden_size,
                            int64_t q_width, int64_t kv_width, int64_t head_dim, int64_t intermediate, int threads)
#else
int llmq_decoder_layer_float32(const float *hidden, const float *norm_weight, float eps, int lanes,
                               const float *q_weight, const float *k_weight, const float *v_weight,
                               const float *q_bias, const float *k_bias, const float *v_bias, const float *cos,
                               const float *signed_sin, float *key_cache, float *value_cache,
                               const int64_t *write_index, const int64_t *index, const int64_t *starts,
                               const int64_t *lengths, const int64_t *query_rows, float scale, const float *o_weight,
                               const float *o_bias, const float *norm_post_weight, float eps_post,
                               const float *gate_weight, const float *up_weight, const float *down_weight,
                               const float *gate_bias, const float *up_bias, const float *down_bias, float *out,
                               int64_t rows, int64_t hidden_size, int64_t q_width, int64_t kv_width, int64_t head_dim,
                               int64_t intermediate, int threads)
#endif
{
    const int64_t width = q_width + 2 * kv_width;
    act_t *qkv = malloc(sizeof(act_t) * rows * width);
    act_t *attended = malloc(sizeof(act_t) * rows * q_width);
#if defined(LLMQ_BFLOAT16) /* the attention reads float32 queries and writes float32 sums: widened, then rounded */
    float *queries = malloc(sizeof(float) * rows * q_width), *sums = malloc(sizeof(float) * rows * q_width);
    const int64_t query_stride = q_width;
#else /* q is read where it lies in qkv's rows, and summed straight into `attended` */
    float *queries = qkv, *sums = attended;
    const int64_t query_stride = width;
#endif
    int status = qkv == 0 || attended == 0 || queries == 0 || sums == 0;
    if (status == 0)
#if defined(LLMQ_BFLOAT16)
        status = llmq_attention_in_bf16(
#else
        status = llmq_attention_in_float32(
#endif
            hidden, norm_weight, eps, lanes, q_weight, k_weight, v_weight, q_bias, k_bias, v_bias, cos,
            signed_sin, qkv, rows, hidden_size, q_width, kv_width, head_dim, threads);
    if (status == 0) {
        for (int64_t r = 0; r < rows; r++) {
            const act_t *key = qkv + r * width + q_width, *value = key + kv_width;
            act_t *key_row = key_cache + write_index[r] * kv_width, *value_row = value_cache + write_index[r] * kv_width;
            for (int64_t j = 0; j < kv_width; j++) {
                key_row[j] = key[j];
                value_row[j] = value[j];
            }
        }
#if defined(LLMQ_BFLOAT16)
        for (int64_t i = 0; i < rows * q_width; i++)
            queries[i] = wide(qkv[(i / q_width) * width + i % q_width]);
#endif
        const int heads = (int)(q_width / head_dim), kv_heads = (int)(kv_width / head_dim);
        status = decode_requests(queries, query_stride, key_cache, value_cache, index, starts, lengths, query_rows,
                                 rows, heads, kv_heads, (int)head_dim, scale, sums, q_width, threads) != 0;
#if defined(LLMQ_BFLOAT16)
        for (int64_t i = 0; i < rows * q_width; i++)
            attended[i] = narrow(sums[i]);
#endif
    }
    if (status == 0)
#if defined(LLMQ_BFLOAT16)
        status = llmq_attention_out_bf16(
#else
        status = llmq_attention_out_float32(
#endif
            attended, hidden, o_weight, o_bias, norm_post_weight, eps_post, lanes, gate_weight, up_weight,
            down_weight, gate_bias, up_bias, down_bias, out, rows, hidden_size, q_width, intermediate, threads);
#if defined(LLMQ_BFLOAT16)
    free(queries);
    free(sums);
#endif
    free(qkv);
    free(attended);
    return status;
}
