#version 450
// dst[t, e] = src[t, e] for strided rows (src and dst may be one buffer, not overlapping).
layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer S { float s[]; };
layout(std430, binding = 1) buffer D { float d[]; };
layout(push_constant) uniform P {
    uint s_off; uint s_stride; uint d_off; uint d_stride; uint width; uint count; uint grid_x;
} p;

void main() {
    uint g = (gl_WorkGroupID.x + gl_WorkGroupID.y * p.grid_x) * 64u + gl_LocalInvocationID.x;
    if (g >= p.count * p.width) return;
    uint t = g / p.width, e = g % p.width;
    d[p.d_off + t * p.d_stride + e] = s[p.s_off + t * p.s_stride + e];
}
