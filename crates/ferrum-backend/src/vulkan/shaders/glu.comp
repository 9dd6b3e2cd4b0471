#version 450
// out[t, i] = act(x[t, i]) * x[t, i + width]. ACT 0 SiLU, 1 tanh-GELU, 2 gpt-oss's clamped
// SwiGLU ((min(up,±limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)), 3 exact
// (erf) GELU.
layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) buffer O { float o[]; };
layout(push_constant) uniform P {
    uint x_off; uint x_stride; uint o_off; uint o_stride; uint width; uint count; uint grid_x;
    uint act; float alpha; float limit;
} p;

void main() {
    uint g = (gl_WorkGroupID.x + gl_WorkGroupID.y * p.grid_x) * 64u + gl_LocalInvocationID.x;
    if (g >= p.count * p.width) return;
    uint t = g / p.width, i = g % p.width;
    float a = x[p.x_off + t * p.x_stride + i];
    float u = x[p.x_off + t * p.x_stride + p.width + i];
    float r;
    if (p.act == 0u) {
        r = a / (1.0 + exp(-a)) * u;
    } else if (p.act == 1u) {
        // tanh(z) = 1 - 2 / (exp(2z) + 1), which saturates cleanly for large |z|.
        float z = 0.7978845608028654 * (a + 0.044715 * a * a * a);
        float th = 1.0 - 2.0 / (exp(2.0 * z) + 1.0);
        r = 0.5 * a * (1.0 + th) * u;
    } else if (p.act == 3u) {
        // GLSL has no erf: the CPU backend's rational approximation (host_ops::erf).
        float z = clamp(a * 0.70710678118654752, -4.0, 4.0);
        float z2 = z * z;
        float pn = -2.7261423e-10;
        pn = pn * z2 + 2.7706814e-8;
        pn = pn * z2 - 2.101024e-6;
        pn = pn * z2 - 5.6925064e-5;
        pn = pn * z2 - 7.3499063e-4;
        pn = pn * z2 - 2.9546003e-3;
        pn = pn * z2 - 1.6096033e-2;
        float qn = -1.4566072e-5;
        qn = qn * z2 - 2.1337406e-4;
        qn = qn * z2 - 1.682827e-3;
        qn = qn * z2 - 7.373329e-3;
        qn = qn * z2 - 1.426474e-2;
        r = 0.5 * a * (1.0 + z * pn / qn) * u;
    } else {
        float gg = min(a, p.limit);
        float uu = clamp(u, -p.limit, p.limit);
        r = (uu + 1.0) * (gg / (1.0 + exp(-p.alpha * gg)));
    }
    o[p.o_off + t * p.o_stride + i] = r;
}
