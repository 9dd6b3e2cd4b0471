// A weight row is read in units of 32 values: `load32(blk, i0, n, v)` writes values
// i0 .. i0 + n of the block at byte `blk` of the weight buffer into v, in GGML's layouts
// (ggml-common.h), each scale and minimum decoded once per unit. Every 16-bit field of every
// format sits at an even byte (the blocks are even-sized, and rows start at offset 0 or at
// whole rows), so it is one load; MXFP4's 17-byte blocks are read byte by byte. Float
// formats are blocks of one value: `blk` is then value i0's byte and i0 is 0.

layout(std430, binding = 0) readonly buffer Weights { uint w[]; };

uint rd8(uint b) { return (w[b >> 2] >> ((b & 3u) * 8u)) & 0xffu; }
uint rd16(uint b) { return (w[b >> 2] >> ((b & 2u) * 8u)) & 0xffffu; }
float rdh(uint b) { return unpackHalf2x16(rd16(b)).x; }
int sx8(uint v) { return int(v << 24) >> 24; }

#if FMT == 0 // F32
#define BLOCK 1u
#define BLOCK_BYTES 4u
void load32(uint blk, uint i0, uint n, out float v[32]) {
    [[unroll]] for (uint i = 0u; i < 32u; i++) v[i] = i < n ? uintBitsToFloat(w[(blk >> 2) + i]) : 0.0;
}
#elif FMT == 1 || FMT == 2 // F16, BF16
#define BLOCK 1u
#define BLOCK_BYTES 2u
void load32(uint blk, uint i0, uint n, out float v[32]) {
    [[unroll]] for (uint i = 0u; i < 32u; i++) {
        uint h = i < n ? rd16(blk + 2u * i) : 0u;
#if FMT == 1
        v[i] = unpackHalf2x16(h).x;
#else
        v[i] = uintBitsToFloat(h << 16);
#endif
    }
}
#elif FMT >= 3 && FMT <= 6 // Q4_0, Q4_1, Q5_0, Q5_1: [d, [m,] [qh u32,] 16 bytes of nibbles]
#define BLOCK 32u
#if FMT == 3
#define BLOCK_BYTES 18u
#define QS 2u
#elif FMT == 4
#define BLOCK_BYTES 20u
#define QS 4u
#elif FMT == 5
#define BLOCK_BYTES 22u
#define QS 6u
#else
#define BLOCK_BYTES 24u
#define QS 8u
#endif
void load32(uint blk, uint i0, uint n, out float v[32]) {
    float d = rdh(blk);
#if FMT == 4 || FMT == 6
    float m = rdh(blk + 2u);
#endif
#if FMT == 5 || FMT == 6
    uint qh = rd16(blk + QS - 4u) | (rd16(blk + QS - 2u) << 16);
#endif
    [[unroll]] for (uint j = 0u; j < 8u; j++) {
        uint b = rd16(blk + QS + 2u * j);
        [[unroll]] for (uint h = 0u; h < 2u; h++) {
            uint i = 2u * j + h;
            uint lo = (b >> (8u * h)) & 15u, hi = (b >> (8u * h + 4u)) & 15u;
#if FMT == 5 || FMT == 6
            lo |= ((qh >> i) & 1u) << 4;
            hi |= ((qh >> (i + 16u)) & 1u) << 4;
#endif
#if FMT == 3
            v[i] = d * float(int(lo) - 8);
            v[i + 16u] = d * float(int(hi) - 8);
#elif FMT == 5
            v[i] = d * float(int(lo) - 16);
            v[i + 16u] = d * float(int(hi) - 16);
#else
            v[i] = d * float(lo) + m;
            v[i + 16u] = d * float(hi) + m;
#endif
        }
    }
}
#elif FMT == 7 // Q8_0: d, 32 signed bytes
#define BLOCK 32u
#define BLOCK_BYTES 34u
void load32(uint blk, uint i0, uint n, out float v[32]) {
    float d = rdh(blk);
    [[unroll]] for (uint j = 0u; j < 16u; j++) {
        uint b = rd16(blk + 2u + 2u * j);
        v[2u * j] = d * float(sx8(b & 0xffu));
        v[2u * j + 1u] = d * float(sx8(b >> 8));
    }
}
#elif FMT == 8 // Q2_K: scales[16], qs[64], d, dmin; unit s is 128-half n, 2-bit plane j
#define BLOCK 256u
#define BLOCK_BYTES 84u
void load32(uint blk, uint i0, uint n, out float v[32]) {
    uint s = i0 >> 5, hn = s >> 2, j = s & 3u;
    float d = rdh(blk + 80u), dmin = rdh(blk + 82u);
    uint sc2 = rd16(blk + 8u * hn + 2u * j);
    [[unroll]] for (uint l2 = 0u; l2 < 16u; l2++) {
        uint b = rd16(blk + 16u + 32u * hn + 2u * l2);
        [[unroll]] for (uint h = 0u; h < 2u; h++) {
            uint l = 2u * l2 + h;
            uint sc = (sc2 >> (8u * (l >> 4))) & 0xffu;
            uint q = (b >> (8u * h + 2u * j)) & 3u;
            v[l] = d * float(sc & 15u) * float(q) - dmin * float(sc >> 4);
        }
    }
}
#elif FMT == 9 // Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales), d
#define BLOCK 256u
#define BLOCK_BYTES 110u
int q3_scale(uint blk, uint k) {
    uint lo = k < 8u ? rd8(blk + 96u + k) & 15u : rd8(blk + 96u + k - 8u) >> 4;
    uint hi = (rd8(blk + 104u + (k & 3u)) >> (2u * (k >> 2))) & 3u;
    return int(lo | (hi << 4)) - 32;
}
void load32(uint blk, uint i0, uint n, out float v[32]) {
    uint s = i0 >> 5, hn = s >> 2, j = s & 3u;
    float d = rdh(blk + 108u);
    float d0 = d * float(q3_scale(blk, 8u * hn + 2u * j));
    float d1 = d * float(q3_scale(blk, 8u * hn + 2u * j + 1u));
    [[unroll]] for (uint l2 = 0u; l2 < 16u; l2++) {
        uint b = rd16(blk + 32u + 32u * hn + 2u * l2);
        uint m = rd16(blk + 2u * l2);
        [[unroll]] for (uint h = 0u; h < 2u; h++) {
            uint l = 2u * l2 + h;
            int q = int((b >> (8u * h + 2u * j)) & 3u);
            if (((m >> (8u * h + 4u * hn + j)) & 1u) == 0u) q -= 4;
            v[l] = (l < 16u ? d0 : d1) * float(q);
        }
    }
}
#elif FMT == 10 || FMT == 11 // Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales/mins, [qh[32],] qs[128]
#define BLOCK 256u
#if FMT == 10
#define BLOCK_BYTES 144u
#define QS 16u
#else
#define BLOCK_BYTES 176u
#define QS 48u
#endif
void load32(uint blk, uint i0, uint n, out float v[32]) {
    uint j = i0 >> 5, sb = blk + 4u;
    uint sc, m;
    if (j < 4u) {
        sc = rd8(sb + j) & 63u;
        m = rd8(sb + j + 4u) & 63u;
    } else {
        sc = (rd8(sb + j + 4u) & 15u) | ((rd8(sb + j - 4u) >> 6) << 4);
        m = (rd8(sb + j + 4u) >> 4) | ((rd8(sb + j) >> 6) << 4);
    }
    float d = rdh(blk) * float(sc), dm = rdh(blk + 2u) * float(m);
    uint shift = 4u * (j & 1u);
    [[unroll]] for (uint l2 = 0u; l2 < 16u; l2++) {
        uint b = rd16(blk + QS + 32u * (j >> 1) + 2u * l2);
#if FMT == 11
        uint hb = rd16(blk + 16u + 2u * l2);
#endif
        [[unroll]] for (uint h = 0u; h < 2u; h++) {
            uint q = (b >> (8u * h + shift)) & 15u;
#if FMT == 11
            q |= ((hb >> (8u * h + j)) & 1u) << 4;
#endif
            v[2u * l2 + h] = d * float(q) - dm;
        }
    }
}
#elif FMT == 12 // Q6_K: ql[128], qh[64], scales[16] (signed), d
#define BLOCK 256u
#define BLOCK_BYTES 210u
void load32(uint blk, uint i0, uint n, out float v[32]) {
    uint s = i0 >> 5, hn = s >> 2, quarter = s & 3u;
    float d = rdh(blk + 208u);
    uint sc2 = rd16(blk + 192u + 8u * hn + 2u * quarter);
    float d0 = d * float(sx8(sc2 & 0xffu)), d1 = d * float(sx8(sc2 >> 8));
    uint lshift = (quarter >> 1) * 4u, hshift = 2u * quarter;
    [[unroll]] for (uint l2 = 0u; l2 < 16u; l2++) {
        uint lo = rd16(blk + 64u * hn + (quarter & 1u) * 32u + 2u * l2);
        uint hi = rd16(blk + 128u + 32u * hn + 2u * l2);
        [[unroll]] for (uint h = 0u; h < 2u; h++) {
            uint l = 2u * l2 + h;
            uint q = ((lo >> (8u * h + lshift)) & 15u) | (((hi >> (8u * h + hshift)) & 3u) << 4);
            v[l] = (l < 16u ? d0 : d1) * float(int(q) - 32);
        }
    }
}
#elif FMT == 13 // MXFP4: an E8M0 exponent, 16 bytes of E2M1 nibbles
#define BLOCK 32u
#define BLOCK_BYTES 17u
const float E2M1[16] = float[16](0., 1., 2., 3., 4., 6., 8., 12., 0., -1., -2., -3., -4., -6., -8., -12.);
void load32(uint blk, uint i0, uint n, out float v[32]) {
    uint e = rd8(blk);
    // GGML's E8M0 "half" scale: 2^(e - 128), the doubled table above making up the factor 2.
    float d = uintBitsToFloat(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
    [[unroll]] for (uint j = 0u; j < 16u; j++) {
        uint b = rd8(blk + 1u + j);
        v[j] = d * E2M1[b & 15u];
        v[j + 16u] = d * E2M1[b >> 4];
    }
}
#else
#error unknown FMT
#endif
