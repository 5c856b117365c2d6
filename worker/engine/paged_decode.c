/* Decode attention straight from the paged KV cache, for the CPU engine (loaded by `cpu_kernels.py`).
 *
 * One query row per request: every query head of a request reads the request's keys and values where they lie in
 * the cache (through its row index), with no copy into a padded layout. Two passes over the keys (scores, then the
 * weighted sum of values), each reading a cache row (all KV heads, contiguous) once for all query heads; requests
 * are shared out among the threads. Softmax in float32 with the maximum subtracted, as SDPA does. Measured on 2
 * cores: reading a cache row per KV head instead (strided, three times) was 1.7x slower on one thread.
 *
 * Built at first use with the machine's C compiler (-O3 -march=native -fopenmp); OpenMP resolves to the runtime
 * torch already loaded, so this shares torch's threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0 (scores minus their maximum), written so the compiler vectorizes it: x = n ln2 + r with
 * |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error under 2e-7, about float32's epsilon),
 * 2^n through the exponent bits. Below -87 the result is 0, as expf's would be denormal or 0. */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union {
        int32_t bits;
        float value;
    } scale = {.bits = ((int32_t)n + 127) << 23};
    return p * scale.value;
}

/* One request: all `heads` query heads over its keys, reading each cache row (every KV head) once per pass. */
static void attend_request(const float *restrict query, const float *restrict keys, const float *restrict values,
                           const int64_t *restrict cache_rows, int64_t length, int heads, int kv_heads, int head_dim,
                           float scale, float *restrict scores, float *restrict out)
{
    const int group = heads / kv_heads;
    const int64_t cache_stride = (int64_t)kv_heads * head_dim;
    for (int64_t t = 0; t < length; t++) {
        const float *restrict row = keys + cache_rows[t] * cache_stride;
        for (int h = 0; h < heads; h++) {
            const float *restrict q = query + (int64_t)h * head_dim;
            const float *restrict key = row + (int64_t)(h / group) * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int j = 0; j < head_dim; j++)
                dot += q[j] * key[j];
            scores[h * length + t] = dot * scale;
        }
    }
    for (int h = 0; h < heads; h++) {
        float *restrict row = scores + h * length;
        float top = -INFINITY;
        for (int64_t t = 0; t < length; t++)
            top = row[t] > top ? row[t] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < length; t++) {
            row[t] = exp_nonpositive(row[t] - top);
            total += row[t];
        }
        const float inverse = 1.0f / total;
        for (int64_t t = 0; t < length; t++)
            row[t] *= inverse;
    }
    memset(out, 0, sizeof(float) * heads * head_dim);
    for (int64_t t = 0; t < length; t++) {
        const float *restrict row = values + cache_rows[t] * cache_stride;
        for (int h = 0; h < heads; h++) {
            const float weight = scores[h * length + t];
            const float *restrict value = row + (int64_t)(h / group) * head_dim;
            float *restrict o = out + (int64_t)h * head_dim;
#pragma omp simd
            for (int j = 0; j < head_dim; j++)
                o[j] += weight * value[j];
        }
    }
}

/* query, out: [tokens, heads, head_dim]; keys, values: [cache rows, kv_heads, head_dim]; request i attends its
 * query row query_rows[i] over cache rows index[starts[i] .. starts[i] + lengths[i]). Returns 0, or -1 where a
 * thread could not allocate its score buffer (its rows are then left unwritten). */
int llmq_paged_decode(const float *query, const float *keys, const float *values, const int64_t *index,
                       const int64_t *starts, const int64_t *lengths, const int64_t *query_rows, int64_t requests,
                       int heads, int kv_heads, int head_dim, float scale, float *out, int threads)
{
    const int64_t query_stride = (int64_t)heads * head_dim;
    int64_t longest = 1;
    int failed = 0;
    for (int64_t i = 0; i < requests; i++)
        longest = lengths[i] > longest ? lengths[i] : longest;
#pragma omp parallel num_threads(threads) if (requests > 1)
    {
        float *scores = malloc(sizeof(float) * heads * longest);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < requests; i++) {
            if (scores == NULL)
                continue;
            const int64_t offset = query_rows[i] * query_stride;
            attend_request(query + offset, keys, values, index + starts[i], lengths[i], heads, kv_heads, head_dim,
                           scale, scores, out + offset);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
