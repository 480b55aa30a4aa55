// Seed (MLX Metal dialect): one thread per (batch, channel), loop over the N states, exp, f32 math.
const uint i = thread_position_in_grid.x;
if (i >= uint(batch * D)) return;
const uint b = i / D, c = i % D;
const float dt = float(delta[i]), ut = float(u[i]);
float acc = 0.0f;
for (int s = 0; s < N; s++) {
    const uint j = i * N + s;
    const float hn = metal::exp(dt * A[c * N + s]) * state_in[j] + dt * float(Bm[b * N + s]) * ut;
    state_out[j] = hn;
    acc += float(Cm[b * N + s]) * hn;
}
y[i] = acc + Dv[c] * ut;
