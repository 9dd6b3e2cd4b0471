#version 450
// out[ids[2i]] = table[ids[2i + 1]], dequantised: one workgroup per token, a 32-value unit
// per thread (a table in several parts runs once per part, on the tokens it holds).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x = 64) in;
#include "dequant.glsl"
layout(std430, binding = 1) readonly buffer Ids { uint ids[]; };
layout(std430, binding = 2) buffer O { float o[]; };
layout(push_constant) uniform P {
    uint w_off; uint row_bytes; uint cols; uint o_off; uint o_stride;
} p;

void main() {
    uint t = ids[2u * gl_WorkGroupID.x];
    uint base = p.w_off + ids[2u * gl_WorkGroupID.x + 1u] * p.row_bytes;
    for (uint u = gl_LocalInvocationID.x; u * 32u < p.cols; u += 64u) {
        uint k0 = u * 32u, n = min(32u, p.cols - k0);
        float v[32];
        load32(base + (k0 / BLOCK) * BLOCK_BYTES, k0 % BLOCK, n, v);
        uint oi = p.o_off + t * p.o_stride + k0;
        [[unroll]] for (uint i = 0u; i < 32u; i++) {
            if (i < n) o[oi + i] = v[i];
        }
    }
}
