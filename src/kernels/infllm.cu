// InfLLM-v2 block-sparse attention kernels (built to a fatbin by build.rs with the `cuda` feature;
// launched from src/kernels/infllm.rs). Semantics: /work/notes/infllmv2-spec.md §0, §2.C-G, §3,
// §4 and docs/model.md (InfLLM-v2). Each kernel has a CPU twin in src/model/infllm.rs that
// tests/cuda/infllm.rs compares it with:
//
//   infllm_block_scores_g{G}    -> infllm.rs block_scores (stage 1, head sum, max pooling, forced
//                                  blocks; equal up to 1 BF16 step of the head sum's rounding)
//   infllm_select               -> infllm.rs select_blocks (top-k, lower index on ties, sorted,
//                                  −1 padded; identical given identical scores)
//   infllm_attend_g{G}_m{BM}    -> infllm.rs block_sparse_attention (stage 2; to BF16 rounding of
//                                  P and of the output)
//
// Layouts (all contiguous, row-major): q [B, T, H, D] BF16; K1 [B, N1, KV, D] and K2 [B, N2, KV, D]
// BF16 (the compressed keys: means of 32 keys every 16 and of 128 every 64, computed by the
// caller); k, v [B, T, KV, D] BF16; scores [B, KV, T, NB] f32 with NB = ceil(T / 64); sel
// [B, KV, T, K] i32 with K = min(topk, NB); o [B, T, H·D] BF16. D = 128, G = H / KV heads per kv
// group (1, 2, 4, 8 or 16), key blocks of 64 tokens, 4 K1 columns per block (64 / 16).
//
// Numerics (spec §4): products are mma.sync m16n8k16 BF16 × BF16 → f32; softmax statistics, exp2f
// and sums in f32 (IEEE, no fast-math); the stage-1 head sum is rounded once to BF16 (RNE); stage 2
// rounds P to BF16 as the A operand of P·V and accumulates in f32, like flash_attn_causal_impl in
// gptq.cu (whose structure the tiles here follow: cp.async 16-byte copies into XOR-swizzled shared
// tiles, ldmatrix fragments, the Q tile held in registers).

#include <stdint.h>
#include <cuda_bf16.h>

#define IL_D 128            // head dimension
#define IL_BN 64            // keys (or compressed keys) per tile = tokens per key block
#define IL_CH (IL_D / 8)    // 16-byte chunks per row
#define IL_KS (IL_D / 16)   // k-steps of a 128-wide dot product
#define IL_NS (IL_BN / 8)   // 8-column n-tiles per 64-column tile
#define IL_R 4              // K1 columns per key block (block 64 / stride 16)
#define IL_TILE (IL_BN * IL_CH)  // uint4 per 64-row tile (16 KB)

// Index (in 16-byte chunks) of chunk c of row r in a swizzled tile of 16 chunks per row.
__device__ __forceinline__ int il_swz(int r, int c) { return r * IL_CH + (c ^ (r & 7)); }

__device__ __forceinline__ void il_cp_async16(void* smem, const void* gmem) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void il_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void il_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ void il_ldsm_x4(unsigned (&r)[4], const void* p) {
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}
__device__ __forceinline__ void il_ldsm_x4_t(unsigned (&r)[4], const void* p) {
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// c += a·b for one m16n8k16 tile (a: the row-major A fragment, b0/b1 the col-major B fragment).
__device__ __forceinline__ void il_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned il_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// Rows [row0, row0 + 64) of a [n, ·] operand (row stride `stride` elements) into a swizzled tile;
// rows at or past n are zero.
template <int THREADS>
__device__ __forceinline__ void il_load_tile(uint4* tile, const __nv_bfloat16* g, int row0, int n,
                                             size_t stride) {
    for (int i = threadIdx.x; i < IL_TILE; i += THREADS) {
        const int r = i / IL_CH, c = i % IL_CH;
        uint4* dst = tile + il_swz(r, c);
        if (row0 + r < n) {
            il_cp_async16(dst, g + (size_t)(row0 + r) * stride + c * 8);
        } else {
            *dst = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// Query rows of a tile: `rows` rows, row R = warp·16 + r holding query head kvh·G + r % G of token
// i0 + warp·(16/G) + r / G (each warp's 16 rows are 16/G tokens × the G heads of kv group kvh).
// Tokens at or past T are zero rows.
template <int G, int THREADS>
__device__ __forceinline__ void il_load_q(uint4* tile, const __nv_bfloat16* q, int rows, int b, int i0,
                                          int kvh, int t, int nh) {
    constexpr int TPW = 16 / G;
    for (int i = threadIdx.x; i < rows * IL_CH; i += THREADS) {
        const int row = i / IL_CH, c = i % IL_CH;
        const int w = row / 16, r = row % 16;
        const int tok = i0 + w * TPW + r / G, h = kvh * G + r % G;
        uint4* dst = tile + il_swz(row, c);
        if (tok < t) {
            il_cp_async16(dst, q + (((size_t)b * t + tok) * nh + h) * IL_D + c * 8);
        } else {
            *dst = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// S (16 rows × 64 columns, f32) = this warp's Q fragments · the 64 rows of a swizzled tile.
__device__ __forceinline__ void il_qk(float (&s)[IL_NS][4], const unsigned (&qf)[IL_KS][4],
                                      const uint4* tile, int lane) {
#pragma unroll
    for (int n = 0; n < IL_NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < IL_KS; ++ks) {
#pragma unroll
        for (int np = 0; np < IL_NS / 2; ++np) {
            const int mi = lane / 8;
            const int key = np * 16 + (mi / 2) * 8 + lane % 8;
            unsigned bf[4];
            il_ldsm_x4(bf, tile + il_swz(key, ks * 2 + (mi % 2)));
            il_mma(s[2 * np], qf[ks], bf[0], bf[1]);
            il_mma(s[2 * np + 1], qf[ks], bf[2], bf[3]);
        }
    }
}

// How many compressed keys of stride `s` (n in all) query i of a t-token sequence sees: columns
// 0 .. visible−1. Kernel-exact, with C's truncating division (InfllmV2::visible; spec §2.C.3-4:
// t ≡ −1 (mod s) drops each query's newest window).
__device__ __forceinline__ int il_visible(int i, int t, int n, int s) {
    const int off = n - (t - s + 1) / s;
    const int l = max((i + 1) / s - 1 + off, 0);
    return min(l, n);
}

// ---------------------------------------------------------------------------------------------
// Stage 1 and pooling: block scores. CPU twin: model/infllm.rs block_scores.
//
//   scores[b, g, i, blk] =
//     +inf                          if blk < init_blocks or qb − local_blocks ≤ blk ≤ qb (forced),
//     max_{j ∈ [4·blk−1, 4·blk+3] ∩ [0, N1)} P[g, i, j]   otherwise (−inf if that range is empty),
//   P[g, i, j] = bf16(Σ_{heads h of group g} exp(s·q_h·K1[j] − LSE_h(i)))  for j < L1(i), else 0,
//   LSE_h(i) = log Σ_{c < L2(i)} exp(s·q_h·K2[c]),
//
// with qb = i / 64, L1/L2 the kernel-exact visible counts (il_visible), s = 1/sqrt(D). A row whose
// token sees no K2 window, or whose qb < K = min(topk, NB) (all its past blocks are selected
// whatever the scores), has P = 0: its products are skipped, as on the CPU. Only blocks that are
// past and not forced (init_blocks ≤ blk < qb − local_blocks) take a pooled P value; their windows
// lie in K1 columns [4·init_blocks − 1, 4·(qb − local_blocks)), so only those columns are computed
// (every other entry is +inf, 0 or −inf by position alone). K2 is needed over all visible windows.
//
// Launch: grid (ceil(T / TPC), KV, B), 128 threads (4 warps), TPC = 4·(16/G) tokens per block.
// Warp w owns tokens i0 + w·(16/G) .. + 16/G − 1 as the 16 rows of an m16n8k16 tile (16/G tokens ×
// the G query heads of kv head g; 16 = one token's heads for the released model, as in the
// official kernel). The block's tokens share every K2/K1 tile, streamed through two 16 KB
// shared buffers with cp.async (the next tile loads while this one is used). Pass 1 (K2 tiles):
// the online max and sum of exp2 per row (f32, base-2 units with the scale folded in). Pass 2
// (K1 tiles): P per row = exp2(s·x − m)·(1/sum), summed over the rows of a token by register adds
// and lane shuffles (rows r and r+8, then lanes xor 16, 8, 4 as far as the token's rows reach; the
// official hdim16_reduce order), rounded to BF16 into a per-warp shared row (plus the previous
// tile's last column, which the first block of a tile pools), then max-pooled into that tile's 16
// blocks. The remaining entries are written from their position by all threads.
// ---------------------------------------------------------------------------------------------

template <int G>
__device__ __forceinline__ void infllm_block_scores_impl(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k1,
    const __nv_bfloat16* __restrict__ k2, float* __restrict__ out, int t, int nh, int nkv, int n1,
    int n2, int nb, int kk, int init_blocks, int local_blocks, float scale) {
    constexpr int WARPS = 4, THREADS = WARPS * 32;
    constexpr int TPW = 16 / G;        // tokens per warp
    constexpr int TPC = WARPS * TPW;   // tokens per block
    __shared__ __align__(128) uint4 smem[2 * IL_TILE];
    __shared__ __nv_bfloat16 sp[WARPS][TPW][IL_BN + 1];  // [0]: the previous tile's last column

    const int i0 = (gridDim.x - 1 - blockIdx.x) * TPC;  // the longest rows first
    const int g = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gr = lane / 4, t4 = lane % 4;
    const float sl2 = scale * 1.4426950408889634f;  // scores in base-2 exponent units
    const size_t orow0 = ((size_t)b * nkv + g) * t;  // scores row of token 0

    // Whether token `tok` has stage-1 products, and the K1 columns its pooled blocks need. Both
    // grow with tok, so a warp's or a block's maximum is its last valid token's.
    auto computes = [&](int tok) {
        return tok < t && tok / IL_BN >= kk && il_visible(tok, t, n2, 4 * 16) > 0;
    };
    auto col_end = [&](int tok) { return max(IL_R * (tok / IL_BN - local_blocks), 0); };

    // Entries fixed by position: forced blocks, future blocks, and every block of a row without
    // products (P = 0 there, so a non-empty window pools to 0).
    for (int x = threadIdx.x; x < TPC * nb; x += THREADS) {
        const int tl = x / nb, blk = x % nb;
        const int tok = i0 + tl;
        if (tok >= t) continue;
        const int qb = tok / IL_BN;
        if (computes(tok) && blk >= init_blocks && blk + local_blocks < qb) continue;  // pooled
        const bool forced = blk < init_blocks || (qb >= blk && qb <= blk + local_blocks);
        const int lo = max(IL_R * blk - 1, 0), hi = min(IL_R * blk + IL_R, n1);
        out[(orow0 + tok) * nb + blk] = forced ? INFINITY : (hi > lo ? 0.0f : -INFINITY);
    }

    const int last = min(i0 + TPC, t) - 1;  // the block's last valid token
    if (!computes(last)) return;            // block-uniform
    const int n2_tiles = (il_visible(last, t, n2, 4 * 16) + IL_BN - 1) / IL_BN;
    const int j_start = (max(IL_R * init_blocks - 1, 0) / IL_BN) * IL_BN;
    const int j_end = col_end(last);
    const int n1_tiles = j_end > j_start ? (j_end - j_start + IL_BN - 1) / IL_BN : 0;
    const int tiles = n2_tiles + n1_tiles;

    // This warp's extent (warp-uniform) and this thread's two rows (gr and gr + 8).
    const int wlast = min(i0 + warp * TPW + TPW, t) - 1;
    const bool wcomp = wlast >= i0 + warp * TPW && computes(wlast);
    const int w_l2 = wcomp ? il_visible(wlast, t, n2, 4 * 16) : 0;
    const int w_jend = wcomp ? col_end(wlast) : 0;
    int tok[2], l1[2], l2[2];
    bool comp[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tok[r] = i0 + warp * TPW + (gr + 8 * r) / G;
        comp[r] = computes(tok[r]);
        l1[r] = comp[r] ? il_visible(tok[r], t, n1, 16) : 0;
        l2[r] = comp[r] ? il_visible(tok[r], t, n2, 4 * 16) : 0;
    }

    // Q through shared memory into registers (buffer 1), then the first tile into buffer 0.
    il_load_q<G, THREADS>(smem + IL_TILE, q, WARPS * 16, b, i0, g, t, nh);
    il_cp_commit();
    il_cp_wait_all();
    __syncthreads();
    unsigned qf[IL_KS][4];
#pragma unroll
    for (int ks = 0; ks < IL_KS; ++ks) {
        il_ldsm_x4(qf[ks], smem + IL_TILE + il_swz(warp * 16 + (lane % 16), ks * 2 + lane / 16));
    }
    __syncthreads();  // every warp has its Q: buffer 1 is free

    const size_t kstride = (size_t)nkv * IL_D;
    const __nv_bfloat16* k1g = k1 + ((size_t)b * n1 * nkv + g) * IL_D;
    const __nv_bfloat16* k2g = k2 + ((size_t)b * n2 * nkv + g) * IL_D;
    auto load = [&](int x) {
        uint4* buf = smem + (x & 1) * IL_TILE;
        if (x < n2_tiles) {
            il_load_tile<THREADS>(buf, k2g, x * IL_BN, n2, kstride);
        } else {
            il_load_tile<THREADS>(buf, k1g, j_start + (x - n2_tiles) * IL_BN, n1, kstride);
        }
        il_cp_commit();
    };

    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f}, inv[2] = {0.0f, 0.0f};
    for (int x = lane; x < TPW; x += 32) sp[warp][x][0] = __float2bfloat16_rn(-INFINITY);

    load(0);
    for (int x = 0; x < tiles; ++x) {
        il_cp_wait_all();  // tile x
        __syncthreads();   // also: every warp is done with tile x − 1's buffer
        if (x + 1 < tiles) load(x + 1);
        const uint4* tile = smem + (x & 1) * IL_TILE;
        float s[IL_NS][4];

        if (x < n2_tiles) {
            // Pass 1: the running max and sum of exp2 over the visible K2 windows.
            const int c0 = x * IL_BN;
            if (c0 >= w_l2) continue;  // warp-uniform: no row of this warp sees the tile
            il_qk(s, qf, tile, lane);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int n = 0; n < IL_NS; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = c0 + n * 8 + t4 * 2 + e;
                        if (col >= l2[r]) s[n][2 * r + e] = -INFINITY;
                        mx = fmaxf(mx, s[n][2 * r + e]);
                    }
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mnew = fmaxf(mrow[r], mx * sl2);
                if (mnew == -INFINITY) continue;  // the row sees nothing yet (uniform in a quad)
                const float alpha = exp2f(mrow[r] - mnew);
                float sum = 0.0f;
#pragma unroll
                for (int n = 0; n < IL_NS; ++n) {
                    sum += exp2f(fmaf(s[n][2 * r], sl2, -mnew)) +
                           exp2f(fmaf(s[n][2 * r + 1], sl2, -mnew));
                }
                lrow[r] = lrow[r] * alpha + sum;
                mrow[r] = mnew;
            }
            continue;
        }

        if (x == n2_tiles) {
            // The K2 sums are complete: 1 / Σ per row (over the quad's four partial sums).
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float l = lrow[r];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                inv[r] = comp[r] ? 1.0f / l : 0.0f;
            }
        }

        // Pass 2: P over this K1 tile, summed over each token's heads, pooled into 16 blocks.
        const int j0 = j_start + (x - n2_tiles) * IL_BN;
        if (j0 >= w_jend) continue;  // warp-uniform: no pooled block of this warp's tokens here
        il_qk(s, qf, tile, lane);
#pragma unroll
        for (int n = 0; n < IL_NS; ++n) {
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1;
                const int col = j0 + n * 8 + t4 * 2 + (e & 1);
                v[e] = (comp[r] && col < l1[r]) ? exp2f(fmaf(s[n][e], sl2, -mrow[r])) * inv[r] : 0.0f;
            }
            // The head sum of each token: its rows are gr .. in steps of 1 within groups of G
            // (rows r and r + 8 both belong to token 0 when G = 16).
            if (G == 16) {
                v[0] += v[2];
                v[1] += v[3];
            }
#pragma unroll
            for (int m = 16; m >= 4; m >>= 1) {
                if (m / 4 < (G < 8 ? G : 8)) {
#pragma unroll
                    for (int e = 0; e < (G == 16 ? 2 : 4); ++e) {
                        v[e] += __shfl_xor_sync(0xffffffffu, v[e], m);
                    }
                }
            }
            if (gr % G == 0) {
                const int col = 1 + n * 8 + t4 * 2;
                const int ta = gr / G;
                sp[warp][ta][col] = __float2bfloat16_rn(v[0]);
                sp[warp][ta][col + 1] = __float2bfloat16_rn(v[1]);
                if (G < 16) {
                    const int tb = (gr + 8) / G;
                    sp[warp][tb][col] = __float2bfloat16_rn(v[2]);
                    sp[warp][tb][col + 1] = __float2bfloat16_rn(v[3]);
                }
            }
        }
        __syncwarp();
        // Block blk = j0/4 + m pools columns 4m−1 .. 4m+3 of the tile: slots 4m .. 4m+4.
        for (int task = lane; task < TPW * 16; task += 32) {
            const int tl = task / 16, m = task % 16;
            const int tk = i0 + warp * TPW + tl;
            const int blk = j0 / IL_R + m;
            if (!computes(tk) || blk < init_blocks || blk + local_blocks >= tk / IL_BN) continue;
            float mx = __bfloat162float(sp[warp][tl][4 * m]);
#pragma unroll
            for (int e = 1; e <= 4; ++e) mx = fmaxf(mx, __bfloat162float(sp[warp][tl][4 * m + e]));
            out[(orow0 + tk) * nb + blk] = mx;
        }
        __syncwarp();
        for (int tl = lane; tl < TPW; tl += 32) sp[warp][tl][0] = sp[warp][tl][IL_BN];
        __syncwarp();
    }
}

// infllm_block_scores_g{G}(q, k1, k2, scores, T, H, KV, N1, N2, NB, K, init_blocks,
// local_blocks, scale): grid (ceil(T / (64 / G)), KV, B), 128 threads.
#define IL_SCORES_KERNEL(G)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) infllm_block_scores_g##G(                    \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k1,                 \
        const __nv_bfloat16* __restrict__ k2, float* __restrict__ out, int t, int nh, int nkv,     \
        int n1, int n2, int nb, int kk, int init_blocks, int local_blocks, float scale) {          \
        infllm_block_scores_impl<G>(q, k1, k2, out, t, nh, nkv, n1, n2, nb, kk, init_blocks,       \
                                    local_blocks, scale);                                          \
    }
IL_SCORES_KERNEL(1)
IL_SCORES_KERNEL(2)
IL_SCORES_KERNEL(4)
IL_SCORES_KERNEL(8)
IL_SCORES_KERNEL(16)

// ---------------------------------------------------------------------------------------------
// Top-k selection. CPU twin: model/infllm.rs select_blocks.
//
//   sel[row] = the K best blocks of scores[row] (higher score first; on equal scores the lower
//              index, as torch.topk on CUDA), those after the query's block qb = i / 64 dropped,
//              ascending, padded with −1 to K entries;  i = row % T.
//
// A row with qb < K gets 0, 1, .., qb (then −1s) directly: with the scores infllm_block_scores
// writes, every past block is in its top K whatever the pooled values (forced blocks are +inf,
// the others ≥ 0 = the score of every future block, which loses ties by its higher index).
//
// Launch: grid (ceil(rows / W)), W·32 threads, W·(NB + 256)·4 bytes of dynamic shared memory:
// one warp per row. Scores become order-preserving u32 keys (the IEEE total order, as f32's
// total_cmp) in shared memory; a 4-pass radix select (8 bits a pass, a 256-bin histogram in
// shared memory, a warp scan from the top bin) finds the K-th largest key and how many of the
// keys equal to it are taken; one pass in index order (ballots, so the lowest indices of the tie
// go first) then writes the kept blocks ≤ qb in ascending order.
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(128) infllm_select(const float* __restrict__ scores,
                                                                int* __restrict__ sel, int rows,
                                                                int t, int nb, int kk, int bs) {
    extern __shared__ unsigned tk_smem[];
    const int warps = blockDim.x / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row = blockIdx.x * warps + warp;
    if (row >= rows) return;  // no block-wide barriers below
    const int qb = (row % t) / bs;
    int* o = sel + (size_t)row * kk;
    if (qb < kk) {
        for (int p = lane; p < kk; p += 32) o[p] = p <= qb ? p : -1;
        return;
    }
    unsigned* keys = tk_smem + (size_t)warp * (nb + 256);
    unsigned* hist = keys + nb;
    const float* srow = scores + (size_t)row * nb;
    for (int x = lane; x < nb; x += 32) {
        const unsigned u = __float_as_uint(srow[x]);
        keys[x] = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    __syncwarp();

    unsigned prefix = 0, pmask = 0;
    int rem = kk;  // how many keys with the current prefix still belong to the top K
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int x = lane; x < 256; x += 32) hist[x] = 0;
        __syncwarp();
        for (int x = lane; x < nb; x += 32) {
            const unsigned key = keys[x];
            if ((key & pmask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncwarp();
        // Lane l holds digits 255 − 8l .. 248 − 8l (descending); scan from the top.
        unsigned cnt[8], tot = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            cnt[e] = hist[255 - 8 * lane - e];
            tot += cnt[e];
        }
        unsigned inc = tot;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const unsigned y = __shfl_up_sync(0xffffffffu, inc, off);
            if (lane >= off) inc += y;
        }
        const unsigned exc = inc - tot;
        const unsigned ball = __ballot_sync(0xffffffffu, exc < (unsigned)rem && (unsigned)rem <= inc);
        const int src = __ffs(ball) - 1;
        int digit = 0;
        unsigned above = 0;
        if (lane == src) {
            unsigned a = exc;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                if (a + cnt[e] >= (unsigned)rem) {
                    digit = 255 - 8 * lane - e;
                    above = a;
                    break;
                }
                a += cnt[e];
            }
        }
        digit = __shfl_sync(0xffffffffu, digit, src);
        above = __shfl_sync(0xffffffffu, above, src);
        rem -= (int)above;
        prefix |= (unsigned)digit << shift;
        pmask |= 255u << shift;
        __syncwarp();
    }
    // prefix is the K-th largest key; the first `rem` keys equal to it (by index) are taken.
    const unsigned lt = (1u << lane) - 1u;
    int written = 0, eq_seen = 0;
    const int end = min(nb, qb + 1);  // later blocks are dropped (and only follow in the tie order)
    for (int base = 0; base < end; base += 32) {
        const int x = base + lane;
        const unsigned key = x < end ? keys[x] : 0u;
        const bool gt = x < end && key > prefix;
        const bool eq = x < end && key == prefix;
        const unsigned eqb = __ballot_sync(0xffffffffu, eq);
        const bool take = gt || (eq && eq_seen + __popc(eqb & lt) < rem);
        eq_seen += __popc(eqb);
        const unsigned kb = __ballot_sync(0xffffffffu, take);
        if (take) o[written + __popc(kb & lt)] = x;
        written += __popc(kb);
    }
    for (int p = written + lane; p < kk; p += 32) o[p] = -1;
}

// ---------------------------------------------------------------------------------------------
// Stage 2: block-sparse causal attention. CPU twin: model/infllm.rs block_sparse_attention.
//
//   o[b, i, h] = Σ_{s ∈ S(i)} softmax_s(q[b, i, h]·k[b, s, g]·scale) v[b, s, g],
//   S(i) = {s ≤ i : s / 64 ∈ sel[b, g, i, :]},  g = h / G,  scale = 1/sqrt(D),
//
// one selection per query token and kv head, shared by the kv group's G query heads. Entries −1,
// out of range, or after the token's block are ignored. A row with no key (impossible with
// selections from infllm_select, which always keep the query's own block) is written as 0.
//
// Launch: grid (ceil(T / TPC), KV, B), BM·2 threads (BM/16 warps), TPC = (BM/16)·(16/G) tokens per
// block, dynamic shared memory 32 KB + (TPC + 1)·ceil(NB/32)·4 bytes. Rows are tiled as in stage
// 1: warp w owns 16/G consecutive tokens × the G heads of kv head g (one token's 16 heads for the
// released model). The block first turns its tokens' selections into one bit mask per token
// and their union; it then visits the union's blocks in ascending order, streaming each block's
// 64 keys and values through shared memory exactly as flash_attn_causal_impl streams its key tiles
// (cp.async: K of the next block loads during P·V, V of this block during Q·Kᵀ; mma.sync BF16,
// f32 online softmax in base 2, P rounded to BF16 for P·V). Every row masks to −inf the keys of a
// block its token did not select and the keys after the token, so each row's result is exactly
// per-token attention over its own selection; a warp none of whose tokens selected the block
// skips its products. With every block selected the arithmetic per row is the dense kernel's.
// ---------------------------------------------------------------------------------------------

template <int G, int BM>
__device__ __forceinline__ void infllm_attend_impl(const __nv_bfloat16* __restrict__ q,
                                                   const __nv_bfloat16* __restrict__ k,
                                                   const __nv_bfloat16* __restrict__ v,
                                                   const int* __restrict__ sel,
                                                   __nv_bfloat16* __restrict__ o, int t, int nh,
                                                   int nkv, int nb, int kk, float scale) {
    constexpr int THREADS = BM * 2;
    constexpr int WARPS = BM / 16;
    constexpr int TPW = 16 / G;
    constexpr int TPC = WARPS * TPW;
    constexpr int NO = IL_D / 8;    // n-tiles of O
    constexpr int KP = IL_BN / 16;  // k-steps of P·V
    extern __shared__ __align__(128) uint4 dsmem[];
    uint4* sq = dsmem;  // the Q tile first (BM ≤ 128 rows fit the K and V space)
    uint4* sk = dsmem;
    uint4* sv = dsmem + IL_TILE;
    const int words = (nb + 31) / 32;
    unsigned* smask = reinterpret_cast<unsigned*>(dsmem + 2 * IL_TILE);  // [TPC][words]
    unsigned* suni = smask + TPC * words;                                // [words]

    const int i0 = (gridDim.x - 1 - blockIdx.x) * TPC;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gr = lane / 4, t4 = lane % 4;
    const float sl2 = scale * 1.4426950408889634f;

    // The selections as bit masks (blocks with at least one key at or before the token).
    for (int x = threadIdx.x; x < (TPC + 1) * words; x += THREADS) smask[x] = 0u;
    __syncthreads();
    for (int x = threadIdx.x; x < TPC * kk; x += THREADS) {
        const int tl = x / kk;
        const int tok = i0 + tl;
        if (tok >= t) continue;
        const int blk = sel[(((size_t)b * nkv + kvh) * t + tok) * kk + x % kk];
        if (blk >= 0 && blk < nb && blk * IL_BN <= tok) {
            atomicOr(&smask[tl * words + blk / 32], 1u << (blk % 32));
        }
    }
    __syncthreads();
    for (int w = threadIdx.x; w < words; w += THREADS) {
        unsigned u = 0u;
        for (int tl = 0; tl < TPC; ++tl) u |= smask[tl * words + w];
        suni[w] = u;
    }
    __syncthreads();

    // The union's blocks in ascending order (every thread walks the same words).
    int wi = 0;
    unsigned bits = words > 0 ? suni[0] : 0u;
    auto next_block = [&]() -> int {
        while (bits == 0u) {
            if (++wi >= words) return -1;
            bits = suni[wi];
        }
        const int blk = wi * 32 + __ffs(bits) - 1;
        bits &= bits - 1u;
        return blk;
    };

    const size_t qstride = (size_t)nh * IL_D, kstride = (size_t)nkv * IL_D;
    const __nv_bfloat16* kg = k + ((size_t)b * t * nkv + kvh) * IL_D;
    const __nv_bfloat16* vg = v + ((size_t)b * t * nkv + kvh) * IL_D;

    il_load_q<G, THREADS>(sq, q, BM, b, i0, kvh, t, nh);
    il_cp_commit();
    il_cp_wait_all();
    __syncthreads();
    unsigned qf[IL_KS][4];
#pragma unroll
    for (int ks = 0; ks < IL_KS; ++ks) {
        il_ldsm_x4(qf[ks], sq + il_swz(warp * 16 + (lane % 16), ks * 2 + lane / 16));
    }
    __syncthreads();  // Q is in registers: its space takes K and V

    int cur = next_block();
    if (cur >= 0) {
        il_load_tile<THREADS>(sk, kg, cur * IL_BN, t, kstride);
        il_cp_commit();
    }

    float acc[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
    int tok[2], tl[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tl[r] = warp * TPW + (gr + 8 * r) / G;
        tok[r] = i0 + tl[r];
    }

    while (cur >= 0) {
        const int nxt = next_block();
        il_cp_wait_all();  // K of block cur
        __syncthreads();   // also: every warp is done with the previous block's V
        il_load_tile<THREADS>(sv, vg, cur * IL_BN, t, kstride);
        il_cp_commit();
        const int k0 = cur * IL_BN;
        bool mem[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mem[r] = tok[r] < t && ((smask[tl[r] * words + cur / 32] >> (cur % 32)) & 1u);
        }
        const bool active = __any_sync(0xffffffffu, mem[0] || mem[1]);

        float s[IL_NS][4];
        unsigned pf[KP][4];
        if (active) {
            il_qk(s, qf, sk, lane);
            if (!mem[0] || !mem[1] || k0 + IL_BN - 1 > min(tok[0], tok[1])) {
#pragma unroll
                for (int n = 0; n < IL_NS; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = e >> 1;
                        const int key = k0 + n * 8 + t4 * 2 + (e & 1);
                        if (!mem[r] || key > tok[r]) s[n][e] = -INFINITY;
                    }
                }
            }

            // Online softmax in f32, two rows per thread (a row spans the 4 lanes of a quad).
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int n = 0; n < IL_NS; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mnew = fmaxf(mrow[r], mx * sl2);
                // A row that has seen no key yet keeps max −inf: exponents relative to 0 then
                // give p = 0 and alpha = 0 (its sums are still 0) instead of NaN.
                const float mb = mnew == -INFINITY ? 0.0f : mnew;
                const float alpha = exp2f(mrow[r] - mb);
                mrow[r] = mnew;
                float sum = 0.0f;
#pragma unroll
                for (int n = 0; n < IL_NS; ++n) {
                    const float p0 = exp2f(fmaf(s[n][2 * r], sl2, -mb));
                    const float p1 = exp2f(fmaf(s[n][2 * r + 1], sl2, -mb));
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
#pragma unroll
            for (int kp = 0; kp < KP; ++kp) {
                pf[kp][0] = il_pack_bf16(s[2 * kp][0], s[2 * kp][1]);
                pf[kp][1] = il_pack_bf16(s[2 * kp][2], s[2 * kp][3]);
                pf[kp][2] = il_pack_bf16(s[2 * kp + 1][0], s[2 * kp + 1][1]);
                pf[kp][3] = il_pack_bf16(s[2 * kp + 1][2], s[2 * kp + 1][3]);
            }
        }

        il_cp_wait_all();  // V of block cur
        __syncthreads();   // also: every warp is done with K of block cur
        if (nxt >= 0) {
            il_load_tile<THREADS>(sk, kg, nxt * IL_BN, t, kstride);
            il_cp_commit();
        }

        if (active) {
#pragma unroll
            for (int kp = 0; kp < KP; ++kp) {
#pragma unroll
                for (int dp = 0; dp < IL_D / 16; ++dp) {
                    const int mi = lane / 8;
                    const int key = kp * 16 + (mi % 2) * 8 + lane % 8;
                    unsigned bf[4];
                    il_ldsm_x4_t(bf, sv + il_swz(key, dp * 2 + mi / 2));
                    il_mma(acc[2 * dp], pf[kp], bf[0], bf[1]);
                    il_mma(acc[2 * dp + 1], pf[kp], bf[2], bf[3]);
                }
            }
        }
        cur = nxt;
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = lrow[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        if (tok[r] < t) {
            const int h = kvh * G + (gr + 8 * r) % G;
            __nv_bfloat16* orow = o + ((size_t)b * t + tok[r]) * qstride + (size_t)h * IL_D;
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                *reinterpret_cast<__nv_bfloat162*>(orow + n * 8 + t4 * 2) =
                    __floats2bfloat162_rn(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
            }
        }
    }
}

// infllm_attend_g{G}_m{BM}(q, k, v, sel, o, T, H, KV, NB, K, scale): grid (ceil(T / (BM/G)), KV,
// B), BM·2 threads, 32768 + (BM/G + 1)·ceil(NB/32)·4 bytes of dynamic shared memory.
#define IL_ATTEND_KERNEL(G, BM)                                                                    \
    extern "C" __global__ void __launch_bounds__(BM * 2) infllm_attend_g##G##_m##BM(              \
        const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,                  \
        const __nv_bfloat16* __restrict__ v, const int* __restrict__ sel,                          \
        __nv_bfloat16* __restrict__ o, int t, int nh, int nkv, int nb, int kk, float scale) {      \
        infllm_attend_impl<G, BM>(q, k, v, sel, o, t, nh, nkv, nb, kk, scale);                     \
    }
IL_ATTEND_KERNEL(1, 64)
IL_ATTEND_KERNEL(2, 64)
IL_ATTEND_KERNEL(4, 64)
IL_ATTEND_KERNEL(8, 64)
IL_ATTEND_KERNEL(16, 64)
IL_ATTEND_KERNEL(1, 128)
IL_ATTEND_KERNEL(2, 128)
IL_ATTEND_KERNEL(4, 128)
IL_ATTEND_KERNEL(8, 128)
IL_ATTEND_KERNEL(16, 128)
