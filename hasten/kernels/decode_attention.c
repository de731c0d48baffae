/* speed.decode_attention: one decode step's attention over the lean engine's GroupCache, fused
   (hasten/kernels/decode_attention.py builds and loads this file; it says why).

   For each (row, KV head): the scores of the KV head's query heads against the row's prompt keys
   (shared by its group, with the prompt's 0/-inf bias) and its own keys, one softmax over both, and
   the weighted sum of the values. Each key and value row is read once for all the query heads that
   share it, and nothing is written between the passes but the scores. fp32 throughout; head_dim 64
   or 128, up to 8 query heads per KV head; anything else returns 1 and the caller runs torch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef __AVX512F__
#include <immintrin.h>

int decode_attention_isa(void) { return 512; }

/* e^x for x <= 0 (softmax's shifted scores): Cephes' expf polynomial, ~1 ulp; scalef does 2^n. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

#define MAXG 8

/* scores[g * stride + j] = q_g . k_j + bias_j for the count rows of k (NV vectors of 16 each). */
static inline void score_rows(const __m512 *qv, int64_t group, const float *k, int64_t count, const float *bias,
                              float *scores, int64_t stride, int NV) {
    for (int64_t j = 0; j < count; j++, k += NV * 16) {
        __m512 kc[8];
        for (int c = 0; c < NV; c++) kc[c] = _mm512_loadu_ps(k + c * 16);
        float add = bias ? bias[j] : 0.f;
        for (int64_t g = 0; g < group; g++) {
            __m512 s = _mm512_mul_ps(qv[g * NV], kc[0]);
            for (int c = 1; c < NV; c++) s = _mm512_fmadd_ps(qv[g * NV + c], kc[c], s);
            scores[g * stride + j] = _mm512_reduce_add_ps(s) + add;
        }
    }
}

/* acc_g += p_gj * v_j over the count rows of v. */
static inline void value_rows(__m512 *acc, int64_t group, const float *v, int64_t count, const float *probs,
                              int64_t stride, int NV) {
    for (int64_t j = 0; j < count; j++, v += NV * 16) {
        __m512 vc[8];
        for (int c = 0; c < NV; c++) vc[c] = _mm512_loadu_ps(v + c * 16);
        for (int64_t g = 0; g < group; g++) {
            __m512 p = _mm512_set1_ps(probs[g * stride + j]);
            for (int c = 0; c < NV; c++) acc[g * NV + c] = _mm512_fmadd_ps(p, vc[c], acc[g * NV + c]);
        }
    }
}

/* Each of the group's score rows (span used of padded) -> exp(s - max); inv[g] = 1 / its sum. */
static inline void softmax_rows(float *scores, int64_t group, int64_t span, int64_t padded, float *inv) {
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * padded;
        for (int64_t j = span; j < padded; j++) sg[j] = -INFINITY;
        __m512 m = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < padded; j += 16) m = _mm512_max_ps(m, _mm512_load_ps(sg + j));
        __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(m)), total = _mm512_setzero_ps();
        for (int64_t j = 0; j < padded; j += 16) {
            __m512 e = exp512(_mm512_sub_ps(_mm512_load_ps(sg + j), top));
            _mm512_store_ps(sg + j, e);
            total = _mm512_add_ps(total, e);
        }
        inv[g] = 1.f / _mm512_reduce_add_ps(total);
    }
}

/* One (row, KV head); NV and G are constants where the call site names them, so the loops unroll. */
#define ITEM(NV, G)                                                                                          \
    {                                                                                                        \
        __m512 qv[(G) * (NV)], acc[(G) * (NV)];                                                              \
        for (int64_t g = 0; g < (G); g++)                                                                    \
            for (int c = 0; c < (NV); c++)                                                                   \
                qv[g * (NV) + c] = _mm512_mul_ps(_mm512_loadu_ps(qs + g * dim + c * 16), _mm512_set1_ps(scale)); \
        score_rows(qv, (G), pk, width, bias, scores, padded, (NV));                                          \
        score_rows(qv, (G), ok, own, 0, scores + width, padded, (NV));                                    \
        softmax_rows(scores, (G), span, padded, inv);                                                        \
        for (int64_t i = 0; i < (G) * (NV); i++) acc[i] = _mm512_setzero_ps();                               \
        value_rows(acc, (G), pv, width, scores, padded, (NV));                                               \
        value_rows(acc, (G), ov, own, scores + width, padded, (NV));                                      \
        for (int64_t g = 0; g < (G); g++)                                                                    \
            for (int c = 0; c < (NV); c++)                                                                   \
                _mm512_storeu_ps(o + g * dim + c * 16, _mm512_mul_ps(acc[g * (NV) + c], _mm512_set1_ps(inv[g]))); \
    }

/* q: (rows, kv_heads * group, dim) with row stride q_row; prompt K/V: (prompts, kv_heads, width, dim) with
   strides p_row, p_head; prompt_bias: (prompts, width); prompt_of_row: (rows,); own K/V: (slab rows, kv_heads,
   >= length, dim) with strides o_row, o_head, row n's at slab row own_rows[n] (NULL: n), its first
   own_lengths[n] positions attended (NULL: length, which is the largest); out: (rows, kv_heads * group * dim).
   Returns 0, or 1 for a shape it does not take, 2 when out of memory. */
int decode_attention(const float *q, int64_t q_row, int64_t rows, int64_t kv_heads, int64_t group, int64_t dim,
                     float scale, const float *prompt_k, const float *prompt_v, int64_t p_row, int64_t p_head,
                     int64_t width, const float *prompt_bias, const int64_t *prompt_of_row, const float *own_k,
                     const float *own_v, int64_t o_row, int64_t o_head, const int64_t *own_rows,
                     const int64_t *own_lengths, int64_t length, float *out, int threads) {
    if (!((dim == 64 || dim == 128) && group >= 1 && group <= MAXG && length >= 1 && width >= 0)) return 1;
    int64_t most = (width + length + 15) / 16 * 16;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = aligned_alloc(64, sizeof(float) * group * most);
        float inv[MAXG];
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < rows * kv_heads; item++) {
            if (!scores) continue;
            int64_t n = item / kv_heads, h = item % kv_heads, b = prompt_of_row[n];
            int64_t slab = own_rows ? own_rows[n] : n, own = own_lengths ? own_lengths[n] : length;
            int64_t span = width + own, padded = (span + 15) / 16 * 16;
            const float *pk = prompt_k + b * p_row + h * p_head, *pv = prompt_v + b * p_row + h * p_head;
            const float *ok = own_k + slab * o_row + h * o_head, *ov = own_v + slab * o_row + h * o_head;
            const float *bias = prompt_bias + b * width, *qs = q + n * q_row + h * group * dim;
            float *o = out + item * group * dim;
            if (dim == 64 && group == 3) ITEM(4, 3)       /* SmolLM2 */
            else if (dim == 64 && group == 7) ITEM(4, 7)  /* Qwen2.5-0.5B */
            else if (dim == 128 && group == 6) ITEM(8, 6) /* Qwen2.5-1.5B */
            else if (dim == 64) ITEM(4, group)
            else ITEM(8, group)
        }
        free(scores);
    }
    return failed ? 2 : 0;
}

#else /* no AVX-512 at build time: the caller keeps torch's path */

int decode_attention_isa(void) { return 0; }

int decode_attention(const float *q, int64_t q_row, int64_t rows, int64_t kv_heads, int64_t group, int64_t dim,
                     float scale, const float *prompt_k, const float *prompt_v, int64_t p_row, int64_t p_head,
                     int64_t width, const float *prompt_bias, const int64_t *prompt_of_row, const float *own_k,
                     const float *own_v, int64_t o_row, int64_t o_head, const int64_t *own_rows,
                     const int64_t *own_lengths, int64_t length, float *out, int threads) {
    return 1;
}

#endif
