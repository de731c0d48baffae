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

/* ------------------------------------------------------------------ the rest of a decode layer, fused
   The elementwise work between a decode step's matmuls, one call each where torch runs five to ten ops on
   32 rows: the residual add and RMSNorm (F.rms_norm's CPU composite: x * rsqrt(mean(x^2) + eps), then
   * weight) with the cast to the next matmul's input; RoPE (x * cos + swap(x) * signed_sin, as
   models/llama.py's rotate) writing the keys and values into the cache; SiLU(gate) * up. bf16 in and out
   where the matmuls run bf16 (bf16: uint16 bits; torch's round-to-nearest-even), fp32 otherwise. One
   thread: at these sizes a fork costs more than the work. Built with -ffp-contract=off, so RoPE and the
   adds are torch's bits; the norm's sum and SiLU's exp differ from torch's by summation order and ulps. */

static inline __m512 load16(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store16(void *p, int64_t i, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float *)p + i, v);
        return;
    }
    __m512i u = _mm512_castps_si512(v); /* c10::BFloat16's round to nearest even; NaN -> 0x7fc0 */
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(r));
}

/* hidden (rows, width) fp32 += delta (rows, width; NULL: nothing added), then out = rms_norm(hidden) * weight.
   width a multiple of 16. */
int decode_add_norm(float *hidden, const void *delta, int delta_bf16, int64_t rows, int64_t width,
                    const float *weight, float eps, void *out, int out_bf16) {
    if (width % 16) return 1;
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * width;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t i = 0; i < width; i += 16) {
            __m512 x = _mm512_loadu_ps(h + i);
            if (delta) {
                x = _mm512_add_ps(x, load16(delta, r * width + i, delta_bf16));
                _mm512_storeu_ps(h + i, x);
            }
            sq = _mm512_add_ps(sq, _mm512_mul_ps(x, x));
        }
        float mean = _mm512_reduce_add_ps(sq) / (float)width;
        __m512 rstd = _mm512_set1_ps(1.f / sqrtf(mean + eps));
        for (int64_t i = 0; i < width; i += 16)
            store16(out, r * width + i,
                    _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(h + i), rstd), _mm512_loadu_ps(weight + i)),
                    out_bf16);
    }
    return 0;
}

/* out (rows, inner) = silu(gate) * up, from gate_up (rows, 2 * inner): gate then up, as chunk(2) splits it. */
int decode_silu_mul(const void *gate_up, int in_bf16, int64_t rows, int64_t inner, void *out, int out_bf16) {
    if (inner % 16) return 1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < inner; i += 16) {
            __m512 g = load16(gate_up, r * 2 * inner + i, in_bf16);
            __m512 u = load16(gate_up, r * 2 * inner + inner + i, in_bf16);
            __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
            store16(out, r * inner + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u),
                    out_bf16);
        }
    return 0;
}

/* One row's head of dim values at x (fp32, bias added) rotated: x * cos + swap(x) * signed_sin -> y. */
static inline void rotate_head(const float *x, const float *cos, const float *sin, int64_t dim, float *y) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i += 16) {
        int64_t j = i < half ? i + half : i - half;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(cos + i));
        __m512 b = _mm512_mul_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(sin + i));
        _mm512_storeu_ps(y + i, _mm512_add_ps(a, b));
    }
}

/* qkv (rows, (heads + 2 * kv_heads) * dim), bf16 or fp32, + bias (fp32, NULL: none): the queries rotated into
   q (rows, heads, dim); the keys rotated and the values into the cache, row n's at k + n * c_row + h * c_head
   (the position's slot already added by the caller). cos, sin: (rows, dim) fp32. dim 64 or 128. */
int decode_rope(const void *qkv, int in_bf16, const float *bias, int64_t rows, int64_t heads, int64_t kv_heads,
                int64_t dim, const float *cos, const float *sin, float *q, float *k, float *v, int64_t c_row,
                int64_t c_head) {
    if (!(dim == 64 || dim == 128)) return 1;
    int64_t width = (heads + 2 * kv_heads) * dim;
    float x[128];
    for (int64_t n = 0; n < rows; n++) {
        const float *cn = cos + n * dim, *sn = sin + n * dim;
        for (int64_t h = 0; h < heads + 2 * kv_heads; h++) {
            for (int64_t i = 0; i < dim; i += 16) {
                __m512 val = load16(qkv, n * width + h * dim + i, in_bf16);
                if (bias) val = _mm512_add_ps(val, _mm512_loadu_ps(bias + h * dim + i));
                _mm512_storeu_ps(x + i, val);
            }
            if (h < heads)
                rotate_head(x, cn, sn, dim, q + (n * heads + h) * dim);
            else if (h < heads + kv_heads)
                rotate_head(x, cn, sn, dim, k + n * c_row + (h - heads) * c_head);
            else
                for (int64_t i = 0; i < dim; i += 16)
                    _mm512_storeu_ps(v + n * c_row + (h - heads - kv_heads) * c_head + i, _mm512_loadu_ps(x + i));
        }
    }
    return 0;
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

int decode_add_norm(float *hidden, const void *delta, int delta_bf16, int64_t rows, int64_t width,
                    const float *weight, float eps, void *out, int out_bf16) {
    return 1;
}

int decode_silu_mul(const void *gate_up, int in_bf16, int64_t rows, int64_t inner, void *out, int out_bf16) {
    return 1;
}

int decode_rope(const void *qkv, int in_bf16, const float *bias, int64_t rows, int64_t heads, int64_t kv_heads,
                int64_t dim, const float *cos, const float *sin, float *q, float *k, float *v, int64_t c_row,
                int64_t c_head) {
    return 1;
}

#endif
