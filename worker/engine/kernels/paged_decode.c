/* Decode attention straight from the paged KV cache, for the CPU engine (loaded by `cpu_kernels.py`).
 *
 * One query row per request: every query head of a request reads the request's keys and values where they lie in
 * the cache (through its row index), with no copy into a padded layout. Two passes (scores over the keys, then the
 * weighted sum of values), each per KV head: the query heads sharing it go in tiles whose queries and sums stay in
 * registers, so each key and value is read once per tile; requests are shared out among the threads. Softmax in
 * float32 with the maximum subtracted, as SDPA does. With AVX-512 and a head size that is a multiple of 16, the
 * scores go 16 keys at a time instead (`scores_blocked`). With the prefetching below, that took a 32-row SmolLM2
 * decode step's attention from ~49 to ~28 ms (`python -m bench.step_profile --kernel-source`, README).
 *
 * Built at first use with the machine's C compiler (-O3 -march=native -fopenmp); OpenMP resolves to the runtime
 * torch already loaded, so this shares torch's threads. Built a second time with -DLLMQ_KV_BFLOAT16 for a bfloat16
 * cache (`LLMQ_DTYPE=bfloat16`): `llmq_paged_decode_bf16` reads bfloat16 keys and values, widened to float32 as they
 * are loaded (exact), and takes float32 queries and output like the float32 one; everything else is the same code.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(LLMQ_KV_BFLOAT16)
#include "bfloat16.h"
typedef uint16_t kv_t;
static inline float kv_float(kv_t value) { return bf16_to_float(value); }
#if defined(__AVX512F__)
static inline __m512 kv_load16(const kv_t *row) /* 16 bfloat16 -> 16 float32 */
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)row)), 16));
}
#endif
#else
typedef float kv_t;
static inline float kv_float(kv_t value) { return value; }
#if defined(__AVX512F__)
static inline __m512 kv_load16(const kv_t *row) { return _mm512_loadu_ps(row); }
#endif
#endif

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

/* Keys and values are read a row at a time through the index, in pages the hardware prefetcher does not follow from
 * one to the next: each pass asks for the rows it reads PREFETCH_AHEAD keys later (10-15 % less kernel time in a
 * step, whose matrix products have just pushed the cache rows out of the CPU's caches). */
#define PREFETCH_AHEAD 16
static inline void prefetch_row(const kv_t *row, int64_t elements)
{
    for (int64_t byte = 0; byte < elements * (int64_t)sizeof(kv_t); byte += 64)
        __builtin_prefetch((const char *)row + byte, 0, 3);
}

/* Query heads handled together: they share a KV head, and their queries (scores) or sums (values) stay in registers
 * while each of its keys or values is read once. */
#define TILE 4

/* scores[u * length + t] = scale * (query u . key t) for `n` query heads of one KV head (`keys` points at it). */
static inline __attribute__((always_inline)) void tile_scores(const float *restrict query, const kv_t *restrict keys,
                                                              const int64_t *restrict cache_rows, int64_t length,
                                                              int64_t cache_stride, float scale,
                                                              float *restrict scores, const int n, const int head_dim)
{
    for (int64_t t = 0; t < length; t++) {
        const kv_t *restrict key = keys + cache_rows[t] * cache_stride;
        for (int u = 0; u < n; u++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int j = 0; j < head_dim; j++)
                dot += query[u * head_dim + j] * kv_float(key[j]);
            scores[u * length + t] = dot * scale;
        }
    }
}

#if defined(__AVX512F__)
/* Lane i of the result = the sum of the 16 lanes of v[i]: one transpose-and-add tree for 16 vectors, instead of a
 * horizontal sum for each. */
static inline __m512 sum_each(const __m512 v[16])
{
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane k: the lane-k sums of four vectors */
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Every query head's scores over one request's keys, 16 keys at a time: each dot product stays a vector of partial
 * sums until the 16 are summed together (`sum_each`), and a block's keys stay in L1 across the heads. A last, short
 * block repeats its last key and stores only its own lanes. For head_dim a multiple of 16. */
static void scores_blocked(const float *restrict query, const kv_t *restrict keys,
                           const int64_t *restrict cache_rows, int64_t length, int heads, int group, int head_dim,
                           int64_t cache_stride, float scale, float *restrict scores)
{
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t first = 0; first < length; first += 16) {
        const int count = length - first < 16 ? (int)(length - first) : 16;
        const kv_t *rows[16];
        for (int i = 0; i < 16; i++)
            rows[i] = keys + cache_rows[first + (i < count ? i : count - 1)] * cache_stride;
        for (int64_t t = first + 16; t < first + 16 + PREFETCH_AHEAD && t < length; t++)
            prefetch_row(keys + cache_rows[t] * cache_stride, cache_stride);
        for (int h = 0; h < heads; h++) {
            const int64_t head_offset = (int64_t)(h / group) * head_dim;
            const float *q = query + (int64_t)h * head_dim;
            __m512 acc[16];
            __m512 chunk = _mm512_loadu_ps(q);
            for (int i = 0; i < 16; i++)
                acc[i] = _mm512_mul_ps(chunk, kv_load16(rows[i] + head_offset));
            for (int c = 16; c < head_dim; c += 16) {
                chunk = _mm512_loadu_ps(q + c);
                for (int i = 0; i < 16; i++)
                    acc[i] = _mm512_fmadd_ps(chunk, kv_load16(rows[i] + head_offset + c), acc[i]);
            }
            _mm512_mask_storeu_ps(scores + h * length + first, (__mmask16)((1u << count) - 1),
                                  _mm512_mul_ps(sum_each(acc), scale_v));
        }
    }
}
#endif

/* Columns [0, width) of out[u] (rows `head_dim` apart) = the sum over t of weights[u * length + t] * value t, for
 * `n` query heads of one KV head. Sums live in a fixed array (registers, once unrolled), so `width` <= MAX_WIDTH. */
#define MAX_WIDTH 256
static inline __attribute__((always_inline)) void tile_values(const kv_t *restrict values,
                                                              const int64_t *restrict cache_rows, int64_t length,
                                                              int64_t cache_stride, const float *restrict weights,
                                                              float *restrict out, const int n, const int width,
                                                              const int head_dim)
{
    float sums[TILE][MAX_WIDTH];
    for (int u = 0; u < n; u++)
        for (int j = 0; j < width; j++)
            sums[u][j] = 0.0f;
    for (int64_t t = 0; t < length; t++) {
        const kv_t *restrict value = values + cache_rows[t] * cache_stride;
        if (t + PREFETCH_AHEAD < length)
            prefetch_row(values + cache_rows[t + PREFETCH_AHEAD] * cache_stride, width);
        for (int u = 0; u < n; u++) {
            const float weight = weights[u * length + t];
#pragma omp simd
            for (int j = 0; j < width; j++)
                sums[u][j] += weight * kv_float(value[j]);
        }
    }
    for (int u = 0; u < n; u++)
        for (int j = 0; j < width; j++)
            out[u * head_dim + j] = sums[u][j];
}

/* Each of `rows` score rows of `length` becomes its softmax: float32, maximum subtracted first, as SDPA does. */
static void softmax_rows(float *restrict scores, int64_t length, int rows)
{
    for (int h = 0; h < rows; h++) {
        float *restrict row = scores + h * length;
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t t = 0; t < length; t++)
            top = row[t] > top ? row[t] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < length; t++) {
            row[t] = exp_nonpositive(row[t] - top);
            total += row[t];
        }
        const float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < length; t++)
            row[t] *= inverse;
    }
}

/* Calls TILE_CALL(N, D) with both as compile-time constants for the common head sizes (64, 128), so the compiler
 * unrolls the tile and keeps it in registers (1.4x faster than one loop for any size, measured on SmolLM2's shapes);
 * any other head size takes ANY_SIZE_CALL, the same code with run-time bounds. */
#define TILE_CASES(D)                                                                                                  \
    switch (n) {                                                                                                       \
    case 1: TILE_CALL(1, D); break;                                                                                    \
    case 2: TILE_CALL(2, D); break;                                                                                    \
    case 3: TILE_CALL(3, D); break;                                                                                    \
    default: TILE_CALL(4, D); break;                                                                                   \
    }
#define FOR_TILE                                                                                                       \
    if (head_dim == 64) {                                                                                              \
        TILE_CASES(64)                                                                                                 \
    } else if (head_dim == 128) {                                                                                      \
        TILE_CASES(128)                                                                                                \
    } else {                                                                                                           \
        ANY_SIZE_CALL;                                                                                                 \
    }

/* How many query heads from `first` on go in one tile: at most TILE, and never past the end of their KV head's group. */
static inline int tile_heads(int first, int group)
{
    const int left_in_group = group - first % group;
    return left_in_group < TILE ? left_in_group : TILE;
}

/* scores[h * length + t] = scale * (query head h . its KV head's key t) for every query head of one request. */
static void score_request(const float *restrict query, const kv_t *restrict keys,
                          const int64_t *restrict cache_rows, int64_t length, int heads, int group, int head_dim,
                          int64_t cache_stride, float scale, float *restrict scores)
{
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
        scores_blocked(query, keys, cache_rows, length, heads, group, head_dim, cache_stride, scale, scores);
        return;
    }
#endif
    for (int first = 0; first < heads;) {
        const int n = tile_heads(first, group);
        const kv_t *key_head = keys + (int64_t)(first / group) * head_dim;
        const float *tile_query = query + (int64_t)first * head_dim;
        float *tile_scores_row = scores + (int64_t)first * length;
#define TILE_CALL(N, D) tile_scores(tile_query, key_head, cache_rows, length, cache_stride, scale, tile_scores_row, N, D)
#define ANY_SIZE_CALL TILE_CALL(n, head_dim)
        FOR_TILE
#undef ANY_SIZE_CALL
#undef TILE_CALL
        first += n;
    }
}

/* One request: its scores (`score_request`), a softmax per query head, then for each KV head its query heads in
 * tiles of up to TILE over the request's values. */
static void attend_request(const float *restrict query, const kv_t *restrict keys, const kv_t *restrict values,
                           const int64_t *restrict cache_rows, int64_t length, int heads, int kv_heads, int head_dim,
                           float scale, float *restrict scores, float *restrict out)
{
    const int group = heads / kv_heads;
    const int64_t cache_stride = (int64_t)kv_heads * head_dim;
    score_request(query, keys, cache_rows, length, heads, group, head_dim, cache_stride, scale, scores);
    softmax_rows(scores, length, heads);
    for (int first = 0; first < heads;) {
        const int n = tile_heads(first, group);
        const kv_t *value_head = values + (int64_t)(first / group) * head_dim;
        const float *weights = scores + (int64_t)first * length;
        float *tile_out = out + (int64_t)first * head_dim;
#define TILE_CALL(N, D) tile_values(value_head, cache_rows, length, cache_stride, weights, tile_out, N, D, D)
#define ANY_SIZE_CALL                                                                                                  \
    for (int column = 0; column < head_dim; column += MAX_WIDTH)                                                       \
        tile_values(value_head + column, cache_rows, length, cache_stride, weights, tile_out + column, n,             \
                    head_dim - column < MAX_WIDTH ? head_dim - column : MAX_WIDTH, head_dim)
        FOR_TILE
#undef ANY_SIZE_CALL
#undef TILE_CALL
        first += n;
    }
}

/* Every request's decode attention: request i attends query row query_rows[i] of `query` (rows of `query_stride`
 * floats, its heads first) over cache rows index[starts[i] .. starts[i] + lengths[i]) and writes row query_rows[i] of
 * `out` (rows of `out_stride` floats); requests are shared out among the threads. Returns 0, or -1 where a thread
 * could not allocate its score buffer (its rows are then left unwritten). Also `decoder_layer.c`'s attention. */
static int decode_requests(const float *query, int64_t query_stride, const kv_t *keys, const kv_t *values,
                           const int64_t *index, const int64_t *starts, const int64_t *lengths,
                           const int64_t *query_rows, int64_t requests, int heads, int kv_heads, int head_dim,
                           float scale, float *out, int64_t out_stride, int threads)
{
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
            attend_request(query + query_rows[i] * query_stride, keys, values, index + starts[i], lengths[i], heads,
                           kv_heads, head_dim, scale, scores, out + query_rows[i] * out_stride);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* query, out: [tokens, heads, head_dim]; keys, values: [cache rows, kv_heads, head_dim]; request i attends its
 * query row query_rows[i] over cache rows index[starts[i] .. starts[i] + lengths[i]). Returns 0, or -1 where a
 * thread could not allocate its score buffer (its rows are then left unwritten). */
#if defined(LLMQ_KV_BFLOAT16)
int llmq_paged_decode_bf16(const float *query, const uint16_t *keys, const uint16_t *values, const int64_t *index,
                           const int64_t *starts, const int64_t *lengths, const int64_t *query_rows, int64_t requests,
                           int heads, int kv_heads, int head_dim, float scale, float *out, int threads)
#else
int llmq_paged_decode(const float *query, const float *keys, const float *values, const int64_t *index,
                       const int64_t *starts, const int64_t *lengths, const int64_t *query_rows, int64_t requests,
                       int heads, int kv_heads, int head_dim, float scale, float *out, int threads)
#endif
{
    const int64_t stride = (int64_t)heads * head_dim;
    return decode_requests(query, stride, keys, values, index, starts, lengths, query_rows, requests, heads, kv_heads,
                           head_dim, scale, out, stride, threads);
}
