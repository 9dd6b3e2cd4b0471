#version 450
// Rotates each head of each row in place; cos and sin come from the host (per row and
// pair, the angle formed as the CPU backend forms it), one thread per rotated pair.
layout(local_size_x = 64) in;
layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer CS { float cs[]; };
layout(push_constant) uniform P {
    uint x_off; uint x_stride; uint heads; uint head_dim; uint half_rot; uint interleaved;
    uint count; uint grid_x;
} p;

void main() {
    uint g = (gl_WorkGroupID.x + gl_WorkGroupID.y * p.grid_x) * 64u + gl_LocalInvocationID.x;
    if (g >= p.count * p.heads * p.half_rot) return;
    uint i = g % p.half_rot, h = (g / p.half_rot) % p.heads, t = g / (p.half_rot * p.heads);
    float c = cs[t * p.half_rot + i], s = cs[(p.count + t) * p.half_rot + i];
    uint base = p.x_off + t * p.x_stride + h * p.head_dim;
    uint a = p.interleaved != 0u ? base + 2u * i : base + i;
    uint b = p.interleaved != 0u ? a + 1u : a + p.half_rot;
    float x0 = x[a], x1 = x[b];
    x[a] = x0 * c - x1 * s;
    x[b] = x1 * c + x0 * s;
}
