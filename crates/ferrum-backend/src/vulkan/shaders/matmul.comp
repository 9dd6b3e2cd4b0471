#version 450
// out[t, j] = sum_k x[t, k] * w[j, k] (+ bias[j]): a workgroup takes ROWS weight rows and
// TT tokens (TT is 1 for decode, 8 for passes of several tokens); each row's 64 / ROWS
// threads take its 32-value units in turn, each unit dequantised once for all the tokens,
// and their partial sums meet in shared memory.
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x = 64) in;
#include "dequant.glsl"
layout(std430, binding = 1) readonly buffer X { float x[]; };
layout(std430, binding = 2) buffer O { float o[]; };
layout(std430, binding = 3) readonly buffer Bias { float bias[]; };
layout(push_constant) uniform P {
    uint w_off; uint row_bytes; uint rows; uint cols; uint tokens;
    uint x_off; uint x_stride; uint o_off; uint o_stride;
    uint has_bias; uint bias_off; uint grid_x;
} p;

// Threads per row, set when the pipeline is made: 16 on GPUs (each row's units spread over a
// half-warp), 1 on CPU devices such as lavapipe, where a workgroup's barriers cost more than
// its sums and one invocation per row vectorises across rows.
layout(constant_id = 0) const uint TPR = 16u;
#define ROWS (64u / TPR)
shared float red[64 * TT];

void main() {
    uint tid = gl_LocalInvocationID.x, lane = tid % TPR;
    uint row = (gl_WorkGroupID.x + gl_WorkGroupID.y * p.grid_x) * ROWS + tid / TPR;
    uint t0 = gl_WorkGroupID.z * TT;
    uint nt = min(TT, p.tokens - t0);
    float acc[TT];
    [[unroll]] for (uint t = 0u; t < TT; t++) acc[t] = 0.0;
    if (row < p.rows) {
        uint base = p.w_off + row * p.row_bytes;
        uint units = (p.cols + 31u) / 32u;
        for (uint u = lane; u < units; u += TPR) {
            uint k0 = u * 32u;
            uint n = min(32u, p.cols - k0);
            float v[32];
            load32(base + (k0 / BLOCK) * BLOCK_BYTES, k0 % BLOCK, n, v);
            uint xi = p.x_off + t0 * p.x_stride + k0;
            [[unroll]] for (uint t = 0u; t < TT; t++) {
                if (t < nt) {
                    float s = 0.0;
                    uint xt = xi + t * p.x_stride;
                    // A whole unit unrolled keeps v in registers; only a float row's tail
                    // takes the loop.
                    if (n == 32u) {
                        [[unroll]] for (uint i = 0u; i < 32u; i++) s += v[i] * x[xt + i];
                    } else {
                        for (uint i = 0u; i < n; i++) s += v[i] * x[xt + i];
                    }
                    acc[t] += s;
                }
            }
        }
    }
    if (TPR == 1u) {
        if (row < p.rows) {
            [[unroll]] for (uint t = 0u; t < TT; t++) {
                if (t < nt) {
                    float r = acc[t];
                    if (p.has_bias != 0u) r += bias[p.bias_off + row];
                    o[p.o_off + (t0 + t) * p.o_stride + row] = r;
                }
            }
        }
        return;
    }
    [[unroll]] for (uint t = 0u; t < TT; t++) red[t * 64u + tid] = acc[t];
    barrier();
    for (uint s = TPR / 2u; s > 0u; s >>= 1) {
        if (lane < s) {
            [[unroll]] for (uint t = 0u; t < TT; t++) red[t * 64u + tid] += red[t * 64u + tid + s];
        }
        barrier();
    }
    if (row < p.rows && lane < nt) {
        float r = red[lane * 64u + tid - lane];
        if (p.has_bias != 0u) r += bias[p.bias_off + row];
        o[p.o_off + (t0 + lane) * p.o_stride + row] = r;
    }
}
