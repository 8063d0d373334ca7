// Fused chunked Simple-GLA forward of the lightning layers (built to a fatbin by build.rs with the
// `cuda` feature; launched by kernels/gla.rs).
//
// Its CPU twins, which the tests compare it with (tests/cuda/gla.rs):
//   gla_fwd_d{D}_{bf16,f32} -> model/gla.rs chunked (and chunk_parallel, what the model runs)
//
// Per (batch b, head h) with decay γ = γ_h, state S [D, D] (zero, or a given state) and chunks
// of m ≤ 64 tokens (local indices i, j; the last chunk is the only one shorter than 64):
//
//   o_i = scale · ( Σ_{j ≤ i} (q_i · k_j) γ^{i−j} v_j  +  γ^{i+1} · q_i S )
//   S  ← γ^m S + Σ_j k_jᵀ (γ^{m−1−j} v_j)
//
// i.e. intra = ((Q_c K_cᵀ) ⊙ D) V_c, inter = (γ^{i+1} Q_c) S and the state update of `chunked`,
// with the row and column decays applied to the other factor of each product (γ^{i+1} to the
// row of Q·S, γ^{m−1−j} to v_j instead of k_j): equal in exact arithmetic, a rounding apart in
// f32. All arithmetic is f32 (FFMA; no TF32, no tensor cores), as the model's Simple-GLA is
// (docs/model.md, Numerics). Build without fast-math.
//
// Decomposition. One CTA of 256 threads per (value slice, head, batch): grid (D / W, H, B). The
// CTA walks its sequence's chunks in order and owns the value columns [W·slice, W·slice + W) of
// S and of o, so nothing but o leaves the chip: S's slice lives in registers (16 values per
// thread for D = 128) and, for the product with Q, as a copy in shared memory. The 64 × 64
// scores Q_c K_cᵀ are recomputed by each of the D / W CTAs of a head (the price of having
// B·H·D/W CTAs to fill the GPU with, not B·H).
//
// Per chunk, in three phases separated by barriers:
//   1. A = (Q Kᵀ) ⊙ D into shared memory (a thread's tile: rows ty + 16r, columns tx + 16c, for
//      r, c < 4; the blocks c > r lie above the diagonal for every thread alike, so only 10 of
//      the 16 are computed), and in the same loop over d the inter product Q S for the thread's
//      O tile (the same 4 rows, CPT = W/16 adjacent columns), which shares the Q loads;
//   2. O = γ^{i+1}·(Q S) + A V (rows 16r.. read the key blocks up to r only), scaled and written
//      to o (rows < T only); then the thread's 4 × 4 tile of S is decayed and updated with
//      Kᵀ (γ^{m−1−j} V) and copied to shared memory (phase 1 has stopped reading the old copy);
//   3. the next chunk, already loaded into registers at the start of this one (its global
//      loads overlap phases 1 and 2), is converted to f32 and stored to shared memory.
// Per chunk and CTA that is (10/16)·64·64·(D + W) + 2·64·D·W FMAs: for D = 128, W = 32, 3648
// FFMA per thread (2304 of them in phase 1) against ~600 shared loads (LDS.64/128,
// broadcast-friendly: each warp reads 4 rows of Q and A, 8 rows of K, and contiguous runs of V
// and S). The 4 CTAs of a head do 3.74 M FMAs per chunk, 1.19× the chunked form's 3.15 M (the
// scores four times over, but only their blocks on and below the diagonal).
//
// Shared memory (f32): Q, K [64][D + 4] (the +4 puts the rows 4 banks apart, so the 4-row and
// 8-row float4 reads of a warp are conflict-free), V and γ^{m−1−j}·V [64][W], A [64][72] (rows
// 8 banks apart for the 4 × 8-thread stores), S [D][W]: 116 KB for D = 128, one CTA per SM. The
// host computes the same size (kernels/gla.rs, `smem_bytes`) and allows it as dynamic shared
// memory.
//
// Decays (computed on the host in f64, stored as f32, as model/gla.rs chunk_decays does), per
// head 64·64 + 64 floats: D[i][j] = γ^{i−j} for j ≤ i (else 0), then γ^{i+1}. The chunk of real
// length m needs γ^{m−1−j} = D[m−1][j] (0 for j ≥ m, which also drops padded rows) and
// γ^m = γ^{(m−1)+1}: one table serves every m.
//
// Inputs are read in their model layout: q [B, T, H, D], k and v [B, T, KV, D], BF16 or f32
// (converted to f32 on load; BF16 → f32 is exact), all 16-byte aligned; head h reads kv head
// h / (H / KV) (grouped queries, so the caller repeats nothing). Output o [B, T, H, D] f32.
// Optional states (null for none): state_in [B, H, D, D] is S before the first token (zero when
// null), state_out [B, H, D, D] receives S after the last.

#include <stdint.h>

#define GLA_C 64         // chunk length
#define GLA_THREADS 256  // threads per CTA (the tile mappings below assume it)
#define GLA_AS 72        // row stride of the score tile A, in floats

// One 16-byte load of 4 f32 values as f32, times `mul`, to dst (16-byte aligned).
__device__ __forceinline__ void gla_put(float* dst, uint4 r, float mul, const float*) {
    *reinterpret_cast<float4*>(dst) =
        make_float4(__uint_as_float(r.x) * mul, __uint_as_float(r.y) * mul,
                    __uint_as_float(r.z) * mul, __uint_as_float(r.w) * mul);
}

// One 16-byte load of 8 BF16 values (raw bits, little-endian pairs) as f32, times `mul`.
__device__ __forceinline__ void gla_put(float* dst, uint4 r, float mul, const uint16_t*) {
    *reinterpret_cast<float4*>(dst) =
        make_float4(__uint_as_float(r.x << 16) * mul, __uint_as_float(r.x & 0xffff0000u) * mul,
                    __uint_as_float(r.y << 16) * mul, __uint_as_float(r.y & 0xffff0000u) * mul);
    *reinterpret_cast<float4*>(dst + 4) =
        make_float4(__uint_as_float(r.z << 16) * mul, __uint_as_float(r.z & 0xffff0000u) * mul,
                    __uint_as_float(r.w << 16) * mul, __uint_as_float(r.w & 0xffff0000u) * mul);
}

// CPT consecutive floats from shared memory (CPT = 1 or 2).
template <int CPT>
__device__ __forceinline__ void gla_cols(float (&out)[CPT], const float* p) {
    if constexpr (CPT == 2) {
        const float2 x = *reinterpret_cast<const float2*>(p);
        out[0] = x.x;
        out[1] = x.y;
    } else {
        out[0] = p[0];
    }
}

// Bytes of dynamic shared memory for head dimension D (kernels/gla.rs `smem_bytes` must agree).
template <int D>
struct GlaShape {
    static constexpr int W = D < 32 ? D : 32;  // value columns per CTA
    static constexpr int CPT = W / 16;         // O columns per thread
    static constexpr int QS = D + 4;           // row stride of Q and K
    static constexpr int FLOATS = 2 * GLA_C * QS + 2 * GLA_C * W + GLA_C * GLA_AS + D * W;
};

template <int D, typename In>
__device__ __forceinline__ void gla_fwd_impl(const In* __restrict__ q, const In* __restrict__ k,
                                             const In* __restrict__ v, float* __restrict__ o,
                                             const float* __restrict__ tab,
                                             const float* __restrict__ state_in,
                                             float* __restrict__ state_out, int t_len, int nh,
                                             int nkv, float scale) {
    constexpr int W = GlaShape<D>::W, CPT = GlaShape<D>::CPT, QS = GlaShape<D>::QS;
    constexpr int EV = 16 / (int)sizeof(In);          // elements per 16-byte load
    constexpr int QV = D / EV, VV = W / EV;           // 16-byte loads per q/k row, per v row
    constexpr int NQ = (GLA_C * QV + GLA_THREADS - 1) / GLA_THREADS;  // per thread
    constexpr int NV = (GLA_C * VV + GLA_THREADS - 1) / GLA_THREADS;
    constexpr int NDV4 = W / 4, NDK4 = D / 4;         // 4 × 4 tiles of the state slice
    static_assert(D % 16 == 0 && D >= 16 && D <= 128, "head dimension");
    static_assert(NDK4 * NDV4 <= GLA_THREADS, "state tiles");

    extern __shared__ __align__(16) float gla_smem[];
    float* sQ = gla_smem;          // [64][QS]
    float* sK = sQ + GLA_C * QS;   // [64][QS]
    float* sV = sK + GLA_C * QS;   // [64][W]
    float* sVd = sV + GLA_C * W;   // [64][W], row j times γ^{m−1−j}
    float* sA = sVd + GLA_C * W;   // [64][GLA_AS]
    float* sS = sA + GLA_C * GLA_AS;  // [D][W]

    const int slice = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int kvh = h / (nh / nkv);
    const int dv0 = slice * W;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Scores and output tiles: a warp covers 4 values of ty and 8 of tx.
    const int ty = (warp >> 1) * 4 + (lane >> 3), tx = (warp & 1) * 8 + (lane & 7);
    // State tile: rows 4·dkg.., columns 4·dvg.. of the slice; a warp covers 4 dkg and 8 dvg.
    const bool s_active = tid < NDK4 * NDV4;
    const int dvg = tid % NDV4, dkg = tid / NDV4;

    const float* dtab = tab + (size_t)h * (GLA_C * GLA_C + GLA_C);  // D[i][j]
    const float* qdec = dtab + GLA_C * GLA_C;                        // γ^{i+1}

    const size_t qstride = (size_t)nh * D, kstride = (size_t)nkv * D;
    const In* qg = q + (size_t)b * t_len * qstride + (size_t)h * D;
    const In* kg = k + (size_t)b * t_len * kstride + (size_t)kvh * D;
    const In* vg = v + (size_t)b * t_len * kstride + (size_t)kvh * D + dv0;
    float* og = o + (size_t)b * t_len * qstride + (size_t)h * D + dv0;
    const size_t sbase = ((size_t)b * nh + h) * D * D;

    // The thread's tile of S (rows 4·dkg + u, slice columns 4·dvg + c).
    float s[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            s[u][c] = (s_active && state_in != nullptr)
                          ? state_in[sbase + (size_t)(4 * dkg + u) * D + dv0 + 4 * dvg + c]
                          : 0.0f;
        }
    }
    if (s_active) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            *reinterpret_cast<float4*>(sS + (4 * dkg + u) * W + 4 * dvg) =
                make_float4(s[u][0], s[u][1], s[u][2], s[u][3]);
        }
    }

    // The next chunk's raw inputs, in flight in registers while the current one computes.
    uint4 pq[NQ], pk[NQ], pv[NV];
    auto load = [&](int c) {
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
            const int e = tid + n * GLA_THREADS;
            const int row = e / QV, col = (e % QV) * EV, tok = c * GLA_C + row;
            pq[n] = pk[n] = make_uint4(0u, 0u, 0u, 0u);
            if (e < GLA_C * QV && tok < t_len) {
                pq[n] = __ldg(reinterpret_cast<const uint4*>(qg + (size_t)tok * qstride + col));
                pk[n] = __ldg(reinterpret_cast<const uint4*>(kg + (size_t)tok * kstride + col));
            }
        }
#pragma unroll
        for (int n = 0; n < NV; ++n) {
            const int e = tid + n * GLA_THREADS;
            const int row = e / VV, col = (e % VV) * EV, tok = c * GLA_C + row;
            pv[n] = make_uint4(0u, 0u, 0u, 0u);
            if (e < GLA_C * VV && tok < t_len) {
                pv[n] = __ldg(reinterpret_cast<const uint4*>(vg + (size_t)tok * kstride + col));
            }
        }
    };
    // Stores the loaded chunk of real length m (rows past it are zero).
    auto store = [&](int m) {
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
            const int e = tid + n * GLA_THREADS;
            if (e < GLA_C * QV) {
                const int row = e / QV, col = (e % QV) * EV;
                gla_put(sQ + row * QS + col, pq[n], 1.0f, q);
                gla_put(sK + row * QS + col, pk[n], 1.0f, q);
            }
        }
#pragma unroll
        for (int n = 0; n < NV; ++n) {
            const int e = tid + n * GLA_THREADS;
            if (e < GLA_C * VV) {
                const int row = e / VV, col = (e % VV) * EV;
                gla_put(sV + row * W + col, pv[n], 1.0f, q);
                gla_put(sVd + row * W + col, pv[n], __ldg(dtab + (m - 1) * GLA_C + row), q);
            }
        }
    };

    const int nc = (t_len + GLA_C - 1) / GLA_C;
    load(0);
    store(min(GLA_C, t_len));
    __syncthreads();

    for (int c = 0; c < nc; ++c) {
        const int t0 = c * GLA_C;
        const int m = min(GLA_C, t_len - t0);
        if (c + 1 < nc) load(c + 1);

        // Phase 1: A = (Q Kᵀ) ⊙ D, and Q·S for the O tile.
        float acc[4][4], oi[4][CPT];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int x = 0; x < 4; ++x) acc[r][x] = 0.0f;
#pragma unroll
            for (int x = 0; x < CPT; ++x) oi[r][x] = 0.0f;
        }
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            float4 qa[4], kb[4];
            float sv[4][CPT];
#pragma unroll
            for (int r = 0; r < 4; ++r)
                qa[r] = *reinterpret_cast<const float4*>(sQ + (ty + 16 * r) * QS + d);
#pragma unroll
            for (int x = 0; x < 4; ++x)
                kb[x] = *reinterpret_cast<const float4*>(sK + (tx + 16 * x) * QS + d);
#pragma unroll
            for (int u = 0; u < 4; ++u) gla_cols<CPT>(sv[u], sS + (d + u) * W + tx * CPT);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
#pragma unroll
                for (int x = 0; x <= r; ++x) {  // column block x > r is above the diagonal
                    float a = acc[r][x];
                    a = fmaf(qa[r].x, kb[x].x, a);
                    a = fmaf(qa[r].y, kb[x].y, a);
                    a = fmaf(qa[r].z, kb[x].z, a);
                    a = fmaf(qa[r].w, kb[x].w, a);
                    acc[r][x] = a;
                }
#pragma unroll
                for (int x = 0; x < CPT; ++x) {
                    float a = oi[r][x];
                    a = fmaf(qa[r].x, sv[0][x], a);
                    a = fmaf(qa[r].y, sv[1][x], a);
                    a = fmaf(qa[r].z, sv[2][x], a);
                    a = fmaf(qa[r].w, sv[3][x], a);
                    oi[r][x] = a;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
            for (int x = 0; x <= r; ++x) {
                const int i = ty + 16 * r, j = tx + 16 * x;
                sA[i * GLA_AS + j] = acc[r][x] * __ldg(dtab + i * GLA_C + j);
            }
        }
        __syncthreads();

        // Phase 2: O = γ^{i+1}·(Q S) + A V, then S ← γ^m S + Kᵀ (γ^{m−1−j} V).
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const float g = __ldg(qdec + ty + 16 * r);
#pragma unroll
            for (int x = 0; x < CPT; ++x) oi[r][x] *= g;
        }
        // Keys in blocks of 16: rows 16r.. see keys of blocks up to r only.
#pragma unroll
        for (int kb = 0; kb < 4; ++kb) {
#pragma unroll
            for (int j = 16 * kb; j < 16 * kb + 16; j += 4) {
                float4 aa[4];
                float vv[4][CPT];
#pragma unroll
                for (int r = kb; r < 4; ++r)
                    aa[r] = *reinterpret_cast<const float4*>(sA + (ty + 16 * r) * GLA_AS + j);
#pragma unroll
                for (int u = 0; u < 4; ++u) gla_cols<CPT>(vv[u], sV + (j + u) * W + tx * CPT);
#pragma unroll
                for (int r = kb; r < 4; ++r) {
#pragma unroll
                    for (int x = 0; x < CPT; ++x) {
                        float a = oi[r][x];
                        a = fmaf(aa[r].x, vv[0][x], a);
                        a = fmaf(aa[r].y, vv[1][x], a);
                        a = fmaf(aa[r].z, vv[2][x], a);
                        a = fmaf(aa[r].w, vv[3][x], a);
                        oi[r][x] = a;
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int i = ty + 16 * r;
            if (i < m) {
                float* dst = og + (size_t)(t0 + i) * qstride + tx * CPT;
                if constexpr (CPT == 2) {
                    *reinterpret_cast<float2*>(dst) = make_float2(oi[r][0] * scale, oi[r][1] * scale);
                } else {
                    dst[0] = oi[r][0] * scale;
                }
            }
        }
        // The last chunk's update is needed only for the final state.
        if (s_active && (c + 1 < nc || state_out != nullptr)) {
            const float gm = __ldg(qdec + m - 1);  // γ^m
#pragma unroll
            for (int u = 0; u < 4; ++u) {
#pragma unroll
                for (int x = 0; x < 4; ++x) s[u][x] *= gm;
            }
#pragma unroll 4
            for (int j = 0; j < GLA_C; ++j) {
                const float4 kk = *reinterpret_cast<const float4*>(sK + j * QS + 4 * dkg);
                const float4 vd = *reinterpret_cast<const float4*>(sVd + j * W + 4 * dvg);
                const float ku[4] = {kk.x, kk.y, kk.z, kk.w};
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    s[u][0] = fmaf(ku[u], vd.x, s[u][0]);
                    s[u][1] = fmaf(ku[u], vd.y, s[u][1]);
                    s[u][2] = fmaf(ku[u], vd.z, s[u][2]);
                    s[u][3] = fmaf(ku[u], vd.w, s[u][3]);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                *reinterpret_cast<float4*>(sS + (4 * dkg + u) * W + 4 * dvg) =
                    make_float4(s[u][0], s[u][1], s[u][2], s[u][3]);
            }
        }
        if (c + 1 < nc) {
            __syncthreads();  // every thread is done with this chunk's Q, K, V and A
            store(min(GLA_C, t_len - t0 - GLA_C));
            __syncthreads();  // the next chunk and the new S are in shared memory
        }
    }

    if (state_out != nullptr && s_active) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                state_out[sbase + (size_t)(4 * dkg + u) * D + dv0 + 4 * dvg + x] = s[u][x];
            }
        }
    }
}

// gla_fwd_d{D}_{bf16,f32}(q, k, v, o, tab, state_in, state_out, T, H, KV, scale): grid
// (D / min(D, 32), H, B), GLA_THREADS threads, GlaShape<D>::FLOATS · 4 bytes of dynamic shared
// memory. BF16 inputs are passed as their raw 16-bit patterns.
#define GLA_KERNEL(DIM, NAME, TYPE)                                                                \
    extern "C" __global__ void __launch_bounds__(GLA_THREADS, 1) gla_fwd_d##DIM##_##NAME(         \
        const TYPE* __restrict__ q, const TYPE* __restrict__ k, const TYPE* __restrict__ v,        \
        float* __restrict__ o, const float* __restrict__ tab, const float* __restrict__ state_in,  \
        float* __restrict__ state_out, int t, int nh, int nkv, float scale) {                      \
        gla_fwd_impl<DIM, TYPE>(q, k, v, o, tab, state_in, state_out, t, nh, nkv, scale);          \
    }
GLA_KERNEL(16, bf16, uint16_t)
GLA_KERNEL(32, bf16, uint16_t)
GLA_KERNEL(64, bf16, uint16_t)
GLA_KERNEL(128, bf16, uint16_t)
GLA_KERNEL(16, f32, float)
GLA_KERNEL(32, f32, float)
GLA_KERNEL(64, f32, float)
GLA_KERNEL(128, f32, float)
