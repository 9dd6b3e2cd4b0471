#version 450
// Row-indexed copies: MODE 0 writes src row t to dst row idx[t] (the KV cache's slots);
// MODE 1 reads src row idx[t] into dst row t (a MoE expert's tokens).
layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer S { float s[]; };
layout(std430, binding = 1) buffer D { float d[]; };
layout(std430, binding = 2) readonly buffer I { uint idx[]; };
layout(push_constant) uniform P {
    uint s_off; uint s_stride; uint d_off; uint d_stride; uint width; uint count; uint grid_x;
    uint mode;
} p;

void main() {
    uint g = (gl_WorkGroupID.x + gl_WorkGroupID.y * p.grid_x) * 64u + gl_LocalInvocationID.x;
    if (g >= p.count * p.width) return;
    uint t = g / p.width, e = g % p.width;
    uint st = p.mode == 0u ? t : idx[t], dt = p.mode == 0u ? idx[t] : t;
    d[p.d_off + dt * p.d_stride + e] = s[p.s_off + st * p.s_stride + e];
}
