/* Paged decode attention on the CPU: one query token per sequence, read straight from the KV cache's blocks.
 *
 * The torch path gathers every sequence's blocks into one contiguous tensor per layer (a copy of the whole
 * context, K and V) and then multiplies; this reads each key and value once, where it lies, and keeps the
 * softmax online (one rescale per chunk of keys). Plain C, no torch headers: it compiles in about a second with the
 * system's C compiler (worker/attention/cpu_kernel.py builds and loads it) and is called through ctypes, which
 * releases the GIL for the call.
 *
 * Layout (the engine's): q [n, heads, head_dim] (head_dim contiguous, rows q_row_stride elements apart),
 * k_cache and v_cache [num_blocks, block_size, kv_heads, head_dim] contiguous, block_tables [n, table_stride]
 * int32, seq_lens [n] int32, out [n, heads, head_dim] contiguous. Query head q reads KV head q / (heads /
 * kv_heads). Element type: float32 (dtype 0) or bfloat16 (dtype 1, stored as uint16); sums in float32. One
 * thread: decode steps run on one (kvgrid serve's decode_cpus_per_rank).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 64 /* keys scored before one softmax rescale */

/* src[off:off+d] as floats: float32 in place; bfloat16 widened into dst (exactly: its bits are a float's upper
 * half). Copying float32 rows too cost as much as all the arithmetic. */
static inline const float *load_row(float *restrict dst, const void *src, int64_t off, int d, int dtype) {
    if (dtype == 0) return (const float *)src + off;
    const uint16_t *s = (const uint16_t *)src + off;
    uint32_t *u = (uint32_t *)dst;
    for (int i = 0; i < d; i++) u[i] = (uint32_t)s[i] << 16;
    return dst;
}

/* e^x for x <= 0 (a score minus the running maximum), in a form the compiler vectorizes (libm's expf is a call
 * per element): 2^(x log2 e) split into 2^k, set in the exponent bits, times a degree-6 polynomial for 2^f,
 * f in [-1/2, 1/2); relative error about 2e-7. Below -87 the result is 0. */
static inline float exp_nonpos(float x) {
    float t = x * 1.4426950408889634f;
    t = t < -126.f ? -126.f : t;
    const float kf = floorf(t + 0.5f);
    const float f = t - kf;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    const int32_t bits = ((int32_t)kf + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.f ? 0.f : p * scale;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                         /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* One sequence, every head. ws: scratch of heads * (2 * d + CHUNK + 2) + 2 * kv_heads * d floats. */
static void one_row(const void *q, int64_t q_off, const void *k_cache, const void *v_cache, const int32_t *table,
                    int32_t len, int block_size, int heads, int kv_heads, int d, float scale, int dtype, void *out,
                    int64_t out_off, float *ws) {
    const int group = heads / kv_heads, width = kv_heads * d; /* a token's K (or V): all its KV heads, contiguous */
    float *qf = ws, *acc = qf + heads * d, *s = acc + heads * d, *m = s + heads * CHUNK, *l = m + heads;
    float *row = l + heads;
    const float *q_row = load_row(qf, q, q_off, heads * d, dtype); /* q itself (float32) or qf (widened) */
    for (int i = 0; i < heads * d; i++) { qf[i] = q_row[i] * scale; acc[i] = 0.f; }
    for (int h = 0; h < heads; h++) { m[h] = -INFINITY; l[h] = 0.f; }
    for (int start = 0; start < len; start += CHUNK) {
        const int nk = len - start < CHUNK ? len - start : CHUNK;
        for (int t = 0; t < nk; t++) { /* this chunk's scores */
            const int pos = start + t;
            const float *key = load_row(
                row, k_cache, ((int64_t)table[pos / block_size] * block_size + pos % block_size) * width, width, dtype);
            for (int h = 0; h < heads; h++) {
                const float *qh = qf + h * d, *kh = key + (h / group) * d;
                float dot = 0.f;
                for (int i = 0; i < d; i++) dot += qh[i] * kh[i];
                s[h * CHUNK + t] = dot;
            }
        }
        for (int h = 0; h < heads; h++) { /* online softmax: one rescale of the running sums per chunk */
            float *sh = s + h * CHUNK, mx = m[h], sum = 0.f;
            for (int t = 0; t < nk; t++) mx = sh[t] > mx ? sh[t] : mx;
            const float corr = expf(m[h] - mx); /* m = -inf at first: corr = 0, and acc is still 0 */
            for (int i = 0; i < d; i++) acc[h * d + i] *= corr;
            for (int t = 0; t < nk; t++) { sh[t] = exp_nonpos(sh[t] - mx); sum += sh[t]; }
            l[h] = l[h] * corr + sum;
            m[h] = mx;
        }
        for (int t = 0; t < nk; t++) {
            const int pos = start + t;
            const float *value = load_row(
                row, v_cache, ((int64_t)table[pos / block_size] * block_size + pos % block_size) * width, width, dtype);
            for (int h = 0; h < heads; h++) {
                const float p = s[h * CHUNK + t], *vh = value + (h / group) * d;
                float *ah = acc + h * d;
                for (int i = 0; i < d; i++) ah[i] += p * vh[i];
            }
        }
    }
    for (int h = 0; h < heads; h++) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        const int64_t o = out_off + (int64_t)h * d;
        if (dtype == 0) {
            float *dst = (float *)out + o;
            for (int i = 0; i < d; i++) dst[i] = acc[h * d + i] * inv;
        } else {
            uint16_t *dst = (uint16_t *)out + o;
            for (int i = 0; i < d; i++) dst[i] = f32_to_bf16(acc[h * d + i] * inv);
        }
    }
}

/* Returns 0; -1 for shapes it does not take, -2 when out of memory (the caller then uses the torch path). */
int kvgrid_paged_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                        const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, void *out,
                        int64_t n, int heads, int kv_heads, int head_dim, int block_size, float scale, int dtype) {
    if (kv_heads <= 0 || heads <= 0 || heads % kv_heads || head_dim <= 0 || block_size <= 0
        || (dtype != 0 && dtype != 1))
        return -1;
    float *ws = malloc(sizeof(float) * ((size_t)heads * (2 * head_dim + CHUNK + 2) + (size_t)kv_heads * head_dim));
    if (!ws) return -2;
    for (int64_t i = 0; i < n; i++)
        one_row(q, i * q_row_stride, k_cache, v_cache, block_tables + i * table_stride, seq_lens[i], block_size,
                heads, kv_heads, head_dim, scale, dtype, out, i * heads * head_dim, ws);
    free(ws);
    return 0;
}
