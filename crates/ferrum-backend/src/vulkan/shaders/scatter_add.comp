#version 450
// dst[idx[t]] += scale[t] * src[t], in order of t: one thread per column walks the rows, so
// a row named twice adds in order and no two threads touch one value.
layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer S { float s[]; };
layout(std430, binding = 1) buffer D { float d[]; };
layout(std430, binding = 2) readonly buffer I { uint idx[]; };
layout(std430, binding = 3) readonly buffer C { float scale[]; };
layout(push_constant) uniform P {
    uint s_off; uint s_stride; uint d_off; uint d_stride; uint width; uint count;
} p;

void main() {
    uint e = gl_GlobalInvocationID.x;
    if (e >= p.width) return;
    for (uint t = 0u; t < p.count; t++) {
        uint di = p.d_off + idx[t] * p.d_stride + e;
        d[di] = d[di] + scale[t] * s[p.s_off + t * p.s_stride + e];
    }
}
