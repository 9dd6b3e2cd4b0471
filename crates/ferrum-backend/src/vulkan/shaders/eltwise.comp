#version 450
// Element-wise ops over strided rows of x, with y a second view where the op reads one:
// OP 0 fill (x = value), 1 scale (x *= value), 2 add (x += y),
// 3 sigmoid gate (x *= sigmoid(y), y one value per row when y_width is 1).
layout(local_size_x = 64) in;
layout(std430, binding = 0) buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer Y { float y[]; };
layout(push_constant) uniform P {
    uint x_off; uint x_stride; uint y_off; uint y_stride; uint width; uint count; uint grid_x;
    uint op; float value; uint y_width;
} p;

void main() {
    uint g = (gl_WorkGroupID.x + gl_WorkGroupID.y * p.grid_x) * 64u + gl_LocalInvocationID.x;
    if (g >= p.count * p.width) return;
    uint t = g / p.width, e = g % p.width;
    uint xi = p.x_off + t * p.x_stride + e;
    if (p.op == 0u) {
        x[xi] = p.value;
    } else if (p.op == 1u) {
        x[xi] = x[xi] * p.value;
    } else if (p.op == 2u) {
        x[xi] = x[xi] + y[p.y_off + t * p.y_stride + e];
    } else {
        float gate = y[p.y_off + t * p.y_stride + (p.y_width == 1u ? 0u : e)];
        x[xi] = x[xi] * (1.0 / (1.0 + exp(-gate)));
    }
}
