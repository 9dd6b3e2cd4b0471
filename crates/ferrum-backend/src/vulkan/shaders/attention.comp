#version 450
// Paged causal attention, one workgroup per (query row, query head): keys in tiles of 64
// (one per thread), an online softmax across tiles, each thread accumulating its share of
// the head's output dimensions. rows[2r] is row r's position, rows[2r+1] where its sequence's
// block table starts in `tables`.
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer Q { float q[]; };
layout(std430, binding = 1) readonly buffer K { float kc[]; };
layout(std430, binding = 2) readonly buffer V { float vc[]; };
layout(std430, binding = 3) buffer O { float o[]; };
layout(std430, binding = 4) readonly buffer R { uint rows[]; };
layout(std430, binding = 5) readonly buffer T { uint tables[]; };
layout(std430, binding = 6) readonly buffer Sk { float sinks[]; };
layout(push_constant) uniform P {
    uint q_off; uint q_stride; uint o_off; uint o_stride; uint heads; uint kv_heads;
    uint head_dim; uint block_size; float scale; uint window; float softcap; uint has_sinks;
    uint count; uint grid_x;
} p;

#define MAX_DIM 512u
#define PER (MAX_DIM / 64u)
shared float qs[MAX_DIM];
shared float sc[64];
shared uint slot[64];

void main() {
    uint g = gl_WorkGroupID.x + gl_WorkGroupID.y * p.grid_x;
    if (g >= p.count * p.heads) return;
    uint r = g / p.heads, h = g % p.heads, tid = gl_LocalInvocationID.x;
    uint pos = rows[2u * r], table = rows[2u * r + 1u];
    uint kvh = h / (p.heads / p.kv_heads);
    uint kw = p.kv_heads * p.head_dim;
    for (uint d = tid; d < p.head_dim; d += 64u) qs[d] = q[p.q_off + r * p.q_stride + h * p.head_dim + d];
    uint lo = (p.window != 0u && pos + 1u > p.window) ? pos + 1u - p.window : 0u;
    float m = p.has_sinks != 0u ? sinks[h] : -1.0 / 0.0;
    float l = p.has_sinks != 0u ? 1.0 : 0.0;
    float acc[PER];
    [[unroll]] for (uint i = 0u; i < PER; i++) acc[i] = 0.0;
    barrier();
    for (uint start = lo; start <= pos; start += 64u) {
        uint j = start + tid;
        float s = -1.0 / 0.0;
        uint sl = 0u;
        if (j <= pos) {
            sl = tables[table + j / p.block_size] * p.block_size + j % p.block_size;
            uint kb = sl * kw + kvh * p.head_dim;
            float dot = 0.0;
            for (uint d = 0u; d < p.head_dim; d++) dot += qs[d] * kc[kb + d];
            s = dot * p.scale;
            if (p.softcap != 0.0) {
                float z = s / p.softcap;
                s = p.softcap * (1.0 - 2.0 / (exp(2.0 * z) + 1.0));
            }
        }
        sc[tid] = s;
        slot[tid] = sl;
        barrier();
        float mt = m;
        for (uint i = 0u; i < 64u; i++) mt = max(mt, sc[i]);
        float corr = exp(m - mt);
        l *= corr;
        [[unroll]] for (uint i = 0u; i < PER; i++) acc[i] *= corr;
        uint n = min(64u, pos + 1u - start);
        for (uint i = 0u; i < n; i++) {
            float pr = exp(sc[i] - mt);
            l += pr;
            uint vb = slot[i] * kw + kvh * p.head_dim;
            [[unroll]] for (uint c = 0u; c < PER; c++) {
                uint d = tid + 64u * c;
                if (d < p.head_dim) acc[c] += pr * vc[vb + d];
            }
        }
        m = mt;
        barrier();
    }
    [[unroll]] for (uint c = 0u; c < PER; c++) {
        uint d = tid + 64u * c;
        if (d < p.head_dim) o[p.o_off + r * p.o_stride + h * p.head_dim + d] = acc[c] / l;
    }
}
