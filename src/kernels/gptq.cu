// CUDA kernels of soar-gptq (built to PTX by build.rs with the `cuda` feature).
//
// Each kernel has a CPU twin in the crate that the tests compare it with:
//   gather_damped_f64/_f32 -> solver.rs damped_factor (J·H[perm][:,perm]·J + damping, f64 or f32)
//   reverse_upper_f32/_from_f32 -> solver.rs upper_inverse_factor (U = J·L⁻¹·J, here row-major)
//   find_params         -> quantizer.rs QuantParams::find_row_params
//   find_params_tiled   -> the same (groups of up to 128 columns, staged in shared memory)
//   mirror_upper_blocks -> gptq/hessian.rs (the full XᵀX of the CPU's f32 matmul)
//   gptq_block          -> solver.rs the in-block part of the column loop
//   unpermute_codes     -> solver.rs (codes returned in the original column order)
//   dequant_gptq        -> format/pack.rs dequantize_gptq (any of 2/3/4/8 bits)
//   dequant_marlin      -> format/quantized/decode.rs dequantize_module (Marlin branch)
//   flash_attn_causal_* -> model/minicpm_sala.rs sparse_attention_composed (to BF16 rounding)
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
template <typename T>
__device__ __forceinline__ void gather_damped_impl(const float* __restrict__ h,
                                                   const int* __restrict__ rev, T* __restrict__ a,
                                                   int k, double damp_add) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y;
    if (i >= k) return;
    int rj = rev[j];
    double v = (double)h[(size_t)rj * k + rev[i]];
    if (i == j) {
        if (v == 0.0) v = 1.0;  // a dead column (docs/algorithm.md, Preprocessing of H)
        v += damp_add;
    }
    a[(size_t)j * k + i] = (T)v;
}

extern "C" __global__ void gather_damped_f64(const float* __restrict__ h, const int* __restrict__ rev,
                                             double* __restrict__ a, int k, double damp_add) {
    gather_damped_impl<double>(h, rev, a, k, damp_add);
}

// The same in f32 (`--factor-precision f32`): the sum is formed in f64 and rounded once, as the
// CPU twin does.
extern "C" __global__ void gather_damped_f32(const float* __restrict__ h, const int* __restrict__ rev,
                                             float* __restrict__ a, int k, double damp_add) {
    gather_damped_impl<float>(h, rev, a, k, damp_add);
}

// U (row-major f32, upper triangular) = J·L⁻¹·J from L⁻¹ (column-major, lower triangular, f64 or
// f32): U[r][c] = Linv[K-1-r][K-1-c] = linv[(K-1-c)*K + (K-1-r)] for r <= c, else 0. A 32x32
// tile transpose through shared memory keeps both sides coalesced. `bad` is set when a kept value
// is not finite or a diagonal is not positive.
template <typename T>
__device__ __forceinline__ void reverse_upper_impl(const T* __restrict__ linv, float* __restrict__ u,
                                                   int k, int* __restrict__ bad) {
    __shared__ T tile[32][33];
    int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    int tx = threadIdx.x, ty = threadIdx.y;  // blockDim = (32, 8)
    // Load: for output (r, c) we need linv[(K-1-c)*K + (K-1-r)]; read with r varying fastest.
    for (int dy = ty; dy < 32; dy += 8) {
        int c = c0 + dy, r = r0 + tx;
        T v = 0;
        if (r < k && c < k && r <= c) v = linv[(size_t)(k - 1 - c) * k + (k - 1 - r)];
        tile[dy][tx] = v;
    }
    __syncthreads();
    for (int dy = ty; dy < 32; dy += 8) {
        int r = r0 + dy, c = c0 + tx;
        if (r < k && c < k) {
            T v = tile[tx][dy];
            if (r <= c) {
                if (!isfinite(v) || (r == c && !(v > (T)0))) atomicOr(bad, 1);
            }
            u[(size_t)r * k + c] = (float)v;
        }
    }
}

extern "C" __global__ void reverse_upper_f32(const double* __restrict__ linv, float* __restrict__ u,
                                             int k, int* __restrict__ bad) {
    reverse_upper_impl<double>(linv, u, k, bad);
}

extern "C" __global__ void reverse_upper_from_f32(const float* __restrict__ linv,
                                                  float* __restrict__ u, int k,
                                                  int* __restrict__ bad) {
    reverse_upper_impl<float>(linv, u, k, bad);
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

// find_params for groups of at most FP_TILE_COLS columns (the MSE search's hot path): the same
// arithmetic in the same order as `find_params`, so the same bits, but each block first stages
// its FP_TILE_ROWS rows of the group in shared memory, transposed, so that the candidate passes
// read conflict-free shared memory instead of one global-memory line per row (a row per thread
// made every load of `find_params` 32 separate L1 wavefronts). With blockDim.x = FP_TILE_ROWS ·
// P, P threads share a row's MSE_STEPS candidates (consecutive runs of MSE_STEPS / P); their
// bests are merged in candidate order with the same strict `<`, so the first best candidate wins,
// as in the sequential loop.
#define FP_TILE_ROWS 64
#define FP_TILE_COLS 128
#define FP_MAX_PARTS 4
extern "C" __global__ void find_params_tiled(const float* __restrict__ w, int ldw, int n, int col0,
                                             int col_end, int g, int groups, int out_row0,
                                             int bits, int sym, int mse,
                                             float* __restrict__ scale_out,
                                             float* __restrict__ zero_out) {
    __shared__ float tile[FP_TILE_COLS][FP_TILE_ROWS + 1];
    __shared__ float part_err[FP_MAX_PARTS][FP_TILE_ROWS];
    __shared__ float part_s[FP_MAX_PARTS][FP_TILE_ROWS];
    __shared__ float part_z[FP_MAX_PARTS][FP_TILE_ROWS];
    int t = blockIdx.y;
    int row0 = blockIdx.x * FP_TILE_ROWS;
    int c_start = col0 + t * g;
    int len = min(c_start + g, col_end) - c_start;
    int parts = blockDim.x / FP_TILE_ROWS;
    if (t >= groups || len <= 0 || len > FP_TILE_COLS || parts < 1 || parts > FP_MAX_PARTS) return;
    int rows = min(FP_TILE_ROWS, n - row0);
    for (int idx = threadIdx.x; idx < rows * len; idx += blockDim.x) {
        int r = idx / len, c = idx - r * len;
        tile[c][r] = w[(size_t)(row0 + r) * ldw + c_start + c];
    }
    __syncthreads();
    int r = threadIdx.x % FP_TILE_ROWS;
    int part = threadIdx.x / FP_TILE_ROWS;
    bool live = r < rows;
    float maxq = (float)((1u << bits) - 1);
    float xmin = 0.0f, xmax = 0.0f;
    for (int c = 0; c < len; ++c) {
        xmin = fminf(xmin, tile[c][r]);
        xmax = fmaxf(xmax, tile[c][r]);
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
        int per = (MSE_STEPS + parts - 1) / parts;
        int i0 = part * per, i1 = min(MSE_STEPS, i0 + per);
        float best_err = INFINITY;
        float my_s = best_s, my_z = best_z;
        for (int i = i0; live && i < i1; ++i) {
            float p = (float)(1.0 - (double)i / (double)MSE_GRID);
            float lo = p * xmin, hi = p * xmax;
            float s = (hi - lo) / maxq;
            float z = sym ? sym_zero : rintf(-lo / s);
            float err = 0.0f;
            for (int c = 0; c < len; ++c) {
                float x = tile[c][r];
                float q = dequantize_code(quantize_code(x, s, z, maxq), s, z);
                err += powf(fabsf(q - x), MSE_NORM);
            }
            if (err < best_err) {
                best_err = err;
                my_s = s;
                my_z = z;
            }
        }
        part_err[part][r] = best_err;
        part_s[part][r] = my_s;
        part_z[part][r] = my_z;
        __syncthreads();
        if (part != 0 || !live) return;
        best_err = INFINITY;
        for (int q = 0; q < parts; ++q) {
            if (part_err[q][r] < best_err) {
                best_err = part_err[q][r];
                best_s = part_s[q][r];
                best_z = part_z[q][r];
            }
        }
    } else if (part != 0 || !live) {
        return;
    }
    size_t o = (size_t)(out_row0 + t) * n + r + row0;
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
// h [k, k] row-major: every element of a bs-column block below the diagonal set from its mirror
// above it (h[i][j] = h[j][i] where i / bs > j / bs): the full XᵀX from the upper blocks that
// xtx_add_upper accumulated.
extern "C" __global__ void mirror_upper_blocks(float* __restrict__ h, int k, int bs) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y;
    if (j >= k || i / bs <= j / bs) return;
    h[(size_t)i * k + j] = h[(size_t)j * k + i];
}

extern "C" __global__ void set_identity_f64(double* __restrict__ x, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y;
    if (i < k) x[(size_t)j * k + i] = i == j ? 1.0 : 0.0;
}

extern "C" __global__ void set_identity_f32(float* __restrict__ x, int k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int j = blockIdx.y;
    if (i < k) x[(size_t)j * k + i] = i == j ? 1.0f : 0.0f;
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

// ---------------------------------------------------------------------------------------------
// Fused causal GQA attention (flash-attention style), BF16 in, f32 softmax and accumulation, BF16
// out. CPU twin: model/minicpm_sala.rs sparse_attention_composed (f32 scores, additive causal
// mask, f32 softmax, f32 P·V, one rounding at the end).
//
//   q [B, T, H, D], k and v [B, T, KV, D] (contiguous BF16); o [B, T, H, D] BF16. Query head h
//   reads kv head h / (H / KV). o[t] = Σ_{s ≤ t} softmax_s(q_t·k_s · scale) v_s.
//
// One block per (BM-query tile, head, batch), BM/16 warps of 16 query rows each (BM = 64 or 128).
// The Q tile goes through shared memory into registers once; then key/value tiles of 64 rows
// stream through shared memory (cp.async: K of the next tile loads during P·V, V of this tile
// during Q·Kᵀ). Only key tiles at or below the diagonal are visited, only the tiles that cross
// it are masked, and a warp whose rows all precede a tile skips its products. Products are
// mma.sync m16n8k16 (BF16 in, f32 accumulate): S = Q·Kᵀ stays in registers, the running max and
// sum are f32 (base-2 exponent, the scale folded in), and the probabilities P are rounded to BF16
// as the A operand of P·V (the accumulator and its rescaling stay f32). Shared tiles are
// XOR-swizzled in 16-byte chunks, so ldmatrix is free of bank conflicts. D ∈ {16, 32, 64, 128}.
// ---------------------------------------------------------------------------------------------

#include <cuda_bf16.h>

#define FA_BN 64

// Index (in 16-byte chunks) of chunk `c` of row `r` in a swizzled tile of D/8 chunks per row.
template <int D>
__device__ __forceinline__ int fa_swz(int r, int c) {
    constexpr int CH = D / 8;
    if constexpr (CH >= 8) {
        return r * CH + (c ^ (r & 7));
    } else {
        return r * CH + (c ^ ((r / (8 / CH)) & (CH - 1)));
    }
}

__device__ __forceinline__ void fa_cp_async16(void* smem, const void* gmem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void fa_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void fa_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void fa_ldsm_x4(unsigned (&r)[4], const void* p) {
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void fa_ldsm_x4_t(unsigned (&r)[4], const void* p) {
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// c += a·b for one m16n8k16 tile (a: the 4 registers of the row-major A fragment, b0/b1 the
// col-major B fragment).
__device__ __forceinline__ void fa_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned fa_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// Rows [row0, row0 + ROWS) of a [T, ·] operand with `stride` elements between rows into a
// swizzled tile; rows at or past T are zero (so masked keys multiply zeros, never garbage).
template <int D, int ROWS, int THREADS>
__device__ __forceinline__ void fa_load_tile(uint4* tile, const __nv_bfloat16* g, int row0, int t,
                                             size_t stride) {
    constexpr int CH = D / 8;
    for (int i = threadIdx.x; i < ROWS * CH; i += THREADS) {
        int r = i / CH, c = i % CH;
        uint4* dst = tile + fa_swz<D>(r, c);
        if (row0 + r < t) {
            fa_cp_async16(dst, g + (size_t)(row0 + r) * stride + c * 8);
        } else {
            *dst = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

template <int D, int BM>
__device__ __forceinline__ void flash_attn_causal_impl(const __nv_bfloat16* __restrict__ q,
                                                       const __nv_bfloat16* __restrict__ k,
                                                       const __nv_bfloat16* __restrict__ v,
                                                       __nv_bfloat16* __restrict__ o, int t, int nh,
                                                       int nkv, float scale) {
    constexpr int THREADS = BM * 2;  // BM / 16 warps
    constexpr int CH = D / 8;        // 16-byte chunks per row
    constexpr int KS = D / 16;       // k-steps of Q·Kᵀ
    constexpr int NS = FA_BN / 8;    // n-tiles of S (8 keys each)
    constexpr int NO = D / 8;        // n-tiles of O (8 columns each)
    constexpr int KP = FA_BN / 16;   // k-steps of P·V
    constexpr int SMEM = (BM > 2 * FA_BN ? BM : 2 * FA_BN) * CH;
    // The Q tile first, then (once it is in registers) the K and V tiles in the same space.
    __shared__ __align__(128) uint4 smem[SMEM];
    uint4* sq = smem;
    uint4* sk = smem;
    uint4* sv = smem + FA_BN * CH;

    const int qb = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (nh / nkv);
    const int q0 = qb * BM;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t4 = lane % 4;
    const float sl2 = scale * 1.4426950408889634f;  // scores in base-2 exponent units

    const size_t qstride = (size_t)nh * D, kstride = (size_t)nkv * D;
    const __nv_bfloat16* qg = q + ((size_t)b * t * nh + h) * D;
    const __nv_bfloat16* kg = k + ((size_t)b * t * nkv + kvh) * D;
    const __nv_bfloat16* vg = v + ((size_t)b * t * nkv + kvh) * D;

    fa_load_tile<D, BM, THREADS>(sq, qg, q0, t, qstride);
    fa_cp_commit();
    fa_cp_wait_all();
    __syncthreads();
    unsigned qf[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        fa_ldsm_x4(qf[ks], sq + fa_swz<D>(warp * 16 + (lane % 16), ks * 2 + lane / 16));
    }
    __syncthreads();  // Q is in registers: its space takes K and V
    fa_load_tile<D, FA_BN, THREADS>(sk, kg, 0, t, kstride);
    fa_cp_commit();

    float acc[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
    const int wrow0 = q0 + warp * 16;  // this warp's first row
    const int rowa = wrow0 + g;        // this thread's rows: rowa and rowa + 8

    // Key tiles at or below the diagonal of the block's last row (keys past T are zero and
    // masked; a tile that starts past T is never needed).
    const int kend = min(t, q0 + BM);
    const int nkb = (kend + FA_BN - 1) / FA_BN;
    for (int j = 0; j < nkb; ++j) {
        fa_cp_wait_all();  // K_j
        __syncthreads();   // also: every warp is done with V_{j-1}
        fa_load_tile<D, FA_BN, THREADS>(sv, vg, j * FA_BN, t, kstride);
        fa_cp_commit();
        const int k0 = j * FA_BN;
        // Warp-uniform: a warp whose last row precedes the tile has nothing to add from it.
        const bool active = k0 <= wrow0 + 15;

        float s[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        unsigned pf[KP][4];
        if (active) {
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
                for (int np = 0; np < NS / 2; ++np) {
                    const int mi = lane / 8;
                    const int key = np * 16 + (mi / 2) * 8 + lane % 8;
                    unsigned bf[4];
                    fa_ldsm_x4(bf, sk + fa_swz<D>(key, ks * 2 + (mi % 2)));
                    fa_mma(s[2 * np], qf[ks], bf[0], bf[1]);
                    fa_mma(s[2 * np + 1], qf[ks], bf[2], bf[3]);
                }
            }

            if (k0 + FA_BN - 1 > wrow0) {  // the tile crosses this warp's diagonal
#pragma unroll
                for (int n = 0; n < NS; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = k0 + n * 8 + t4 * 2 + (e & 1);
                        const int row = rowa + (e >> 1) * 8;
                        if (key > row) s[n][e] = -INFINITY;
                    }
                }
            }

            // Online softmax in f32, two rows per thread (a row spans the 4 lanes of a quad).
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                // Key 0 is in every row's first tile, so mnew is finite from the first tile on.
                const float mnew = fmaxf(mrow[r], mx * sl2);
                const float alpha = exp2f(mrow[r] - mnew);  // 0 on the first tile
                mrow[r] = mnew;
                float sum = 0.0f;
#pragma unroll
                for (int n = 0; n < NS; ++n) {
                    const float p0 = exp2f(fmaf(s[n][2 * r], sl2, -mnew));
                    const float p1 = exp2f(fmaf(s[n][2 * r + 1], sl2, -mnew));
                    s[n][2 * r] = p0;
                    s[n][2 * r + 1] = p1;
                    sum += p0 + p1;
                }
                lrow[r] = lrow[r] * alpha + sum;
#pragma unroll
                for (int n = 0; n < NO; ++n) {
                    acc[n][2 * r] *= alpha;
                    acc[n][2 * r + 1] *= alpha;
                }
            }

            // P as BF16 A fragments: the accumulators of two adjacent 8-key tiles are one
            // 16-key A fragment in the same lanes.
#pragma unroll
            for (int kk = 0; kk < KP; ++kk) {
                pf[kk][0] = fa_pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                pf[kk][1] = fa_pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                pf[kk][2] = fa_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pf[kk][3] = fa_pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
        }

        fa_cp_wait_all();  // V_j
        __syncthreads();   // also: every warp is done with K_j
        if (j + 1 < nkb) {
            fa_load_tile<D, FA_BN, THREADS>(sk, kg, (j + 1) * FA_BN, t, kstride);
            fa_cp_commit();
        }

        if (active) {
#pragma unroll
            for (int kk = 0; kk < KP; ++kk) {
#pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    const int mi = lane / 8;
                    const int key = kk * 16 + (mi % 2) * 8 + lane % 8;
                    unsigned bf[4];
                    fa_ldsm_x4_t(bf, sv + fa_swz<D>(key, dp * 2 + mi / 2));
                    fa_mma(acc[2 * dp], pf[kk], bf[0], bf[1]);
                    fa_mma(acc[2 * dp + 1], pf[kk], bf[2], bf[3]);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = lrow[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = 1.0f / l;
        const int row = rowa + r * 8;
        if (row < t) {
            __nv_bfloat16* orow = o + ((size_t)b * t + row) * qstride + (size_t)h * D;
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                *reinterpret_cast<__nv_bfloat162*>(orow + n * 8 + t4 * 2) =
                    __floats2bfloat162_rn(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
            }
        }
    }
}

// flash_attn_causal_d{D}_m{BM}(q, k, v, o, T, H, KV, scale): grid (ceil(T / BM), H, B), BM·2
// threads.
#define FA_KERNEL(DIM, BM)                                                                         \
    extern "C" __global__ void __launch_bounds__(BM * 2) flash_attn_causal_d##DIM##_m##BM(       \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                  \
        const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ o, int t, int nh,         \
        int nkv, float scale) {                                                                    \
        flash_attn_causal_impl<DIM, BM>(q, k, v, o, t, nh, nkv, scale);                            \
    }
FA_KERNEL(16, 64)
FA_KERNEL(32, 64)
FA_KERNEL(64, 64)
FA_KERNEL(128, 64)
FA_KERNEL(16, 128)
FA_KERNEL(32, 128)
FA_KERNEL(64, 128)
FA_KERNEL(128, 128)
