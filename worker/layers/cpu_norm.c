/* RMSNorm of float32 rows on the CPU, with the residual add fused in: out = w * h / sqrt(mean(h^2) + eps), where
 * h = x + residual (written to sum, the next layer's residual) or h = x without one.
 *
 * torch runs this as five or six ops (add, pow, mean, add, rsqrt, mul, mul), each with a dispatch and, for the
 * mean, a reduction set-up that alone costs ~17 us on 8 rows of 256; a decode step runs two norms per layer.
 * Built into the same library as the decode attention kernel (worker/attention/cpu_kernel.py). */
#include <math.h>
#include <stdint.h>

void kvgrid_add_rms_norm(const float *x, const float *residual, const float *w, float *out, float *sum,
                         int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        const float *h = xr;
        if (residual) {
            const float *rr = residual + r * dim;
            float *s = sum + r * dim;
            for (int64_t i = 0; i < dim; i++) s[i] = xr[i] + rr[i];
            h = s;
        }
        float ss = 0.f; /* summed in any order (-fassociative-math): vectorized */
        for (int64_t i = 0; i < dim; i++) ss += h[i] * h[i];
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (h[i] * inv);
    }
}
