#version 450
// RMSNorm of one head of one row per workgroup: out = x / sqrt(mean(x^2) + eps) * w. With
// `add`, the residual add comes first and is kept: x += y, then the norm of the new x.
layout(local_size_x = 64) in;
layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer Wt { float wt[]; };
layout(std430, binding = 2) buffer O { float o[]; };
layout(std430, binding = 3) readonly buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint x_off; uint x_stride; uint o_off; uint o_stride; uint heads; uint head_dim;
    uint w_off; float eps; uint grid_x; uint count; uint add; uint y_off; uint y_stride;
} p;
shared float red[64];

void main() {
    uint g = gl_WorkGroupID.x + gl_WorkGroupID.y * p.grid_x;
    if (g >= p.count * p.heads) return;
    uint t = g / p.heads, h = g % p.heads, tid = gl_LocalInvocationID.x;
    uint xi = p.x_off + t * p.x_stride + h * p.head_dim;
    uint oi = p.o_off + t * p.o_stride + h * p.head_dim;
    uint yi = p.y_off + t * p.y_stride + h * p.head_dim;
    float s = 0.0;
    for (uint k = tid; k < p.head_dim; k += 64u) {
        float v = x[xi + k];
        if (p.add != 0u) {
            v += y[yi + k];
            x[xi + k] = v;
        }
        s += v * v;
    }
    red[tid] = s;
    barrier();
    for (uint k = 32u; k > 0u; k >>= 1) {
        if (tid < k) red[tid] += red[tid + k];
        barrier();
    }
    float r = 1.0 / sqrt(red[0] / float(p.head_dim) + p.eps);
    // Every thread has read red[0] before any output is written (x may be o).
    barrier();
    for (uint k = tid; k < p.head_dim; k += 64u) o[oi + k] = x[xi + k] * r * wt[p.w_off + k];
}
