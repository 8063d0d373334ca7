// CUDA kernels of soar-gptq (built to PTX by build.rs with the `cuda` feature).
//
// Each kernel has a CPU twin in the crate that the tests compare it with:
//   gather_damped_f64   -> solver.rs inverse_cholesky_upper (J·H[perm][:,perm]·J + damping, f64)
//   reverse_upper_f32   -> solver.rs upper_inverse_factor (U = J·L⁻¹·J, here row-major)
//   find_params         -> quantizer.rs QuantParams::find_row_params
//   gptq_block          -> solver.rs the in-block part of the column loop
//   unpermute_codes     -> solver.rs (codes returned in the original column order)
//   dequant_gptq        -> format/pack.rs dequantize_gptq (any of 2/3/4/8 bits)
//   dequant_marlin      -> format/quantized/decode.rs dequantize_module (Marlin branch)
//
// Arithmetic follows the CPU code operation by operation in f32 with IEEE division and
// round-half-to-even (rintf), so that results agree bit for bit where the inputs do. Build
// without fast-math.

#include <stdint.h>

#define MSE_GRID 100
#define MSE_STEPS 80
#define MSE_NORM 2.4f

__device__ __forceinline__ float quantize_code(float w, float scale, float zero, float maxq) {
    float c = rintf(w / scale) + zero;
    return fminf(fmaxf(c, 0.0f), maxq);
}

__device__ __forceinline__ float dequantize_code(float code, float scale, float zero) {
    return scale * (code - zero);
}

// A[j*K + i] = H[rev[j]*K + rev[i]] (+ damp_add on the diagonal), as f64: the damped J·H·J of
// the processing order, column-major (H is symmetric, so either order reads the same values).
extern "C" __global__ void gather_damped_f64(const float* __restrict__ h, const int* __restrict__ rev,
                                             double* __restrict__ a, int k, double damp_add) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y;
    if (i >= k) return;
    int rj = rev[j];
    double v = (double)h[(size_t)rj * k + rev[i]];
    if (i == j) {
        if (v == 0.0) v = 1.0;  // a dead column (docs/algorithm.md, Preprocessing of H)
        v += damp_add;
    }
    a[(size_t)j * k + i] = v;
}

// U (row-major f32, upper triangular) = J·L⁻¹·J from L⁻¹ (column-major f64, lower triangular):
// U[r][c] = Linv[K-1-r][K-1-c] = linv[(K-1-c)*K + (K-1-r)] for r <= c, else 0. A 32x32 tile
// transpose through shared memory keeps both sides coalesced. `bad` is set when a kept value
// is not finite or a diagonal is not positive.
extern "C" __global__ void reverse_upper_f32(const double* __restrict__ linv, float* __restrict__ u,
                                             int k, int* __restrict__ bad) {
    __shared__ double tile[32][33];
    int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    int tx = threadIdx.x, ty = threadIdx.y;  // blockDim = (32, 8)
    // Load: for output (r, c) we need linv[(K-1-c)*K + (K-1-r)]; read with r varying fastest.
    for (int dy = ty; dy < 32; dy += 8) {
        int c = c0 + dy, r = r0 + tx;
        double v = 0.0;
        if (r < k && c < k && r <= c) v = linv[(size_t)(k - 1 - c) * k + (k - 1 - r)];
        tile[dy][tx] = v;
    }
    __syncthreads();
    for (int dy = ty; dy < 32; dy += 8) {
        int r = r0 + dy, c = c0 + tx;
        if (r < k && c < k) {
            double v = tile[tx][dy];
            if (r <= c) {
                if (!isfinite(v) || (r == c && !(v > 0.0))) atomicOr(bad, 1);
            }
            u[(size_t)r * k + c] = (float)v;
        }
    }
}

// Scale and zero per (row, group): group t covers columns [col0 + t*g, min(col0 + (t+1)*g, col_end))
// of the row-major matrix w (row stride ldw). Output at scale[(out_row0 + t)*n + row].
extern "C" __global__ void find_params(const float* __restrict__ w, int ldw, int n, int col0,
                                       int col_end, int g, int groups, int out_row0, int bits,
                                       int sym, int mse, float* __restrict__ scale_out,
                                       float* __restrict__ zero_out) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (row >= n || t >= groups) return;
    int c_start = col0 + t * g;
    int c_stop = min(c_start + g, col_end);
    const float* x = w + (size_t)row * ldw;
    float maxq = (float)((1u << bits) - 1);
    float xmin = 0.0f, xmax = 0.0f;
    for (int c = c_start; c < c_stop; ++c) {
        xmin = fminf(xmin, x[c]);
        xmax = fmaxf(xmax, x[c]);
    }
    if (sym) {
        xmax = fmaxf(xmax, fabsf(xmin));
        if (xmin < 0.0f) xmin = -xmax;
    }
    if (xmin == 0.0f && xmax == 0.0f) {
        xmin = -1.0f;
        xmax = 1.0f;
    }
    float sym_zero = (maxq + 1.0f) / 2.0f;
    float best_s = (xmax - xmin) / maxq;
    float best_z = sym ? sym_zero : rintf(-xmin / best_s);
    if (mse) {
        float best_err = INFINITY;
        for (int i = 0; i < MSE_STEPS; ++i) {
            float p = (float)(1.0 - (double)i / (double)MSE_GRID);
            float lo = p * xmin, hi = p * xmax;
            float s = (hi - lo) / maxq;
            float z = sym ? sym_zero : rintf(-lo / s);
            float err = 0.0f;
            for (int c = c_start; c < c_stop; ++c) {
                float q = dequantize_code(quantize_code(x[c], s, z, maxq), s, z);
                err += powf(fabsf(q - x[c]), MSE_NORM);
            }
            if (err < best_err) {
                best_err = err;
                best_s = s;
                best_z = z;
            }
        }
    }
    size_t o = (size_t)(out_row0 + t) * n + row;
    scale_out[o] = best_s;
    zero_out[o] = best_z;
}

// The in-block part of the GPTQ column loop for columns [i1, i1 + width) (processing order),
// one warp per output row; lane l holds columns i1 + 4l .. i1 + 4l + 3 in registers, with
// everything its own columns need (scale, zero, U[c][c], perm[c]) loaded once up front, so the
// column-to-column chain (quantize, error, shuffle, update) has no global-memory load in it.
//   w      [n, k] row-major f32 (processing order), becomes Q in the block
//   u      [k, k] row-major f32, the upper factor of H⁻¹ in processing order
//   scales/zeros [groups, n], param_row[c] = the group row used at processing position c
//   perm[c] = original column of processing position c; codes [n, k] in original order, or
//   (perm == NULL) in processing order, for `unpermute_codes` to reorder in one pass
//   err1   [n, width] row-major, the scaled errors for the lazy update
//   loss   [n] f64, accumulated (one warp per row: no races)
extern "C" __global__ void gptq_block(float* __restrict__ w, const float* __restrict__ u, int n,
                                      int k, int i1, int width, const float* __restrict__ scales,
                                      const float* __restrict__ zeros,
                                      const int* __restrict__ param_row,
                                      const int* __restrict__ perm, float maxq,
                                      uint8_t* __restrict__ codes, float* __restrict__ err1,
                                      double* __restrict__ loss) {
    int warps = blockDim.x / 32;
    int row = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= n) return;
    float* wr = w + (size_t)row * k + i1;
    float v[4], s[4], z[4], d[4];
    int pc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int col = lane * 4 + j;
        int c = i1 + col;
        bool in = col < width;
        v[j] = in ? wr[col] : 0.0f;
        size_t p = in ? (size_t)param_row[c] * n + row : 0;
        s[j] = in ? scales[p] : 1.0f;
        z[j] = in ? zeros[p] : 0.0f;
        d[j] = in ? u[(size_t)c * k + c] : 1.0f;
        pc[j] = in ? (perm ? perm[c] : c) : 0;
    }
    uint8_t* codes_row = codes + (size_t)row * k;
    float* err_row = err1 + (size_t)row * width;
    double row_loss = 0.0;
    for (int ib = 0; ib < width; ib += 4) {
        int owner = ib >> 2;
#pragma unroll
        for (int sub = 0; sub < 4; ++sub) {
            int i = ib + sub;
            if (i >= width) break;
            const float* urow = u + (size_t)(i1 + i) * k + i1;  // U[c][i1 ..]
            // Loads for this column's update, issued before the chain that produces e.
            float uu[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                int col = lane * 4 + j;
                uu[j] = (col > i && col < width) ? urow[col] : 0.0f;
            }
            float e = 0.0f;
            if (lane == owner) {
                float x = v[sub];
                float code = quantize_code(x, s[sub], z[sub], maxq);
                float q = dequantize_code(code, s[sub], z[sub]);
                codes_row[pc[sub]] = (uint8_t)code;
                float dd = d[sub];
                row_loss += (double)((x - q) * (x - q) / (dd * dd) / 2.0f);
                e = (x - q) / dd;
                err_row[i] = e;
                v[sub] = q;
            }
            e = __shfl_sync(0xffffffffu, e, owner);
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] -= e * uu[j];
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        int col = lane * 4 + j;
        if (col < width) wr[col] = v[j];
    }
    for (int off = 16; off > 0; off >>= 1) row_loss += __shfl_down_sync(0xffffffffu, row_loss, off);
    if (lane == 0) loss[row] += row_loss;
}

// out[row][j] = in[row][invperm[j]]: codes written in processing order back to the original
// column order. Coalesced writes; the gathered reads stay within one row (L1/L2 resident).
extern "C" __global__ void unpermute_codes(const uint8_t* __restrict__ in,
                                           const int* __restrict__ invperm, int n, int k,
                                           uint8_t* __restrict__ out) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int row = blockIdx.y;
    if (j >= k || row >= n) return;
    size_t base = (size_t)row * k;
    out[base + j] = in[base + invperm[j]];
}

// Field `i` of a little-endian stream of `bits`-wide fields packed LSB-first in 32-bit words,
// where consecutive words of the stream are `stride` apart.
__device__ __forceinline__ uint32_t stream_field(const int32_t* words, size_t stride, int i, int bits) {
    int bit = i * bits;
    int wi = bit >> 5, sh = bit & 31;
    uint32_t v = ((uint32_t)words[(size_t)wi * stride]) >> sh;
    if (sh + bits > 32) v |= ((uint32_t)words[(size_t)(wi + 1) * stride]) << (32 - sh);
    return v & ((1u << bits) - 1u);
}

// GPTQ decode: out[nn*k + kk] = scales[g][nn] * (code(kk, nn) - zero(g, nn)), g = g_idx[kk];
// qweight [k*bits/32, n] packs along K, qzeros [groups, n*bits/32] along N; v1 stores zero-1.
extern "C" __global__ void dequant_gptq(const int32_t* __restrict__ qweight,
                                        const int32_t* __restrict__ qzeros,
                                        const float* __restrict__ scales,
                                        const int32_t* __restrict__ g_idx, int k, int n, int bits,
                                        int zero_offset, float* __restrict__ out) {
    int kk = blockIdx.x * blockDim.x + threadIdx.x;
    int nn = blockIdx.y;
    if (kk >= k) return;
    int g = g_idx[kk];
    int zwords = n * bits / 32;
    uint32_t code = stream_field(qweight + nn, (size_t)n, kk, bits);
    uint32_t zst = stream_field(qzeros + (size_t)g * zwords, 1, nn, bits);
    float zero = (float)(zst + (uint32_t)zero_offset);
    out[(size_t)nn * k + kk] = dequantize_code((float)code, scales[(size_t)g * n + nn], zero);
}

// Marlin decode (4-bit, zero 8): word w of tile row kt of B [k/16, 2n] holds 8 codes (see
// docs/formats.md); `scales` are already un-permuted [groups, n]; `src_row[k']` is the original
// input row of tile row k' (identity without act-order). out [n, k] row-major.
extern "C" __global__ void dequant_marlin(const int32_t* __restrict__ b, const float* __restrict__ scales,
                                          const int32_t* __restrict__ src_row, int k, int n, int g,
                                          float* __restrict__ out) {
    int w = blockIdx.x * blockDim.x + threadIdx.x;
    int kt = blockIdx.y;
    if (w >= 2 * n) return;
    const int ROW[8] = {0, 8, 0, 8, 1, 9, 1, 9};
    const int COL[8] = {0, 0, 8, 8, 0, 0, 8, 8};
    uint32_t word = (uint32_t)b[(size_t)kt * 2 * n + w];
    int nt = w / 128, j = w % 128;
    int th = j / 4, warp = j % 4;
    int tc_col = th / 4, tc_row = 2 * (th % 4);
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        int kp = kt * 16 + tc_row + ROW[p];
        int col = nt * 64 + warp * 16 + tc_col + COL[p];
        float code = (float)((word >> (4 * p)) & 0xFu);
        out[(size_t)col * k + src_row[kp]] = dequantize_code(code, scales[(size_t)(kp / g) * n + col], 8.0f);
    }
}

// x = I (k x k, f64): the right-hand side when L⁻¹ is computed by a triangular solve.
extern "C" __global__ void set_identity_f64(double* __restrict__ x, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y;
    if (i < k) x[(size_t)j * k + i] = i == j ? 1.0 : 0.0;
}

// count[0] += the number of NaN or ±Inf elements of x (grid-stride).
extern "C" __global__ void count_nonfinite(const float* __restrict__ x, unsigned long long n,
                                           unsigned int* __restrict__ count) {
    unsigned int bad = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        bad += !isfinite(x[i]);
    for (int off = 16; off > 0; off >>= 1) bad += __shfl_down_sync(0xffffffffu, bad, off);
    if ((threadIdx.x & 31) == 0 && bad) atomicAdd(count, bad);
}
