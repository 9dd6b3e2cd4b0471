// ferrum's CUDA kernels. Compiled to PTX for sm_80 and sm_90 by scripts/cuda/build-ptx.sh
// (NVRTC 13.0 from the PyPI wheel; no CUDA toolkit needed), the PTX committed beside this file
// and embedded by src/cuda/mod.rs. No headers: NVRTC's built-ins only, so nothing but the
// NVRTC wheel is needed to regenerate it.
//
// UNVERIFIED: written without a GPU. The `cuda` feature that embeds them is off by default
// until tests/cuda.rs has passed on a device.

// f16 bits to f32 without cuda_fp16.h.
__device__ __forceinline__ float f16_bits_to_f32(unsigned short bits) {
    float f;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(bits));
    return f;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// RMSNorm of `rows` rows of `width` floats: one block per row, blockDim.x a multiple of 32
// (at most 1024). out = w * (x / sqrt(mean(x^2) + eps)).
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ out, int width, float eps) {
    __shared__ float part[32];
    const float* xr = x + (size_t)blockIdx.x * width;
    float* orow = out + (size_t)blockIdx.x * width;
    float s = 0.f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = xr[i];
        s = fmaf(v, v, s);
    }
    s = warp_sum(s);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) part[0] = s;
    }
    __syncthreads();
    const float inv = rsqrtf(part[0] / (float)width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) orow[i] = w[i] * (xr[i] * inv);
}

// Activations to 8 bits in blocks of 32 (llama.cpp's Q8_0 for activations): one warp per
// block, lane i quantises value i. d = max|x| / 127, q = round(x / d) (ties to even).
extern "C" __global__ void quantize_q8_f32(const float* __restrict__ x, signed char* __restrict__ q,
                                           float* __restrict__ d, int blocks) {
    const int warps = blockDim.x >> 5;
    const int b = blockIdx.x * warps + (threadIdx.x >> 5);
    if (b >= blocks) return;
    const int lane = threadIdx.x & 31;
    const float v = x[(size_t)b * 32 + lane];
    const float amax = warp_max(fabsf(v));
    // 1 / (amax / 127), not 127 / amax: the CPU's quantiser's reciprocal, so the bytes agree.
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    q[(size_t)b * 32 + lane] = (signed char)__float2int_rn(v * inv);
    if (lane == 0) d[b] = scale;
}

// Q8_0 weights (the GGUF layout: per block of 32, an f16 scale then 32 int8, 34 bytes)
// times 8-bit activations (quantize_q8_f32's q and d): out[r] = sum over blocks of
// d_w * d_x * dp4a sums. One warp per row; lane l takes blocks l, l + 32, ...
extern "C" __global__ void matvec_q8_0(const unsigned char* __restrict__ w,
                                       const signed char* __restrict__ xq,
                                       const float* __restrict__ xd, float* __restrict__ out,
                                       int rows, int blocks_per_row) {
    const int warps = blockDim.x >> 5;
    const int r = blockIdx.x * warps + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31;
    const unsigned char* wr = w + (size_t)r * blocks_per_row * 34;
    float acc = 0.f;
    for (int b = lane; b < blocks_per_row; b += 32) {
        const unsigned char* blk = wr + (size_t)b * 34;
        // A block is only 2-byte aligned: its scale and quants read in 16-bit halves.
        const unsigned short* h = (const unsigned short*)blk;
        const float dw = f16_bits_to_f32(h[0]);
        const int* a = (const int*)(xq + (size_t)b * 32);
        int isum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int lo = h[1 + 2 * j], hi = h[2 + 2 * j];
            isum = __dp4a(lo | (hi << 16), a[j], isum);
        }
        acc = fmaf((float)isum, dw * xd[b], acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) out[r] = acc;
}
